"""
nanoGPT's configurator as functions: train.py's config is its defaults (the top of train.py), then each config file
(plain Python assignments, executed) and --key=value override (literal-evaluated) in the order given. Every value must
have its default's type; every mistake is one ValueError that names the file or the flag and the fix.

    python train.py config/shakespeare_char.py --batch_size=4 --compile=True
"""
import ast
import difflib
import glob
import math
import os
import sys
import traceback
import zlib

ROOT = os.path.dirname(os.path.abspath(__file__))


def parse_config(argv, defaults, also=None):
    """The config: defaults, then each config file (executed) and --key=value override (literal-evaluated) in turn,
    each value of its default's type (or one of also[key]); an unknown key is an error naming the closest."""
    config = dict(defaults)

    def check_key(key, where):
        if key not in defaults:
            close = difflib.get_close_matches(key, defaults, n=3)
            hint = f"; did you mean {' or '.join(close)}?" if close else "; see the defaults at the top of train.py"
            raise ValueError(f"unknown config key '{key}' in {where}{hint}")

    overridden = None  # the first --key=value: a config file after it would undo it
    for arg in argv:
        if not arg.startswith('--'):
            if not os.path.isfile(arg):
                configs = ' '.join(sorted(os.path.relpath(p) for p in glob.glob(os.path.join(ROOT, 'config', '*.py'))))
                what = 'is a directory' if os.path.isdir(arg) else 'not found'
                key = f" (did you mean --{arg.lstrip('-')}?)" * ('=' in arg)
                raise ValueError(f"config file {arg} {what}{key}; the configs are: {configs}")
            if overridden:
                raise ValueError(f"config file {arg} comes after {overridden}, and would undo it: put config files first")
            namespace = {}
            try:  # compiled under the file's name: an error's line is found in the file's own frame
                with open(arg) as f:
                    code = f.read()
                exec(compile(code, arg, 'exec'), namespace)
            except Exception as e:  # one line: the file, the line, what Python said
                line = e.lineno if isinstance(e, SyntaxError) else next(
                    (t.lineno for t in reversed(traceback.extract_tb(e.__traceback__)) if t.filename == arg), None)
                raise ValueError(f"config file {arg}{f' line {line}' * bool(line)}: {type(e).__name__}: "
                                 f"{e.msg if isinstance(e, SyntaxError) else e} (a config file is Python: key = value lines)")
            keys = [k for k, v in namespace.items() if not k.startswith('_') and not callable(v) and not isinstance(v, type(sys))]
            if not keys and ast.parse(code).body:  # statements that set nothing: JSON or YAML (an empty file is fine)
                raise ValueError(f"config file {arg} sets no keys: write Python assignments, e.g. batch_size = 4")
            for key in keys:
                check_key(key, arg)
                config[key] = typed(key, namespace[key], f"{key} = {namespace[key]!r} in {arg}", defaults, also)
            continue
        overridden = overridden or arg
        key, sep, value = arg[2:].partition('=')
        if not sep:
            raise ValueError(f"expected --key=value, got '{arg}'")
        check_key(key, arg)
        try:
            value = ast.literal_eval(value)
        except (SyntaxError, ValueError):
            pass  # a bare string, e.g. --dataset=shakespeare
        config[key] = typed(key, value, f"--{key}={value!r}", defaults, also)
    return config


def typed(key, value, where, defaults, also=None):
    """value, if it has the type of key's default (an int where a float is expected becomes one), else ValueError."""
    expected, also = type(defaults[key]), (also or {}).get(key, ())
    if expected is float and type(value) is int:
        value = float(value)
    if expected is float and type(value) is float and not math.isfinite(value):  # inf passes every range check
        raise ValueError(f"{where}: {key} takes a finite float (default {defaults[key]!r})")
    if type(value) is not expected and value not in also:
        name = {'int': 'an int', 'float': 'a float', 'bool': 'True or False', 'str': 'a string'}[expected.__name__]
        raise ValueError(f"{where}: {key} takes {name}{''.join(f' or {v!r}' for v in also)} "
                         f"(default {defaults[key]!r})")
    return value


def code(root=ROOT):
    """The CRC-32 of the sources this process runs from root: its modules there (train.py's imports) and csrc/'s
    kernel. Machines with checkouts of their own may hold different commits, which pair unlike collectives."""
    root = os.path.realpath(root)  # (a script run through a symlinked path keeps that path as its __file__)
    files = {os.path.realpath(m.__file__) for m in list(sys.modules.values())
             if os.path.isabs(getattr(m, '__file__', None) or '')}  # (torch._classes' is a bare name)
    files = {f for f in files if os.path.dirname(f) == root and f.endswith('.py')}
    crc = 0
    for path in sorted(files | {f for ext in ('cu', 'cpp', 'h') for f in glob.glob(os.path.join(root, 'csrc', f'*.{ext}'))}):
        with open(path, 'rb') as f:
            crc = zlib.crc32(f.read(), crc)
    return f"{crc:08x}"


def differences(configs, per_node=()):
    """One line naming each key whose value differs between the ranks' configs (configs[r] is rank r's), or ''. A
    launcher starts each node with its own command line: one node's override of max_iters, say, had its ranks step on
    after the others ended, pairing collectives that never complete. per_node: keys that may differ (a path)."""
    said = []
    for key in configs[0]:
        ranks = {}
        for r, config in enumerate(configs):
            ranks.setdefault(repr(config.get(key)), []).append(r)
        if len(ranks) > 1 and key not in per_node:
            said.append(f"{key}: " + ', '.join(f"{value} on rank(s) {spans(rs)}" for value, rs in ranks.items()))
    return (f"the ranks' configs differ ({'; '.join(said)}): start every machine with the same code, torch, config "
            "files and --key=value overrides") if said else ''


def spans(numbers):
    """[0, 1, 2, 5, 7, 8] -> '0-2, 5, 7-8'."""
    runs = []
    for n in numbers:
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ', '.join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)

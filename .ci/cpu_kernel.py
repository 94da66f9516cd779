"""The CPU kernel (csrc/adamw_cpu.cpp) outside the library, compiled with its flags into a program of .ci/:

    python .ci/cpu_kernel.py check        # the 8-bit encode against the buckets for every fp32 xn in [-1, 1] and every
                                          # NaN, both code maps ([Note: a code from its decade]); exit 1 on a mismatch
    python .ci/cpu_kernel.py time         # ns an element in cache, one thread, every storage-precision mode; with
                                          # AVX-512 VBMI also the 8-bit encode (each map) and decode alone, a value
    python .ci/cpu_kernel.py time -DX=1   # ... with extra compiler flags (to time a variant built under #ifdef X)
    python .ci/cpu_kernel.py time --against REV   # ... beside csrc/ at a git revision (or a folder holding csrc/ and
                                          # .ci/kernel_ns.cpp), 8 runs of each in turns, the best of each line, and
                                          # the ratio: on a shared machine one run of each can differ by 10%

check builds in ~5 s and runs in ~5 s on 2 cores; test_kernels.py checks a dense subset through the kernel each run."""
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import kernels  # noqa: E402
import library  # noqa: E402

what, flags = (sys.argv[1] if len(sys.argv) > 1 else ''), sys.argv[2:]
against = None
if '--against' in flags:
    at = flags.index('--against')
    against, flags = flags[at + 1], flags[:at] + flags[at + 2:]
if what not in ('check', 'time') or (against and what != 'time'):
    sys.exit(__doc__)


def build(source, binary):
    compiler = library._compiler('cpu')[0]
    subprocess.run([compiler, *library.CPU_FLAGS, '-std=c++17', *flags, '-o', binary, source], check=True)


def best_of(binaries, tables, rounds):
    """Runs the binaries in turns; for each, every line's best (lowest) ns."""
    best = [{} for _ in binaries]
    for _ in range(rounds):
        for b, binary in zip(best, binaries):
            out = subprocess.run([binary, tables], env={**os.environ, 'OMP_NUM_THREADS': '1'}, capture_output=True,
                                 text=True, check=True).stdout
            for line in out.splitlines():
                name, ns = line[:40].rstrip(), float(line[40:].split()[0])
                b[name] = min(b.get(name, ns), ns)
    return best


with tempfile.TemporaryDirectory() as tmp:
    tables, buckets = kernels._code_tables('cpu')
    with open(os.path.join(tmp, 'tables.bin'), 'wb') as f:
        f.write(tables.numpy().tobytes() + buckets.numpy().tobytes())
    source = os.path.join(ROOT, '.ci', 'encode_check.cpp' if what == 'check' else 'kernel_ns.cpp')
    binary = os.path.join(tmp, what)
    build(source, binary)
    if against is None:
        env = {**os.environ, 'OMP_NUM_THREADS': '1'} if what == 'time' else None
        sys.exit(subprocess.run([binary, os.path.join(tmp, 'tables.bin')], env=env).returncode)
    other = against
    if not os.path.isdir(against):  # a git revision: its csrc/ and its harness
        other = os.path.join(tmp, 'other')
        os.makedirs(other)
        archive = subprocess.run(['git', 'archive', against, 'csrc', '.ci/kernel_ns.cpp'], cwd=ROOT,
                                 capture_output=True, check=True).stdout
        subprocess.run(['tar', 'x', '-C', other], input=archive, check=True)
    build(os.path.join(other, '.ci', 'kernel_ns.cpp'), binary + '_other')
    ours, theirs = best_of([binary, binary + '_other'], os.path.join(tmp, 'tables.bin'), 8)
    print(f"{'ns an element, the best of 8 runs in turns':<40} {'ours':>8} {against[-12:]:>12} {'ratio':>6}")
    for name in dict.fromkeys([*ours, *theirs]):
        a, b = ours.get(name), theirs.get(name)
        print(f"{name:<40} " + (f"{a:8.3f}" if a else f"{'-':>8}") + (f" {b:12.3f}" if b else f" {'-':>12}")
              + (f" {a / b:6.2f}" if a and b else ""))

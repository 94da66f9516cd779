"""
The GPU path as tests: what only a GPU can show (CUDA default devices, NCCL, the CUDA kernel, torch.compile on
CUDA, the profiler's CUDA kernels, max_memory_allocated). It runs by itself where CUDA is present and is skipped,
with one line saying why, where it is not; the CPU suite (every other test_*.py) never picks the GPU.

    python -m pytest -q test_gpu.py          # one GPU: NCCL at world 1, the runs in parallel, a few minutes

A GPU machine without internet needs the git-ignored data carried over: data/shakespeare*/ train.bin, val.bin,
meta.json, and data/shakespeare/vocab.bpe, encoder.json (GPT-2's BPE, written there by prepare.py).

Every train.py run is a real process (python train.py ... --device=cuda: world 1, where comm copies in place of
NCCL's collectives, comm [Note: one rank]; the in-process cases further down call NCCL), started together at
the first test that needs one (each with its own port and 2 CPU threads) and asserted on by the tests below:
the loss finite and falling, the log lines, the files written. NANOZERO_GPU_TESTS_ON_CPU=1 runs the same
harness on the CPU (gloo, fp32, small models: the assertions that need CUDA are left out) to check the
harness itself on a machine without a GPU; that is not a GPU test.
"""
import datetime
import functools
import json
import math
import os
import re
import shutil
import subprocess
import sys
import types
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
import torch.distributed as dist

import checkpoint
import launch
import resume
from model import GPT, GPTConfig

ON_CPU = os.environ.get('NANOZERO_GPU_TESTS_ON_CPU') == '1'
if not torch.cuda.is_available() and not ON_CPU:  # the whole file as one skip, whose line pytest.ini's -rs prints
    pytest.skip("test_gpu.py needs CUDA (no GPU here); the CPU suite is the other test_*.py", allow_module_level=True)
# in-process CUDA cases: not in the CPU dry run, even on a GPU machine
cuda_only = pytest.mark.skipif(not torch.cuda.is_available() or ON_CPU, reason="in-process CUDA case")
GPU = not ON_CPU
DEVICE = ['--device=cuda', '--dtype=bfloat16'] if GPU else ['--device=cpu', '--dtype=float32']
ROOT = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(ROOT, 'out-test-gpu')  # git-ignored (out*/); emptied at import: train.py refuses an out_dir that
shutil.rmtree(OUT, ignore_errors=True)  # holds an earlier run's checkpoint, so a second run of this file would fail
FEW = ['--max_iters=6', '--eval_interval=1000', '--eval_iters=2', '--log_interval=1', '--gradient_accumulation_steps=2']
# the learning rate at its peak from the first step, except in the configs' own runs: those warm up, as every config
# does, over the test's 6 iterations (the first GPU run of this file found shakespeare_char.py's 2e-3 without warmup
# jumping from 3.69 to 6.43 at iteration 6, on the CPU in fp32 too; warmed up over 5 it falls at every step, 4.86 to
# 3.96; the configs' own warmups, 50-200 iterations, leave the CPU dry run's tiny models with too small a rate to learn)
CONSTANT_LR, WARMUP = ['--warmup_iters=0', '--decay_lr=False'], ['--warmup_iters=5']
TINY = ['--n_layer=2', '--n_head=2', '--n_embd=64', '--block_size=64', '--batch_size=4']
CONFIGS = sorted(f for f in os.listdir(os.path.join(ROOT, 'config')) if f.endswith('.py'))
# the configs' own models (GPT-2 124M for gpt2_124m and zero*), a smaller batch; on the CPU, tiny models
SMALLER = ['--batch_size=4'] if GPU else TINY + ['--block_size=32']
PRECISION = {  # every key of what the optimizer stores, each at a stage (the CUDA kernel's 42 instances are in test_kernels)
    'remainder': (1, ['--master_weights=remainder']),
    'int8 state': (2, ['--state_dtype=int8']),
    'bf16 state': (3, ['--state_dtype=bfloat16']),
    'remainder + int8': (3, ['--master_weights=remainder', '--state_dtype=int8']),
    'none + stochastic rounding': (2, ['--master_weights=none', '--stochastic_rounding=True']),
    'fp16 + loss scaling': (3, ['--dtype=float16'] if GPU else []),
    'bf16 reductions': (1, ['--reduce_dtype=bfloat16']),  # stage 1's flat grad and its world-1 reduce-scatter in bf16
}


def run(name, *args, script='train.py', config='config/shakespeare_char.py', torchrun=False, timeout=420):
    """One process, world 1 (python train.py sets up a 1-rank process group itself); (returncode, stdout + stderr)."""
    env = {**os.environ, 'OMP_NUM_THREADS': '2', 'PYTHONUNBUFFERED': '1'}
    if torchrun:
        cmd = [sys.executable, '-m', 'torch.distributed.run', '--standalone', '--nproc_per_node=1', script, *args]
    else:
        env.update(RANK='0', WORLD_SIZE='1', LOCAL_RANK='0', MASTER_ADDR='127.0.0.1', MASTER_PORT=str(launch.free_port()))
        cmd = [sys.executable, script, *([config] if config else []), *args]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
        code, log = out.returncode, out.stdout + out.stderr
    except subprocess.TimeoutExpired as e:
        text = [t.decode(errors='replace') if isinstance(t, bytes) else t or '' for t in (e.stdout, e.stderr)]
        code, log = -1, f"{name}: timed out after {timeout} s\n" + ''.join(text)
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, name.replace(' ', '-') + '.log'), 'w') as f:  # to read after a failure
        f.write(' '.join(cmd) + '\n' + log)
    return code, log


def train(name, *args, config='config/shakespeare_char.py', schedule=CONSTANT_LR):
    return run(name, f'--out_dir={OUT}/{name}', *DEVICE, *FEW, *schedule, *args, config=config)


def resume_chain():
    """Stage 3 saves; the run resumes at stage 2; the checkpoint is consolidated and sampled on the GPU (sample.py's
    default device where CUDA is present)."""
    common = [*TINY, '--always_save_checkpoint=True', '--eval_interval=3']
    first = train('save', *common, '--zero_stage=3', '--max_iters=3')
    second = train('save', *common, '--zero_stage=2', '--max_iters=6', '--init_from=resume')
    model = f'{OUT}/save/model.pt'
    consolidated = run('consolidate', f'{OUT}/save', '-o', model, script='consolidate.py', config=None)
    sampled = run('sample', f'--ckpt={model}', '--start=ROMEO:', '--num_samples=1', '--max_new_tokens=50',
                  *([] if GPU else ['--device=cpu']), script='sample.py', config=None)  # GPU: its default device
    return first, second, consolidated, sampled


def stage0_resume():
    """Stage 0 (torch's DDP and fused AdamW) in fp16 (torch's GradScaler) saves, and resumes at stage 0: checkpoint.py
    feeds the saved optimizer state, its step counts on the CPU, to the fused AdamW on the GPU, and the GradScaler's
    state to the GradScaler (that the scale itself carries over is test_checkpoint.py's: in 6 steps it never moves
    from its start). The resume chain above is stage 3 -> 2: it rebuilds shards and never takes this path."""
    common = [*TINY, '--zero_stage=0', '--always_save_checkpoint=True', '--eval_interval=3',
              *(['--dtype=float16'] if GPU else [])]
    return (train('save0', *common, '--max_iters=3'),
            train('save0', *common, '--max_iters=6', '--init_from=resume'))


def jobs():
    """name -> a function returning what the test of that name asserts on."""
    out = {f'config {c}': functools.partial(train, f'config-{c[:-3]}', *SMALLER, config=f'config/{c}', schedule=WARMUP)
           for c in CONFIGS}
    out.update({f'stage {s}': functools.partial(train, f'stage{s}', *TINY, f'--zero_stage={s}') for s in range(4)})
    out['auto'] = functools.partial(train, 'auto', *TINY, '--zero_stage=auto', *([] if GPU else ['--memory_gb=8']))
    out.update({f'compile stage {s}': functools.partial(train, f'compile{s}', *TINY, f'--zero_stage={s}', '--compile=True')
                for s in (0, 2, 3)})
    out['compile stage 3 at 2 blocks a unit'] = functools.partial(
        train, 'compile3-x2', *TINY, '--n_layer=3', '--zero_stage=3', '--compile=True', '--blocks_per_unit=2')
    out.update({f'precision {k}': functools.partial(train, f'precision-{i}', *TINY, f'--zero_stage={s}',
                                                    *([] if GPU else ['--dtype=bfloat16']), *args)
                for i, (k, (s, args)) in enumerate(PRECISION.items())})
    out['profile'] = functools.partial(train, 'profile', *TINY, '--zero_stage=3', '--profile=True')
    out['resume chain'] = resume_chain
    out['stage 0 resume'] = stage0_resume
    bench_set = [f'--set={kv}' for kv in ('n_layer=2', 'n_head=2', 'n_embd=64', 'block_size=64', 'batch_size=2')]
    out['bench zero'] = functools.partial(run, 'bench zero', 'zero', '--rounds=1', *bench_set, *(
        ['--set=device=cuda', '--set=dtype=bfloat16'] if GPU else []), script='bench.py', torchrun=True)
    out['bench scale'] = functools.partial(run, 'bench scale', 'scale', '--quick', '--world=8', *bench_set, *(
        ['--set=device=cuda'] if GPU else []), script='bench.py', config=None)
    out['bench train'] = functools.partial(run, 'bench train', 'train', '--vary=zero_stage=2,3', '--iters=3', '--warm=1',
                                           *bench_set, *(['--set=device=cuda', '--set=dtype=bfloat16'] if GPU else
                                                         ['--set=device=cpu', '--nproc=1']), script='bench.py', config=None)
    return out


# jobs not to start (comma-separated names of jobs()): a short lease's pass leaves out the slow ones it deselects with
# -k, which results() would otherwise still run beside the others (.ci/gpu quick: the profiler's 84 s run)
SKIP_JOBS = set(filter(None, os.environ.get('NANOZERO_GPU_SKIP_JOBS', '').split(',')))


@functools.lru_cache(maxsize=None)
def results():
    """Every job at once (the GPU has room for all of them; each process takes 2 CPU threads), but SKIP_JOBS."""
    every = jobs()
    unknown = SKIP_JOBS - set(every)
    assert not unknown, f"NANOZERO_GPU_SKIP_JOBS names no job: {sorted(unknown)} (jobs: {sorted(every)})"
    todo = {name: job for name, job in every.items() if name not in SKIP_JOBS}
    with ThreadPoolExecutor(max_workers=8 if GPU else 2) as pool:
        futures = {name: pool.submit(job) for name, job in todo.items()}
        return {name: f.result() for name, f in futures.items()}


def result(name):
    if name in SKIP_JOBS:
        pytest.skip(f"job {name!r} not started: NANOZERO_GPU_SKIP_JOBS")
    return results()[name]


def ok(name):
    code, log = result(name)
    assert code == 0, f"{name}: exit code {code}\n{log[-4000:]}"
    return log


def losses(log):
    return [float(x) for x in re.findall(r'^iter \d+: loss ([\d.eE+-]+|nan|inf)', log, re.M)]


def assert_trains(log, stage=None, iters=6):
    """The loss of every iteration finite and the last below the first; on a GPU, NCCL, the CUDA kernel and the
    memory figure in the log."""
    got = losses(log)
    assert len(got) == iters and all(math.isfinite(x) for x in got) and got[-1] < got[0], got
    assert re.search(r'step \d+: train loss [\d.]+, val loss [\d.]+', log)
    if GPU:
        assert 'world size 1 (nccl), device cuda:0' in log
        assert re.search(r'cuda max_memory_allocated after iteration 1: [\d.]+ GiB', log)
        if stage:
            assert 'kernels.adamw_step, impl=cuda' in log
    if stage is not None:
        assert f'zero_stage={stage}' in log or stage == 0

# -----------------------------------------------------------------------------
# train.py: every config, every stage, auto, compile, every precision key


@pytest.mark.parametrize('config', CONFIGS)
def test_every_config_trains(config):
    log = ok(f'config {config}')
    assert_trains(log)


@pytest.mark.parametrize('stage', [0, 1, 2, 3])
def test_every_stage_trains(stage):
    log = ok(f'stage {stage}')
    assert_trains(log, stage)
    if stage == 0:
        assert 'optimizer: torch AdamW' in log


def test_zero_stage_auto_picks_a_stage_and_trains():
    log = ok('auto')
    picked = re.search(r'zero_stage=auto: .* -> stage (\d), the lowest that fits', log)
    assert picked, log[-3000:]
    assert_trains(log, int(picked.group(1)))


@pytest.mark.parametrize('stage', [0, 2, 3])
def test_compiled_stage_trains(stage):
    log = ok(f'compile stage {stage}')
    assert 'compiling with torch.compile' in log
    assert_trains(log, stage)


def test_compiled_stage_3_with_blocks_grouped_into_units_trains():
    """fsdp_lite [Note: blocks per unit]: 3 blocks as a unit of 2 and a unit of 1, compiled per block, on a GPU."""
    log = ok('compile stage 3 at 2 blocks a unit')
    assert 'compiling with torch.compile' in log
    assert_trains(log, 3)


@pytest.mark.parametrize('key', list(PRECISION))
def test_every_precision_key_trains(key):
    stage, args = PRECISION[key]
    log = ok(f'precision {key}')
    assert_trains(log, stage)
    stored = {'remainder': 'master      int16', 'int8 state': 'exp_avg     uint8', 'bf16 state': 'exp_avg     bfloat16',
              'remainder + int8': 'master      int16', 'none + stochastic rounding': 'exp_avg     float32',
              'bf16 reductions': 'grads       bfloat16'}
    if key in stored:
        assert stored[key] in log, log[:3000]
    if key.startswith('fp16') and GPU:
        assert re.search(r', loss scale \d+', log)

# -----------------------------------------------------------------------------
# the profiler, checkpoints, sampling


def test_profile_traces_cuda_kernels_of_iterations_2_to_4_and_stops():
    log = ok('profile')
    assert_trains(log, 3)
    events = json.load(open(f'{OUT}/profile/trace_rank0.json'))['traceEvents']
    # on CUDA each step is in the trace twice: the host's range (user_annotation) and its GPU span (gpu_user_annotation)
    steps = sorted((e for e in events if e.get('name', '').startswith('ProfilerStep#') and e.get('cat') == 'user_annotation'),
                   key=lambda e: e['ts'])
    assert [e['name'] for e in steps] == ['ProfilerStep#1', 'ProfilerStep#2', 'ProfilerStep#3']
    assert any(e.get('name', '').startswith('all_gather unit ') for e in events)
    if GPU:  # kernels run on the GPU's timeline after their launch: from the first traced step on (5 ms of slack for
        # a kernel iteration 1 queued that is still running when the trace starts)
        kernels = [e for e in events if e.get('cat') == 'kernel']
        assert len(kernels) > 100 and all(e['ts'] >= steps[0]['ts'] - 5000 for e in kernels)
    lines = [line.split(':')[0] for line in log.splitlines() if line.startswith(('iter ', 'profiler trace'))]
    assert lines.index('profiler trace of iterations 2-4') == 3  # right after iteration 4's step


def test_a_stage_3_checkpoint_resumes_at_stage_2_consolidates_and_samples():
    first, second, consolidated, sampled = result('resume chain')
    for code, log in (first, second, consolidated, sampled):
        assert code == 0, log[-4000:]
    assert 'saving checkpoint' in first[1] and re.search(r'resuming from \S+ckpt-00000003', second[1])
    assert losses(second[1]) and 'iter 1:' not in second[1] and all(math.isfinite(x) for x in losses(second[1]))
    assert 'iteration 6' in consolidated[1] and os.path.getsize(f'{OUT}/save/model.pt') > 0
    header, text = sampled[1].split('\n', 1)
    assert header.endswith(f"zero_stage=2 on 1 rank(s); sampling on {'cuda' if GPU else 'cpu'}")
    assert text.startswith('ROMEO:') and len(text) > 40


def test_a_shard_changed_at_its_size_stops_verify_with_its_flags_on_the_gpu(tmp_path, monkeypatch):
    # resume.verify on the engine's device (NCCL takes no CPU tensor; at world 1 there is no MAX to run): the
    # resume chain's newest checkpoint passes, then one byte of its shard changed is named
    assert result('resume chain')[0][0] == 0
    made, real_tensor = [], torch.tensor
    monkeypatch.setattr(torch, 'tensor', lambda *a, **kw: made.append(kw.get('device')) or real_tensor(*a, **kw))
    path = str(tmp_path / 'ckpt')
    shutil.copytree(resume.latest(f'{OUT}/save'), path)
    on = types.SimpleNamespace(rank=0, world_size=1, fake=False, process_group=None,
                               device=torch.device('cuda' if GPU else 'cpu'))
    resume.verify(path, resume.read_manifest(path), on)
    from test_checkpoint import flip_a_byte
    flip_a_byte(os.path.join(path, 'rank00000.pt'))
    with pytest.raises(resume.ChangedFile, match='rank00000.pt does not match the CRC-32'):
        resume.verify(path, resume.read_manifest(path), on)
    assert made == [on.device, on.device]  # the flags, made where the engine's collectives run


def test_set_aside_and_saves_checks_make_their_flags_on_the_gpu(tmp_path, monkeypatch):
    # resume.set_aside's flag and checkpoint.save's "saved already?" on the engine's device (at world 1 no MAX or
    # broadcast runs; test_checkpoint.py stands in for those at world 2): a ckpt-N with a manifest is not saved again,
    # then set aside as ckpt-N.damaged
    made, real_tensor = [], torch.tensor
    monkeypatch.setattr(torch, 'tensor', lambda *a, **kw: made.append(kw.get('device')) or real_tensor(*a, **kw))
    on = types.SimpleNamespace(rank=0, world_size=1, fake=False, process_group=None,
                               device=torch.device('cuda' if GPU else 'cpu'))
    path = str(tmp_path / 'ckpt-00000010')
    os.makedirs(path)
    with open(os.path.join(path, 'manifest.json'), 'w') as f:
        f.write('{}')
    assert checkpoint.save(types.SimpleNamespace(comm=on), {'out_dir': str(tmp_path)}, {}, 10, 1.0) == path
    logged = []
    resume.set_aside([(path, 'a test')], on, logged.append)
    assert os.path.isdir(path + '.damaged') and not os.path.exists(path) and 'set aside as ckpt-00000010.damaged' in logged[0]
    # and a save's failure flag (checkpoint.stop_together; at world 2: test_checkpoint.py's
    # test_on_nccl_a_saves_failure_flag_lives_on_the_ranks_gpu): none, it returns; one, NotSaved, the .tmp gone
    os.makedirs(path + '.tmp')
    checkpoint.stop_together(types.SimpleNamespace(comm=on), None, path + '.tmp')
    with pytest.raises(checkpoint.NotSaved, match=r"ckpt-00000010 not saved: rank 0 could not write it \(\[Errno 28\]"):
        checkpoint.stop_together(types.SimpleNamespace(comm=on), OSError(28, 'No space left on device'), path + '.tmp')
    assert not os.path.exists(path + '.tmp') and made == [on.device] * 4


def test_a_stage_0_fp16_checkpoint_resumes_at_stage_0():
    first, second = result('stage 0 resume')
    for code, log in (first, second):
        assert code == 0, log[-4000:]
    assert 'saving checkpoint' in first[1] and re.search(r'resuming from \S+ckpt-00000003', second[1])
    resumed = losses(second[1])
    assert len(resumed) == 3 and all(math.isfinite(x) for x in resumed) and 'iter 1:' not in second[1]
    if GPU:
        assert len(re.findall(r', loss scale [\d.e+]+', second[1])) == 3  # fp16: the GradScaler at work

# -----------------------------------------------------------------------------
# the benchmarks, quick forms: they run and print their figures


def test_bench_zero_times_every_kind():
    log = ok('bench zero')
    rows = [line.split('|')[1].strip() for line in log.splitlines() if line.startswith('| ') and 'kind' not in line]
    assert {'ddp', 'zero1', 'zero2', 'zero3', 'fsdp2'} <= set(rows), log[-3000:]
    if GPU:  # bench_zero [Note: does the GPU wait on the host?]: each kind's lag at its last micro-step (2 a rank here);
        # the device runs no event before the host records it, so a lag is above -1 ms (launch latency) at the least
        lags = [float(x) for x in re.findall(r'the GPU (-?[\d.]+) ms behind the host at micro-step 2', log)]
        assert len(lags) == len(rows) and all(-1.0 < lag < 1e4 for lag in lags), log[-3000:]


def test_bench_train_runs_on_the_gpu():
    # bench_train's CUDA branch (its CPU stand-in: test_train.py's test_on_cuda_bench_train_runs_a_rank_a_gpu...): a rank
    # a GPU without --nproc, and the memory column is train.py's max_memory_allocated line (the CPU dry run: peak RSS)
    log = ok('bench train')
    rows = [[c.strip() for c in line.strip('|').split('|')] for line in log.splitlines() if line.startswith('| zero')]
    assert [r[0] for r in rows] == ['zero_stage=2', 'zero_stage=3'], log[-3000:]
    assert ('max_memory_allocated GiB' if GPU else 'peak RSS GiB') in log and all(0 < float(r[5]) < 100 for r in rows), log
    assert 'world size 1 (nccl), device cuda:0' in log if GPU else 'world size 1 (gloo), device cpu' in log


def test_bench_scale_counts_what_the_estimator_says():
    log = ok('bench scale')
    table = {c[0]: c[1:] for c in ([x.strip() for x in line.strip('|').split('|')] for line in log.splitlines()
                                   if line.startswith('| zero') or line.startswith('| fsdp2'))}
    assert {'zero1', 'zero2', 'zero3', 'fsdp2'} <= set(table), log[-3000:]
    assert not [k for k, cells in table.items() if cells[0].startswith('did not run')], log[-3000:]  # fsdp2 too
    for kind in ('zero1', 'zero2', 'zero3'):
        assert 0.95 <= float(table[kind][2]) <= 1.05, (kind, table[kind])  # measured / estimated model states
        # the GPU's peak during the steps (max_memory_allocated): at least the model states it holds all along
        assert float(table[kind][1]) <= float(table[kind][5]) < math.inf, (kind, table[kind])

# -----------------------------------------------------------------------------
# --- issue 19: every rank initializes only its own shard, activation checkpointing


@pytest.fixture
def nccl_world(monkeypatch):
    """NCCL at world 1 in this process, on an in-process store (no port to pick), gone after the test; gloo in the CPU
    dry run. Our collectives call it as at any world size (comm [Note: one rank] skips it at world 1 otherwise: the
    train.py jobs above run that way). Yields the device."""
    import comm
    monkeypatch.setattr(comm.Comm, 'skip_backend_alone', False)
    dist.init_process_group('nccl' if GPU else 'gloo', rank=0, world_size=1, store=dist.HashStore(),
                            timeout=datetime.timedelta(seconds=60))
    yield torch.device('cuda' if GPU else 'cpu')
    if dist.is_initialized():
        dist.destroy_process_group()


@cuda_only
def test_counter_based_init_is_the_same_on_cpu_and_cuda():
    """model.py [Note: counter-based init]: the hash is exact integer arithmetic on both devices; Box-Muller runs in
    float64 and is rounded to float32 once, so a value can differ only where CUDA's and the CPU's float64 log or cos
    differ by an ulp right at a float32 rounding boundary (about 1 element in 2^28)."""
    config = GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=32, vocab_size=128)
    cpu = GPT(config)
    with torch.device('cuda'):  # the default device: init_param must draw on the tensor's device, whatever it is
        cuda = GPT(config)
    for (name, a), b in zip(cpu.named_parameters(), cuda.parameters()):
        assert b.is_cuda and torch.equal(a.detach(), b.detach().cpu()), name
    big_cpu, big_cuda = torch.empty(1 << 22), torch.empty(1 << 22, device='cuda')
    for t in (big_cpu, big_cuda):
        cpu.init_param('transformer.h.0.attn.c_attn.weight', t, start=12345)
    diff = big_cpu != big_cuda.cpu()
    assert diff.sum() <= 2, diff.sum()  # 4M elements: 1/64 expected
    torch.testing.assert_close(big_cuda.cpu(), big_cpu, rtol=2**-23, atol=0)  # and then by one float32 ulp


@cuda_only
def test_meta_built_stage3_on_cuda_with_checkpointing_trains(nccl_world):
    """A stage-3 engine built on the meta device and materialized on CUDA (shards drawn there) trains a step with
    activation checkpointing: the recomputed blocks are gathered on the GPU."""
    import fsdp_lite
    import zero
    with torch.device('meta'):
        model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=32, vocab_size=128))
    cfg = zero.ZeroConfig(stage=3, param_dtype=torch.float32)
    engine = zero.build_engine(model, cfg, units=list(model.transformer.h), device=torch.device('cuda'))
    fsdp_lite.checkpoint_activations(model.transformer.h)
    plain = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=64, block_size=32, vocab_size=128))
    for name, p in plain.named_parameters():  # world size 1: the unit's shard is the whole param
        b = engine.bucket_of[model.get_parameter(name)]
        torch.testing.assert_close(engine.master_values(b)[b.offset_of[model.get_parameter(name)]:][:p.numel()].cpu(),
                                   p.detach().reshape(-1), rtol=0, atol=0)
    x = torch.randint(128, (2, 32), device='cuda')
    _, loss = engine.module(x, x)
    engine.backward(loss)
    assert torch.isfinite(torch.tensor(engine.step(1e-3)))


@cuda_only
def test_a_nccl_run_ends_through_end_process_group(nccl_world):
    """launch.end_process_group on NCCL ([Note: the end of a run]): its all-reduce's tensor on the run's GPU (NCCL
    takes no CPU tensor), no wait on gloo's threads, no warning, the process group gone. Every train.py run here
    ends through it too."""
    import warnings
    t = torch.ones(4, device='cuda')
    dist.all_reduce(t)
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        launch.end_process_group(torch.device('cuda'), t)
    assert not dist.is_initialized()

# -----------------------------------------------------------------------------
# the stages on NCCL end where stage 0 ends: a race between a stream and the host shows as a wrong number
# (test_comm.run_stage, on NCCL here)


def test_stages_1_to_3_on_the_gpu_end_where_stage_0_ends(nccl_world):
    """Stages 1-3 run their collectives from autograd hooks on CUDA streams, free grad buffers and units' storage after
    a wait, and stage 3 casts the master into the gather's row before an in-place all-gather: ordering the CPU suite
    runs but cannot get wrong (gloo waits on the host). A missed wait leaves a number stale or half-written. Here
    stages 1-3 equal stage 0 (torch DDP, torch's AdamW) in fp32, and stage 3 equals stage 2 with bf16 compute (the
    gather's cast included). The CPU suite's tolerances x10: the GPU adds other summation orders; a stale grad or param
    is off by far more (a step moves a param by up to lr = 3e-3). Not the 8-bit state: there a grad norm's last bit
    (the shards' squares summed in another order) flips a code, and the params part by ~1e-2 (checked on the CPU)."""
    from test_comm import run_stage
    from test_zero import assert_same_run
    device = nccl_world
    base = run_stage(device, 0, torch.float32)
    for stage in (1, 2, 3):
        assert_same_run(run_stage(device, stage, torch.float32), base, rtol=1e-4, atol=1e-5, param_atol=2e-5)
    assert_same_run(run_stage(device, 3, torch.bfloat16), run_stage(device, 2, torch.bfloat16),
                    rtol=1e-4, atol=1e-5, param_atol=2e-5)


def test_stage_0_steps_with_torchs_fused_adamw_on_the_gpu(nccl_world):
    # zero.DataParallel asks for fused=is_cuda: the fused AdamW keeps each param's step count as a tensor on its device
    # (on the CPU, test_zero.py's run_job checks every DDP job's AdamW is the plain one)
    import zero
    device = nccl_world
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=32, block_size=16, vocab_size=64)).to(device)
    engine = zero.build_engine(model, zero.ZeroConfig(stage=0))
    x = torch.randint(64, (2, 16), device=device)
    engine.backward(engine.module(x, x)[1])
    engine.step(1e-3)
    steps = [s['step'] for s in engine.optimizer.state.values()]
    assert engine.optimizer.defaults['fused'] is GPU and len(steps) == len(engine.params)
    assert all(s.device == engine.params[0].device and s.device.type == device.type and s.item() == 1 for s in steps)


@cuda_only
def test_the_gpus_spin_clock_and_free_memory_read_as_a_gpus():
    # figures only a GPU gives, read without a process group: the simulated link's spin clock (comm.py; its CPU
    # stand-in times the events, not the figure) in a GPU's range, and zero_stage='auto''s limit (memory.py) the free
    # memory mem_get_info reports, not the total
    import comm
    import memory
    gpu = torch.device('cuda', 0)
    assert 3e8 < comm.cuda_cycles_per_second(gpu) < 4e9  # _sleep counts SM cycles: ~0.35-2 GHz on an H100/H200
    held = torch.empty(2**31, dtype=torch.uint8, device=gpu)  # 2 GiB in use: free and total now differ by more
    free, total = torch.cuda.mem_get_info(gpu)
    assert memory.device_memory_bytes(gpu) <= total - held.numel() and abs(memory.device_memory_bytes(gpu) - free) < 2**26


@cuda_only
def test_a_gpu_past_the_machines_count_is_one_line_from_train_py_and_sample_py():
    # the real device count (the CPU stand-ins: test_train.py's test_a_gpu_the_machine_lacks_is_one_line_on_every_rank,
    # test_checkpoint.py's sample.py case): cuda:N one past the last GPU refused before any CUDA call fails on it
    absent = f'cuda:{torch.cuda.device_count()}'
    env = {k: v for k, v in os.environ.items() if k not in ('RANK', 'LOCAL_RANK', 'WORLD_SIZE', 'LOCAL_WORLD_SIZE')}
    out = subprocess.run([sys.executable, 'train.py', f'--device={absent}', f'--out_dir={OUT}/absent'], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1 and out.stderr.strip().endswith(
        f"torch sees {torch.cuda.device_count()} GPU(s) here, cuda:0 to cuda:{torch.cuda.device_count() - 1}: name "
        "one of them"), out.stderr
    out = subprocess.run([sys.executable, 'sample.py', f'--device={absent}'], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 2 and 'name one of them' in out.stderr.splitlines()[-1], out.stderr


@cuda_only
def test_a_batch_is_int64_on_the_gpu_and_equals_the_cpus():
    # train.windows on CUDA: pinned, then copied without blocking the host (its CPU stand-in: test_train.py's
    # test_on_cuda_a_batch_is_pinned_then_copied...); what arrives is what the CPU path makes
    import numpy as np
    import train
    data = np.arange(1000, dtype=np.uint16)
    rows = [3, 500, 900]
    x, y = train.windows(data, rows, 32, torch.device('cuda', 0))
    cx, cy = train.windows(data, rows, 32, torch.device('cpu'))
    assert x.device == y.device == torch.device('cuda', 0) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x.cpu(), cx) and torch.equal(y.cpu(), cy) and torch.equal(cy[:, :-1], cx[:, 1:])


def test_at_world_1_the_stages_skip_nccl_and_end_where_nccl_takes_them(nccl_world, monkeypatch):
    """comm [Note: one rank]: at world 1 each collective is a copy on the current stream, or nothing, and NCCL is never
    called (its entry points raise here); every number equals the run through NCCL, bit for bit: NCCL's average over
    one rank is its input."""
    import comm
    from test_comm import run_stage
    from test_zero import assert_same_run
    device, kinds = nccl_world, ((1, torch.float32, {}), (2, torch.bfloat16, {}), (3, torch.bfloat16, dict(prefetch=2)))
    through = [run_stage(device, stage, dtype, **kw) for stage, dtype, kw in kinds]

    def never(*args, **kwargs):
        raise AssertionError('a collective reached the backend at world 1')
    monkeypatch.setattr(comm.Comm, 'skip_backend_alone', True)
    for name in ('ALL_GATHER', 'REDUCE_SCATTER'):
        monkeypatch.setattr(comm, name, never)
    monkeypatch.setattr(dist, 'all_reduce', never)
    for (stage, dtype, kw), run in zip(kinds, through):
        alone = run_stage(device, stage, dtype, **kw)
        try:  # (torch's FSDP2 avoids NCCL's AVG at world 1: "may produce incorrect results", its comment says)
            assert_same_run(alone, run, rtol=0, atol=0)
        except AssertionError as e:
            raise AssertionError(f"stage {stage}, NCCL {torch.cuda.nccl.version() if GPU else '-'}: {e}") from None
        assert alone['evals'] == run['evals']


@cuda_only
def test_collectives_landing_late_on_their_own_stream_change_no_number(nccl_world, monkeypatch):
    """test_comm.py's LateCollectives on a GPU: every async collective of stages 1-3 lands ~2 ms late on a side stream,
    its output NaN until then, its tensors kept until wait() as c10d keeps them, and wait() orders the current stream
    after it, as NCCL's work does; none may be left unwaited. A tensor of a collective freed, reused or read before its
    wait then races the caching allocator's next kernel on the current stream, and shows as a number off; at world 1
    real NCCL lands too soon to show it."""
    import comm
    from test_comm import run_stage
    from test_zero import assert_same_run
    device, side, pending = nccl_world, torch.cuda.Stream(nccl_world), []

    class Late:
        def __init__(self, out, inp):
            source = inp.clone()  # first: an in-place gather's input is a row of its output (at world 1, all of it)
            out.detach().fill_(math.nan)  # what a read before the wait sees, as in LateCollectives
            side.wait_stream(torch.cuda.current_stream(device))  # as NCCL's stream: after what wrote them
            self.kept = (out, inp, source)  # as c10d keeps a collective's tensors until its wait
            with torch.cuda.stream(side):
                torch.cuda._sleep(5_000_000)
                out.detach().copy_(source.reshape(out.shape))  # world 1: an all-gather, an averaging reduce-scatter
            pending.append(self)

        def wait(self):
            torch.cuda.current_stream(device).wait_stream(side)
            self.kept = None
            pending.remove(self)

    def late(real):
        return lambda out, inp, *args, async_op=False, **kw: Late(out, inp) if async_op else real(out, inp, *args, **kw)

    runs = {'on time': [], 'late': []}
    for when in runs:
        with monkeypatch.context() as m:
            if when == 'late':
                m.setattr(comm, 'ALL_GATHER', late(comm.ALL_GATHER))
                m.setattr(comm, 'REDUCE_SCATTER', late(comm.REDUCE_SCATTER))
            for stage, dtype, kw in ((1, torch.float32, {}), (2, torch.bfloat16, {}), (3, torch.float32, {}),
                                     (3, torch.bfloat16, dict(prefetch=2)), (3, torch.float32, dict(blocks_per_unit=2))):
                runs[when].append(run_stage(device, stage, dtype, in_flight=pending, **kw))
    for late_run, on_time in zip(runs['late'], runs['on time']):
        assert_same_run(late_run, on_time, rtol=1e-6, atol=1e-7, param_atol=1e-7)


# -----------------------------------------------------------------------------
# --- issue 20: a simulated link on the communication stream (comm.py, [Note: simulated link])


@pytest.fixture
def fake_world():
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    yield lambda world_size: dist.init_process_group('fake', rank=0, world_size=world_size, store=FakeStore())
    if dist.is_initialized():
        dist.destroy_process_group()


@cuda_only
def test_simulated_link_on_cuda_queues_on_a_side_stream_and_orders_the_current_stream(fake_world):
    """The host is not blocked by a launch or a wait; the current stream is, by the ring's time, and two
    collectives queue one after the other (FIFO). Bounds from below only (a spin is never shorter than its
    cycles, up to the clock-rate measurement), plus a generous one on the host's launch."""
    import time
    import comm
    fake_world(8)
    device = torch.device('cuda', 0)
    c = comm.Comm(device=device)
    link = comm.Link(bandwidth=1e15, latency=50e-3 / 7)  # 50 ms per collective at 8 ranks
    c.use_link(link)
    out, inp = torch.empty(8 * 1024, device=device), torch.ones(1024, device=device)
    link.cuda_stream(device)  # its first call measures the GPU's clock (a 50M-cycle spin): not in the timed window
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t0 = time.perf_counter()
    first = c.all_gather(out, inp, async_op=True)
    second = c.reduce_scatter(inp, out, async_op=True)
    first.wait()
    second.wait()
    host = time.perf_counter() - t0
    end.record()
    torch.cuda.synchronize()
    assert host < 0.05, host  # launching and waiting took less than one collective: the host was not blocked
    assert start.elapsed_time(end) >= 0.9 * 100, start.elapsed_time(end)  # ms: both, one after the other
    assert link.busy == {'all_gather': pytest.approx(0.05), 'reduce_scatter': pytest.approx(0.05)}
    assert torch.equal(out.view(8, -1)[3], torch.ones(1024, device=device))  # the fake group's fill still happens


@cuda_only
def test_measured_matmul_flops_are_a_gpus_not_a_launchs():
    """bench_scale.matmul_flops (the MFU peak of a GPU model.peak_flops does not list) waits for the product: before, it
    timed the launch of a queued matmul. 8192^3 in bf16 takes ~1 ms on an H100; its launch, ~10 µs."""
    import bench_scale
    flops = bench_scale.matmul_flops(torch.device('cuda', 0), torch.bfloat16, n=8192)
    assert 1e12 < flops < 2 * 989e12, flops  # H100/H200 datasheet: 989 TFLOP/s dense bf16


@cuda_only
def test_bench_scale_with_a_link_runs_on_cuda():
    import subprocess
    import sys
    cmd = [sys.executable, 'bench.py', 'scale', '--quick', '--world=64', '--link=ib400', '--kinds=zero2,zero3',
           '--set=device=cuda', '--set=dtype=bfloat16'] + [
        f'--set={kv}' for kv in ('n_layer=2', 'n_head=2', 'n_embd=64', 'block_size=32', 'batch_size=2')]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [[c.strip() for c in line.strip('|').split('|')] for line in out.stdout.splitlines() if line.startswith('| ')]
    assert [r[0] for r in rows if len(r) > 1 and r[1] == 'ib400'] == ['zero2', 'zero3'], out.stdout

# -----------------------------------------------------------------------------
# --- issue 17: Stage 3 as fast and as light as stage 2: the loss head, the gathers, and the step's copies



def hidden(model, idx):
    x = model.transformer.wte(idx) + model.transformer.wpe(torch.arange(idx.size(1), device=idx.device))
    for block in model.transformer.h:
        x = block(x)
    return x


def plain_head_loss(model, idx, targets):
    """The head as it was: the whole batch's logits, then cross_entropy on them in fp32."""
    logits = model.lm_head(model.transformer.ln_f(hidden(model, idx)))
    return torch.nn.functional.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)


@cuda_only
@pytest.mark.parametrize('compiled', [False, True])
def test_chunked_head_on_cuda_under_bf16_autocast_equals_the_plain_head(compiled):
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=4, n_embd=256, block_size=256, vocab_size=50304)).cuda()
    idx, targets = torch.randint(50304, (2, 8, 256), device='cuda')  # 2048 rows: 7 chunks of 320
    head = torch.compile(model.head) if compiled else model.head
    results = []
    for loss_fn in (lambda: head(hidden(model, idx), targets), lambda: plain_head_loss(model, idx, targets)):
        model.zero_grad()
        with torch.autocast('cuda', torch.bfloat16):
            loss = loss_fn()
        loss.backward()
        results.append((loss.detach(), torch.cat([p.grad.float().flatten() for p in model.parameters()])))
    (loss, grads), (ref_loss, ref_grads) = results
    torch.testing.assert_close(loss, ref_loss, rtol=1e-4, atol=0)  # both: bf16 matmuls, the loss in fp32
    assert (grads - ref_grads).norm() <= 1e-2 * ref_grads.norm()  # bf16 roundings in other places


@cuda_only
def test_the_head_never_holds_the_whole_batchs_fp32_logits():
    model = GPT(GPTConfig(n_layer=1, n_head=12, n_embd=768, block_size=1024, vocab_size=50304)).cuda()
    x = torch.randn(8, 1024, 768, device='cuda', requires_grad=True)
    targets = torch.randint(50304, (8, 1024), device='cuda')
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with torch.autocast('cuda', torch.bfloat16):
        loss = model.head(x, targets)
    loss.backward()
    logits = 8 * 1024 * 50304 * 4  # 1.65 GB: what a plain head keeps, twice (logits and log-probs)
    # what it does hold (476 MB counted on the CPU, every allocation): the fp32 weight grad (154 MB), the bf16 weight
    # (77 MB), the grad of x and ln_f's output (25 MB each), one chunk's fp32 and bf16 logits and grads, g.t() @ x
    assert torch.cuda.max_memory_allocated() - base < logits / 2, torch.cuda.max_memory_allocated() - base


def max_memory(stage, compile, blocks_per_unit=1):
    """GiB of train.py's `cuda max_memory_allocated` line: GPT-2 124M, bf16, world 1 (NCCL), 4 x 1024, 2 micro-steps."""
    args = [sys.executable, 'train.py', f'config/zero{stage}.py', f'--compile={compile}', '--max_iters=3',
            '--batch_size=4', '--gradient_accumulation_steps=2', '--eval_interval=1000', '--eval_iters=1',
            '--log_interval=1', f'--blocks_per_unit={blocks_per_unit}',
            f'--out_dir=out-test-gpu/issue17-{stage}-{compile}-{blocks_per_unit}']
    out = subprocess.run(args, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    gib = float(re.findall(r'cuda max_memory_allocated after iteration 3: ([\d.]+) GiB', out.stdout)[-1])
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, 'max_memory.log'), 'a') as f:  # the figures, for .ci/gpu's logs (a pass gives none else)
        f.write(f'stage {stage}, compile={compile}, blocks_per_unit={blocks_per_unit}: {gib} GiB\n')
    return gib


@cuda_only
@pytest.mark.parametrize('compile', [False, True])
def test_stage_3_max_memory_allocated_is_at_most_stage_2s(compile):
    stage2, stage3 = max_memory(2, compile), max_memory(3, compile)
    assert stage3 <= stage2, (stage2, stage3)
    # fsdp_lite [Note: blocks per unit]: 3 blocks a unit hold (prefetch + 1) x 3 blocks unsharded, 6 of GPT-2's 12
    assert max_memory(3, compile, blocks_per_unit=3) <= stage2

# -----------------------------------------------------------------------------
# --- issue 18: 8-bit optimizer state at memory speed
# The warp-per-block 8-bit path on the device: bit for bit the CPU kernel (the host-emulated CUDA test checks the
# same source on the host, but not the device's arithmetic, its shuffles, its vector loads or its launch), on shapes
# with a partly used last CUDA block (32 quantization blocks each) and on unaligned views (the strided path).

import kernels  # noqa: E402
import test_kernels  # noqa: E402


@cuda_only
@pytest.mark.parametrize("weights", ["fp32+bf16param", "remainder", "none-stochastic", "fp32"])
@pytest.mark.parametrize("blocks", [1, 33, 4096 + 7])
def test_cuda_8bit_path_equals_the_cpu_kernel_bit_for_bit(weights, blocks):
    n = 256 * blocks
    cpu = test_kernels.Shard(n, weights, "uint8")
    gpu = cpu.to("cuda")
    gen = torch.Generator().manual_seed(5)
    for step in (1, 2, 3):
        grad = test_kernels.spiky_grad(n, gen)
        cpu.step("cpu", grad, weight_decay=0.1, decay_numel=n // 3, step=step, grad_scale=0.37, index_offset=11)
        gpu.step("cuda", grad.cuda(), weight_decay=0.1, decay_numel=n // 3, step=step, grad_scale=0.37, index_offset=11)
        for a, b in zip(cpu.tensors(), gpu.tensors()):
            assert test_kernels.same_bits(a, b)


@cuda_only
def test_cuda_8bit_path_in_unaligned_views_equals_the_cpu_kernel():
    n = 256 * 40
    cpu = test_kernels.Shard(n, "remainder", "uint8")
    gpu = cpu.to("cuda")
    buffers = {}
    for name in ("exp_avg", "exp_avg_sq", "param"):
        t = getattr(gpu, name)
        buffers[name] = torch.zeros(n + 1, dtype=t.dtype, device="cuda")
        buffers[name][1:] = t
        setattr(gpu, name, buffers[name][1:])  # 1 element in: the strided path
    grad = test_kernels.spiky_grad(n, torch.Generator().manual_seed(6))
    cpu.step("cpu", grad, weight_decay=0.1, decay_numel=n, step=1)
    gpu.step("cuda", grad.cuda(), weight_decay=0.1, decay_numel=n, step=1)
    for a, b in zip(cpu.tensors(), gpu.tensors()):
        assert test_kernels.same_bits(a, b)


@cuda_only
def test_every_kernel_test_of_the_cpu_suite_passes_for_the_cuda_kernel():
    # test_kernels.py adds impl='cuda' to its cases where CUDA is present: every mode of the elementwise kernel
    # (fp32 and bf16 state, bf16 grads, the fp16 param, the remainder, stochastic rounding) bit for bit the CPU kernel,
    # exact roundings, unaligned views, found_inf, the 8-bit codes at every scale and beside every midpoint ([Note:
    # dividing by the reciprocal, exactly] on the GPU's own fma and divide). Run here, as .ci/gpu runs this file only.
    out = subprocess.run([sys.executable, '-m', 'pytest', '-q', '-p', 'no:cacheprovider', 'test_kernels.py', '-k',
                          'cuda and not emulated'], capture_output=True, text=True, timeout=900, cwd=ROOT)
    passed = re.search(r'(\d+) passed', out.stdout)
    assert out.returncode == 0 and passed and int(passed.group(1)) >= 60, out.stdout[-4000:]


@cuda_only
def test_the_kernel_runs_on_the_current_stream():
    # kernels.adamw_step launches on torch's current stream: under a side stream, on a grad that stream makes after
    # tens of ms of GPU sleep, the step waits for it (on the default stream it would read the grad's memory first)
    n = 1 << 20
    ref, shard = test_kernels.Shard(n), test_kernels.Shard(n).to("cuda")  # the same tensors (a seeded Shard)
    grad = test_kernels.spiky_grad(n, torch.Generator().manual_seed(9))
    ref.step("cpu", grad, weight_decay=0.1, decay_numel=n // 2, step=1)
    grad_on_gpu, found_inf = grad.cuda(), torch.zeros(1, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)
        late = grad_on_gpu * 1.0
        kernels.adamw_step(shard.master, late, shard.exp_avg, shard.exp_avg_sq, shard.param, found_inf,
                           weight_decay=0.1, decay_numel=n // 2, step=1, impl="cuda", **test_kernels.HP)
        out = [t.clone() for t in shard.tensors()]
    side.synchronize()
    for a, b in zip(out, ref.tensors()):
        assert test_kernels.same_bits(a, b)


@cuda_only
def test_the_gathers_cast_runs_on_the_current_stream_without_a_host_sync():
    # kernels.cast_param(impl='auto'), a stage-3 gather's bf16 param: on a side stream, after tens of ms of GPU sleep,
    # it reads the master that stream writes, and it never waits for the device
    master = torch.randn(1 << 20) * 10.0 ** torch.randint(-30, 30, (1 << 20,))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    on_gpu = master.cuda()
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)
        late = on_gpu * 1.0
        rows = torch.zeros(3, 1 << 20, dtype=torch.bfloat16, device='cuda')  # a stage-3 gather writes its row
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = kernels.cast_param(late, torch.bfloat16, impl="auto")
            kernels.cast_param(late, torch.bfloat16, impl="auto", out=rows[1])
        finally:
            torch.cuda.set_sync_debug_mode("default")
    side.synchronize()
    assert test_kernels.same_bits(out, kernels.cast_param(master, torch.bfloat16))
    assert test_kernels.same_bits(rows[1], out) and not rows[0].any() and not rows[2].any()


@cuda_only
def test_this_gpu_has_a_listed_peak_and_train_py_logs_its_mfu():
    # model.peak_flops: the dense bf16 peak for MFU, by the GPU's name (None for an unlisted one: then no mfu is logged).
    # On a GPU the table lacks this fails on purpose, naming it: add its peak.
    from model import peak_flops
    name = torch.cuda.get_device_name(0)
    assert peak_flops(torch.device('cuda', 0)) is not None, f"{name} is not in model.peak_flops' table"
    assert re.search(r'^iter \d+: .*, mfu [\d.]+%', ok('stage 2'), re.M)


@cuda_only
def test_the_8bit_tables_follow_the_kernels_device_not_the_default_device():
    # test_kernels.py checks this under 'meta' on the CPU; here under a CUDA default device, as a user's
    # torch.set_default_device('cuda') sets it: the CPU kernel's first 8-bit step equals a plain one, its tables on
    # the CPU, and the CUDA kernel's tables are the same numbers on the GPU.
    ref, shard = test_kernels.Shard(512, "remainder", "uint8"), test_kernels.Shard(512, "remainder", "uint8")
    grad = test_kernels.spiky_grad(512, torch.Generator().manual_seed(7))
    ref.step("cpu", grad, weight_decay=0.1, decay_numel=300, step=2)
    kernels._code_tables.cache_clear()
    try:
        with torch.device('cuda'):
            shard.step("cpu", grad, weight_decay=0.1, decay_numel=300, step=2)
            on_cpu, on_gpu = kernels._code_tables(torch.device('cpu')), kernels._code_tables(torch.device('cuda'))
    finally:
        kernels._code_tables.cache_clear()
    assert [t.device.type for t in on_cpu + on_gpu] == ['cpu', 'cpu', 'cuda', 'cuda']
    assert all(torch.equal(a, b.cpu()) for a, b in zip(on_cpu, on_gpu))
    for a, b in zip(ref.tensors(), shard.tensors()):
        assert test_kernels.same_bits(a, b)


@cuda_only
def test_the_reference_8bit_step_on_cuda_makes_no_host_sync():
    """kernels._maps_on: the reference's code maps reach the GPU once. Before, every quantize and dequantize copied its
    map from pageable host memory, which makes the host wait for the GPU: 4 syncs a bucket a step, on every machine
    without nvcc (impl='auto' falls back to the reference)."""
    n = 256 * 8
    shard = test_kernels.Shard(n, "fp32+bf16param", "uint8").to("cuda")
    grad = test_kernels.spiky_grad(n, torch.Generator().manual_seed(8)).cuda()
    found_inf = torch.zeros(1, device="cuda")

    def step():
        kernels.adamw_step(shard.master, grad, shard.exp_avg, shard.exp_avg_sq, shard.param, found_inf,
                           absmax=shard.absmax, impl="reference", weight_decay=0.1, decay_numel=n // 2, step=1,
                           **test_kernels.HP)
    step()  # the maps are copied to the GPU here, once
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronizing CUDA call now raises
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


@cuda_only
def test_bench_modes_prints_a_finite_fraction_of_copy_bandwidth_for_every_mode():
    # --against the folder csrc/ (a machine without .git): the same kernel built again, swapped in, timed in turns
    rows = test_kernels.bench_modes_rows("cuda", "1M", "1,048,576", 600, "--against", "csrc")
    of_copy, against = [float(row.split()[-3]) for row in rows], [float(row.split()[-1]) for row in rows]
    assert all(0.0 < f < 2.0 for f in of_copy), of_copy  # a GPU copy moves each byte once: no mode can beat it by 2x
    assert all(math.isfinite(r) and r > 0 for r in against), against  # a ratio printed for every mode (no timing bound)


@cuda_only
@pytest.mark.parametrize("grad_dtype", ["float32", "bfloat16"])
def test_bench_kernels_times_ours_and_torchs_fused_adamw_on_the_gpu(grad_dtype):
    # the plain table (test_kernels.test_bench_kernels_prints_a_row_per_size on the CPU): CUDA events, torch's fused
    # AdamW and the cast on the GPU, every figure a finite positive number (no timing bound)
    out = subprocess.run([sys.executable, "bench.py", "kernels", "--device", "cuda", "--sizes", "16M",
                          "--grad_dtype", grad_dtype], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line.split() for line in out.stdout.splitlines() if line.strip()[:1].isdigit()]  # (ms to 2 decimals)
    assert [row[0] for row in rows] == ["16,777,216"] and len(rows[0]) == 9, out.stdout
    figures = [float(x.replace(",", "")) for x in rows[0][1:]]
    assert all(math.isfinite(f) and f > 0 for f in figures), rows[0]

# -----------------------------------------------------------------------------
# --- issue 21: the CPU suite on a GPU machine

from test_zero import assert_same_run, run_ranks  # noqa: E402


@cuda_only
def test_the_cpu_harness_keeps_its_fsdp2_oracle_on_the_cpu_beside_a_gpu():
    # the spawn that died with SIGSEGV when fully_shard took cuda:0 for both ranks behind gloo
    fsdp2, ddp = run_ranks(2, [dict(kind=k, accum=4) for k in ('fsdp2', 'ddp')])
    for result in (fsdp2, ddp):
        assert not isinstance(result, Exception), result
    assert {t.device.type for t in fsdp2['params'].values()} == {'cpu'}
    assert_same_run(fsdp2, ddp)

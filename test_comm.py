"""
The simulated link (comm.py, [Note: simulated link]): its arithmetic, its queue, and the overlap it lets a
step show. In-process, on torch's fake process group (rank 0 of world_size ranks, alone). Stages 1-3 with every
async collective landing only at its wait, as NCCL may (LateCollectives). And the end of a run
(launch.end_process_group, [Note: the end of a run]), on a 1-rank gloo process group.

    python -m pytest -q test_comm.py
"""
import argparse
import contextlib
import functools
import math
import os
import subprocess
import sys
import threading
import time
import types
import warnings
from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import bench_link
import bench_scale
import comm
import launch
import fsdp_lite
import kernels
import train
import zero
from model import GPT, GPTConfig
from test_kernels import logged_device
from test_zero import assert_same_run

MODEL = dict(n_layer=3, n_head=2, n_embd=32, block_size=16, vocab_size=97, bias=True, dropout=0.0)


@pytest.fixture
def fake_world():
    """init(world_size): join the fake process group as rank 0; destroyed after the test."""
    yield lambda world_size: dist.init_process_group('fake', rank=0, world_size=world_size, store=FakeStore())
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture
def gloo_world():
    """A 1-rank gloo process group; destroyed after the test if the test did not end it."""
    dist.init_process_group('gloo', rank=0, world_size=1, store=dist.HashStore())
    yield
    if dist.is_initialized():
        dist.destroy_process_group()


def build(stage, model_kw=None, **zero_kw):
    torch.manual_seed(0)
    model = GPT(GPTConfig(**{**MODEL, **(model_kw or {})}))
    cfg = zero.ZeroConfig(stage=stage, **{'param_dtype': torch.float32, **zero_kw})
    return zero.build_engine(model, cfg, units=list(model.transformer.h), device=torch.device('cpu'))


def step(engine, batch=2, seed=0):
    cfg = engine.model.config
    gen = torch.Generator().manual_seed(seed)
    x, y = (torch.randint(cfg.vocab_size, (batch, cfg.block_size), generator=gen) for _ in range(2))
    train.train_step(engine, [(x, y)], 1e-3, nullcontext())


# -----------------------------------------------------------------------------
# arithmetic


def test_a_collective_takes_the_ring_time_and_an_all_reduce_twice_that():
    link = comm.Link(bandwidth=10e9, latency=5e-6)
    # 64 ranks, 1 MB: 63/64 * 1e6 B / 10e9 B/s = 98.4375 µs, + 63 steps * 5 µs = 315 µs
    assert link.seconds('all_gather', 1_000_000, 64) == pytest.approx(413.4375e-6, rel=1e-12)
    assert link.seconds('reduce_scatter', 1_000_000, 64) == pytest.approx(413.4375e-6, rel=1e-12)
    assert link.seconds('all_reduce', 1_000_000, 64) == pytest.approx(826.875e-6, rel=1e-12)
    assert link.seconds('all_gather', 1_000_000, 1) == 0.0  # one rank sends nothing


def test_link_presets_and_custom_links_parse_and_bad_ones_say_how():
    ib = comm.parse_link('ib400')
    assert (ib.bandwidth, ib.latency) == (50e9, 5e-6)
    custom = comm.parse_link('25,10')
    assert (custom.bandwidth, custom.latency) == (25e9, 10e-6)
    assert comm.parse_link('3.5').latency == 0.0
    for bad in ('ib4000', '0,5', '-1', '10,-2', '1,2,3', 'nan'):
        with pytest.raises(ValueError, match='BANDWIDTH_GBps'):
            comm.parse_link(bad)
    # --speedup scales a CPU's compute; a GPU's is what it is: refused there in one line
    assert isinstance(bench_scale.link_clock(torch.device('cpu'), 10.0), comm.VirtualClock)
    with pytest.raises(ValueError, match='on a GPU, leave it out'):
        bench_scale.link_clock(torch.device('cuda', 0), 10.0)


def test_bench_scale_and_study_link_refuse_what_they_cannot_run_before_running_and_take_h100_in_the_jobs_dtype(monkeypatch, tmp_path):
    # before: each kind was built and warmed up on the GPU, then died in a traceback; and h100's factor was this
    # CPU's fp32 matmul's, whatever dtype the job computes in (a CPU's bf16 matmul can be far from its fp32 one)
    ran = []
    monkeypatch.setattr(bench_scale, 'run_kind', lambda kind, args: ran.append(args.speedup) or {'kind': kind, 'failed': 'stub'})
    monkeypatch.setattr(bench_scale, 'matmul_flops', lambda device, dtype: {torch.float32: 1e11, torch.bfloat16: 4e11}[dtype])
    parser = argparse.ArgumentParser()
    parser.add_argument('--config'), parser.add_argument('--set', action='append', default=[]), parser.add_argument('--kinds')
    bench_scale.add_arguments(parser)
    tiny = ['--config=config/shakespeare_cpu.py', '--kinds=zero3', '--world=8', '--link=ib400', '--set=n_layer=1']
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)  # a GPU machine, for check_config
    monkeypatch.setattr(torch.cuda, 'device_count', lambda: 1)
    with pytest.raises(ValueError, match="--speedup projects a CPU's compute .*: on a GPU, leave it out"):
        bench_scale.bench_scale(parser.parse_args([*tiny, '--speedup=h100', '--set=device=cuda']))
    assert ran == []
    bench_scale.bench_scale(parser.parse_args([*tiny, '--speedup=h100', '--set=device=cpu', '--set=dtype=bfloat16']))
    assert ran == [f"{989e12 / 4e11:.4g}"]
    with pytest.raises(ValueError, match="a link is named twice"):  # before: one row, the two runs' steps pooled
        bench_scale.bench_scale(parser.parse_args([*tiny, '--link=ib400', '--set=device=cpu']))
    with pytest.raises(ValueError, match=r"^--speedup needs --link: it projects the step time on a simulated link, "
                                         r"e\.g\. --link ib400$"):  # before: ignored without a word
        no_link = [a for a in tiny if a != '--link=ib400']
        bench_scale.bench_scale(parser.parse_args([*no_link, '--speedup=h100', '--set=device=cpu']))
    assert ran == [f"{989e12 / 4e11:.4g}"]  # no kind ran for either
    # and study_link.py --append with nothing to append to: one line before any run, not a traceback after
    out = subprocess.run([sys.executable, 'study_link.py', '--append', '--out', str(tmp_path / 'study')],
                         capture_output=True, text=True, timeout=120)
    assert (out.returncode, out.stderr) == (1, f"--append: {tmp_path}/study.json is not there yet: run once without --append\n")


def test_study_link_writes_each_settings_row_and_counts_each_settings_time_once(tmp_path):
    # study_link.write from made-up rows: exposed as a share of the step, hidden = 1 - exposed / comm alone, and the
    # wall time of each setting once (its rows, one a link, each carry the seconds since the setting began: the last)
    import study_link
    row = lambda setting, link, exposed, seconds: dict(world=64, setting=setting, link=link, step=0.4, alone=0.3,  # noqa: E731
                                                       exposed=exposed, busy=0.2, psi=1.5e9, command='--worlds 64',
                                                       seconds=seconds)
    rows = [row('zero3 prefetch 1', 'ib400', 0.1, 60.0), row('zero3 prefetch 1', 'eth100', 0.16, 120.0),
            row('zero2 bucket 25 MB', 'ib400', 0.0, 30.0)]
    cli = argparse.Namespace(out=str(tmp_path / 'study'), set=[], speedup='40')
    study_link.write(cli, '40', rows)
    text = (tmp_path / 'study.md').read_text()
    table = [line for line in text.splitlines() if line.startswith('| 64 ')]
    assert table == ['| 64 | zero3 prefetch 1 | ib400 | 400.00 | 300.00 | 100.00 (25%) | 200.00 | 50% |',
                     '| 64 | zero3 prefetch 1 | eth100 | 400.00 | 300.00 | 160.00 (40%) | 200.00 | 20% |',
                     '| 64 | zero2 bucket 25 MB | ib400 | 400.00 | 300.00 | 0.00 (0%) | 200.00 | 100% |'], text
    assert '2.5 min on 2 cores' in text and 'Ψ = 1500.0M' in text, text  # 120 s + 30 s


def test_a_link_per_collective_times_each_kind_with_its_own_bandwidth_and_latency():
    link = comm.parse_link('ag=2,100/rs=1,300')  # GB/s, µs
    # 4 ranks, 8 MB: all-gather 3/4 * 8e6 / 2e9 = 3 ms + 3 * 100 µs; reduce-scatter 6 ms + 3 * 300 µs
    assert link.seconds('all_gather', 8_000_000, 4) == pytest.approx(3.3e-3, rel=1e-12)
    assert link.seconds('reduce_scatter', 8_000_000, 4) == pytest.approx(6.9e-3, rel=1e-12)
    assert link.seconds('all_reduce', 8_000_000, 4) == pytest.approx(10.2e-3, rel=1e-12)  # none given: rs + ag
    own = comm.parse_link('rs=1,300/ag=2,100/ar=4,50')  # its own ring, twice: 2 * (3/4 * 8e6 / 4e9 + 3 * 50 µs)
    assert own.seconds('all_reduce', 8_000_000, 4) == pytest.approx(3.3e-3, rel=1e-12)
    assert own.seconds('all_gather', 8_000_000, 4) == pytest.approx(3.3e-3, rel=1e-12)
    for bad, why in (('ag=2,100', 'rs= missing'), ('ag=2,100/rs=0,1', "rs='0,1' is not"), ('ag=2,100/rs=1,1/xx=1,1',
                     "unknown collective 'xx'"), ('ag=2,100/ag=2,100/rs=1,1', 'ag= given twice'), ('ag=2=3/rs=1', "ag='2=3'")):
        with pytest.raises(ValueError, match='ag=B,L/rs=B,L') as error:  # what is wrong, and the forms that work
            comm.parse_link(bad)
        assert why in str(error.value), (bad, str(error.value))


def test_bench_link_fits_a_ring_exactly():
    """bench.py link's least squares gives back the bandwidth and latency its points were made with."""
    for kind in ('all_gather', 'all_reduce'):
        truth = comm.Link(bandwidth=0.5e9, latency=300e-6)
        points = [(nbytes, truth.seconds(kind, nbytes, 4)) for nbytes in (4096, 2**20, 2**24)]
        bandwidth, latency = bench_link.fit(points, 4, kind)
        assert (bandwidth, latency) == (pytest.approx(0.5e9, rel=1e-9), pytest.approx(300e-6, rel=1e-9))


def test_bench_link_needs_two_ranks_before_any_timing(monkeypatch):
    # before: at 1 rank (torchrun --nproc_per_node=1) every collective was timed, then the fit said "the timings do not
    # fit a ring ...: run again on a quieter machine"; alone (no torchrun, no WORLD_SIZE), torch's env:// error
    monkeypatch.setattr(dist, 'init_process_group', lambda *a, **k: pytest.fail("the process group started"))
    for world_size in ('1', None):
        if world_size:
            monkeypatch.setenv('WORLD_SIZE', world_size)
        else:
            monkeypatch.delenv('WORLD_SIZE', raising=False)
        with pytest.raises(ValueError, match=r"^needs at least 2 ranks: torchrun --standalone --nproc_per_node=2 "
                                             r"bench\.py link$"):
            bench_link.bench_link(None)


def _time_collectives_rank(rank, world_size, init_file):
    dist.init_process_group('gloo', init_method=f'file://{init_file}', rank=rank, world_size=world_size)
    for numel in bench_link.buffer_numels(world_size)[:2]:
        for kind in bench_link.KINDS:
            assert bench_link.time_collective(kind, numel, world_size, repeats=1) > 0
    launch.end_process_group(torch.device('cpu'))


def test_bench_link_times_every_collective_at_a_world_size_that_divides_no_power_of_two(tmp_path):
    """At 3 ranks a 1024-element buffer has no even shard (as before: gloo refused the all-gather): bench.py link
    times buffers of a multiple of the world size, as zero.py pads every flat buffer to one."""
    assert bench_link.buffer_numels(3)[:2] == [1023, 4095] and bench_link.buffer_numels(2) == bench_link.SIZES
    torch.multiprocessing.spawn(_time_collectives_rank, args=(3, str(tmp_path / 'init')), nprocs=3)


def test_bench_scale_runs_on_the_gpu_it_is_named(monkeypatch):
    # bench_scale.measure, torch.cuda.set_device stood in for (it stops the run there): --set device=cuda:1 ran on
    # cuda:0 without a word; now the GPU named, as train.py takes it alone (test_train.py); a bare cuda is cuda:0
    asked = []

    class Stop(Exception):
        pass

    monkeypatch.setattr(torch.cuda, 'set_device', lambda device: asked.append(device) or (_ for _ in ()).throw(Stop()))
    for name in ('cuda:1', 'cuda'):
        with pytest.raises(Stop):
            bench_scale.measure('zero', {'device': name}, 8, quick=True)
    assert asked == [torch.device('cuda', 1), torch.device('cuda', 0)]


def test_on_cuda_bench_scales_mfu_peak_is_the_datasheets_else_the_gpus_measured_matmul(monkeypatch):
    # bench_scale.job_peak_flops on a GPU, model.peak_flops and matmul_flops stood in for: a listed GPU's datasheet peak
    # (--speedup is for CPUs), an unlisted one's measured matmul in the job's dtype (test_gpu.py times a real one)
    measured, gpu = [], torch.device('cuda', 0)
    monkeypatch.setattr(bench_scale, 'matmul_flops', lambda device, dtype: measured.append((device, dtype)) or 7e14)
    monkeypatch.setattr(bench_scale.model_py, 'peak_flops', lambda device: 989e12)
    assert bench_scale.job_peak_flops(gpu, {'dtype': 'bfloat16'}, speedup=3.0) == 989e12 and measured == []
    monkeypatch.setattr(bench_scale.model_py, 'peak_flops', lambda device: None)
    assert bench_scale.job_peak_flops(gpu, {'dtype': 'bfloat16'}, speedup=3.0) == 7e14
    assert measured == [(gpu, torch.bfloat16)]


def test_on_cuda_bench_scale_reads_and_resets_the_gpus_peak_not_the_processes(monkeypatch):
    # bench_scale.peak_bytes / reset_peak on CUDA, torch.cuda stood in for: the allocator's peak of that GPU, and
    # /proc/self/clear_refs (the CPU's reset of VmHWM) left alone
    asked, opened = [], []
    monkeypatch.setattr(torch.cuda, 'max_memory_allocated', lambda device=None: asked.append(('peak', device)) or 123)
    monkeypatch.setattr(torch.cuda, 'reset_peak_memory_stats', lambda device=None: asked.append(('reset', device)))
    monkeypatch.setattr(bench_scale, 'open', lambda *a, **k: opened.append(a) or pytest.fail(f"opened {a}"), raising=False)
    gpu = torch.device('cuda', 1)
    bench_scale.reset_peak(gpu)
    assert bench_scale.peak_bytes(gpu) == 123 and asked == [('reset', gpu), ('peak', gpu)] and not opened


def test_on_cuda_a_links_spin_clock_is_timed_before_the_step_it_measures(monkeypatch):
    # bench_scale.timed_with_link, torch.cuda stood in for: the link's first CUDA collective timed its spin clock (50M
    # cycles spun and waited for, ~25 ms on an H200) inside the first timed step, so --quick's one step and its
    # "exposed" time carried it. Now it is timed before the step's clock starts, and once. On a GPU:
    # test_gpu.py's test_bench_scale_with_a_link_runs_on_cuda.
    log = []

    class LoggedClock(comm.Clock):
        def now(self):
            log.append('now')
            return 0.0
    monkeypatch.setattr(torch.cuda, 'Stream', lambda device: 'side')
    monkeypatch.setattr(comm, 'cuda_cycles_per_second', lambda device: log.append(f'clock timed on {device}') or 1.5e9)
    monkeypatch.setattr(bench_scale.train, 'train_step', lambda *a: log.append('step'))
    gpu = torch.device('cuda', 0)
    engine = types.SimpleNamespace(comm=types.SimpleNamespace(device=gpu, use_link=lambda link: None))
    link = comm.Link(bandwidth=1e9, latency=1e-6, clock=LoggedClock())
    for _ in range(2):
        bench_scale.timed_with_link(engine, link, [], {'learning_rate': 1e-3}, None, lambda: None)
    assert log == ['clock timed on cuda:0', 'now', 'step', 'now', 'now', 'step', 'now'], log


def test_on_cuda_the_link_spins_a_side_stream_after_the_inputs_and_orders_the_current_stream_after_it(monkeypatch):
    # The CUDA branch of Link.start (CudaLinkWork) with torch.cuda's streams, events and spin stood in for, as a log
    # of calls: each collective waits for the current stream's work so far (the compute that wrote its input), spins
    # its ring time in cycles on the link's one side stream (so collectives queue in launch order), records an event
    # there; wait() makes the current stream wait for that event, and nothing makes the host wait. On a GPU:
    # test_gpu.py's test_simulated_link_on_cuda_queues_on_a_side_stream_and_orders_the_current_stream.
    log = []

    class Stream:
        def __init__(self, name):
            self.name = name

        def wait_stream(self, other):
            log.append(('wait_stream', self.name, other.name))

        def wait_event(self, event):
            log.append(('wait_event', self.name, event.name))

    class Event:
        count = 0

        def __init__(self):
            Event.count += 1
            self.name = f'event{Event.count}'

        def record(self, stream):
            log.append(('record', self.name, stream.name))

    current, made = [Stream('current')], []

    @contextlib.contextmanager
    def on(stream):  # torch.cuda.stream(s): s is the current stream inside
        log.append(('on', stream.name))
        current.append(stream)
        yield
        current.pop()

    monkeypatch.setattr(torch.cuda, 'Stream', lambda device: made.append(device) or Stream('side'))
    monkeypatch.setattr(torch.cuda, 'current_stream', lambda device=None: current[-1])
    monkeypatch.setattr(torch.cuda, 'stream', on)
    monkeypatch.setattr(torch.cuda, '_sleep', lambda cycles: log.append(('spin', current[-1].name, cycles)))
    monkeypatch.setattr(torch.cuda, 'Event', Event)
    monkeypatch.setattr(comm, 'cuda_cycles_per_second', lambda device: 1.5e9)
    link, gpu = comm.Link(bandwidth=1e9, latency=1e-6), torch.device('cuda', 3)
    a = link.start('all_gather', 4_000_000, 4, gpu)  # 3.003 ms = 4,504,500 cycles at 1.5 GHz
    b = link.start('reduce_scatter', 8_000_000, 4, gpu)  # 6.003 ms = 9,004,500 cycles
    b.wait()
    a.wait()
    assert made == [gpu]  # one side stream a link, on the collective's device
    assert log == [('wait_stream', 'side', 'current'), ('on', 'side'), ('spin', 'side', 4_504_500),
                   ('record', 'event1', 'side'),
                   ('wait_stream', 'side', 'current'), ('on', 'side'), ('spin', 'side', 9_004_500),
                   ('record', 'event2', 'side'),
                   ('wait_event', 'current', 'event2'), ('wait_event', 'current', 'event1')]
    assert link.busy == {'all_gather': pytest.approx(3.003e-3), 'reduce_scatter': pytest.approx(6.003e-3)}
    assert link.free_at == 0.0 and link.blocked == {}  # the CPU's queue and host waits are not used on CUDA


def test_on_cuda_the_spin_clock_is_timed_by_events_on_the_gpu_and_read_after_the_end_is_reached(monkeypatch):
    """comm.cuda_cycles_per_second, torch.cuda's device, spin and events stood in for: on the GPU asked about, timing
    events around the spin, the end event waited for before the time between them is read (elapsed_time of an event
    not yet reached is an error), milliseconds made seconds: 50,000,000 cycles in 25 ms is 2 GHz."""
    log = []

    class Event:
        def __init__(self, enable_timing=False):
            self.name = 'start' if not any(e[0] == 'event' for e in log) else 'end'
            log.append(('event', self.name, enable_timing))

        def record(self):
            log.append(('record', self.name))

        def synchronize(self):
            log.append(('synchronize', self.name))

        def elapsed_time(self, end):
            return log.append(('elapsed_time', self.name, end.name)) or 25.0

    monkeypatch.setattr(torch.cuda, 'device', logged_device(log))
    monkeypatch.setattr(torch.cuda, '_sleep', lambda cycles: log.append(('spin', cycles)))
    monkeypatch.setattr(torch.cuda, 'Event', Event)
    assert comm.cuda_cycles_per_second(torch.device('cuda', 0), cycles=50_000_000) == pytest.approx(2e9, rel=1e-12)
    assert log == [('enter', torch.device('cuda', 0)), ('spin', 1000), ('event', 'start', True), ('event', 'end', True),
                   ('record', 'start'), ('spin', 50_000_000), ('record', 'end'), ('synchronize', 'end'),
                   ('elapsed_time', 'start', 'end'), ('exit',)]


def test_collectives_queue_on_one_link_and_wait_blocks_until_the_end():
    clock = comm.VirtualClock(speedup=math.inf)  # no compute time: only the link's
    link = comm.Link(bandwidth=1e9, latency=1e-6, clock=clock)
    cpu = torch.device('cpu')
    a = link.start('all_gather', 4_000_000, 4, cpu)  # 3/4 * 4e6 / 1e9 + 3e-6 = 3.003 ms
    b = link.start('reduce_scatter', 8_000_000, 4, cpu)  # 6.003 ms, behind a
    b.wait()
    assert clock.now() == pytest.approx(9.006e-3, rel=1e-12)  # b ends after a and b, not after b alone
    a.wait()  # already done: no more time
    assert clock.now() == pytest.approx(9.006e-3, rel=1e-12)
    assert link.blocked == {'reduce_scatter': pytest.approx(9.006e-3, rel=1e-12)}
    assert link.busy == {'all_gather': pytest.approx(3.003e-3), 'reduce_scatter': pytest.approx(6.003e-3)}


@pytest.mark.parametrize('param_dtype', [torch.float32, torch.bfloat16])
@pytest.mark.parametrize('stage', [1, 2, 3])
def test_a_compute_free_step_takes_the_alpha_beta_time_exactly(fake_world, stage, param_dtype):
    """With compute taking no time, a step lasts exactly the sum of its collectives' ring times: the link
    is never idle. The oracle counts the collectives from the layout, not from what Comm counted. Each collective
    moves its own dtype's bytes: the all-gathers the params' (2 in bf16: a link that timed every element as 4 bytes
    put bench.py scale's bf16 all-gathers at twice their time, which fp32 alone could not show), the reduce-scatters
    fp32 grads, the grad norm's all-reduce one fp32."""
    world_size, bandwidth, latency = 8, 2e9, 3e-6
    fake_world(world_size)
    engine = build(stage, bucket_mb=0.01, param_dtype=param_dtype, reduce_dtype=torch.float32)  # several buckets
    step(engine)  # warm-up: stage 3 records its forward order
    clock = comm.VirtualClock(speedup=math.inf)
    engine.comm.use_link(comm.Link(bandwidth, latency, clock=clock))
    t0 = clock.now()
    step(engine, seed=1)

    def ring(nbytes):
        return (world_size - 1) / world_size * nbytes / bandwidth + (world_size - 1) * latency
    p = param_dtype.itemsize
    expected = 2 * ring(4)  # the grad norm's fp32 all-reduce
    for b in engine.buckets:
        expected += ring(4 * b.padded_numel)  # fp32 grads reduce-scattered
        if stage < 3:
            expected += ring(p * b.padded_numel)  # the new params all-gathered after the step
    if stage == 3:  # every unit gathered for forward, the blocks again for backward (resharded after forward) but the
        # last (fsdp_lite [Note: the last unit stays gathered])
        last = engine.units[0].schedule.order[-1]
        expected += sum(ring(p * u.bucket.padded_numel) * (1 if u.is_root or u is last else 2) for u in engine.units)
    assert clock.now() - t0 == pytest.approx(expected, rel=1e-9)
    assert sum(engine.comm.link.blocked.values()) == pytest.approx(expected, rel=1e-9)  # all of it exposed
    assert sum(engine.comm.link.busy.values()) == pytest.approx(expected, rel=1e-9)


def test_under_the_fake_process_group_an_all_reduce_sums_every_ranks_copy_of_ours(fake_world):
    # [Note: the fake process group]: as if every rank held our data. Before, it wrote nothing, and the grad norm
    # bench.py scale clips with was rank 0's shard alone (2.24 at world 1, 0.0019 at 4 on one test model)
    fake_world(4)
    sumsq = torch.tensor([1.5, -2.0])
    comm.Comm().all_reduce_sum(sumsq)
    assert sumsq.tolist() == [6.0, -8.0]


def test_on_the_real_clock_a_wait_counts_the_links_time_not_the_sleeps_overshoot():
    # a sleep woke ~0.1 ms late and the overshoot counted as exposed communication: 50 collectives of 5 us blocked
    # the host 16x the link's time, and bench.py scale printed "hidden" at -4543%
    link = comm.Link(bandwidth=50e9, latency=5e-6)  # comm.Clock: real time
    for _ in range(50):
        link.start('all_gather', 4, 2, torch.device('cpu')).wait()
    assert 0 < sum(link.blocked.values()) <= sum(link.busy.values()) * (1 + 1e-9), (link.blocked, link.busy)


def test_fsdp2_in_the_benches_is_sharded_and_compiled_as_our_stage_3(fake_world):
    # bench.py scale / zero's fsdp2 kind: before, --set blocks_per_unit, reshard_after_forward and compile changed our
    # stage 3 and not FSDP2, so the two rows compared different configurations without a word
    fake_world(4)
    cfg = train.parse_config(['--n_layer=4', '--n_head=2', '--n_embd=32', '--block_size=16', '--dtype=float32',
                              '--device=cpu', '--blocks_per_unit=2', '--reshard_after_forward=False', '--compile=True'])
    model, _ = bench_scale.build_fsdp2(cfg, torch.device('cpu'), train.model_args(cfg, 128), 4)
    from torch.distributed.fsdp import fully_shard
    groups = [fully_shard.state(block)._fsdp_param_group for block in model.transformer.h]
    assert groups[0] is groups[1] and groups[2] is groups[3] and groups[1] is not groups[2]  # 2 blocks a unit
    assert all(g.post_forward_mesh_info is None for g in groups)  # kept gathered from forward to backward
    assert hasattr(model.head, '_torchdynamo_orig_callable') and all(
        hasattr(b.forward, '_torchdynamo_orig_callable') for b in model.transformer.h)  # compiled per unit


def test_the_benches_count_fsdp2s_local_shards_not_its_whole_params(fake_world):
    # bench_zero.nbytes / TorchEngine.populations: a DTensor's numel is the whole tensor's; rank 0 of 4 holds a quarter
    # of each param (dim 0 padded to a multiple of 4), so fsdp2's params take ~Ψ bytes in fp32 here, not 4Ψ
    fake_world(4)
    cfg = train.parse_config(['--n_layer=2', '--n_head=2', '--n_embd=32', '--block_size=16', '--dtype=float32',
                              '--device=cpu'])
    _, engine = bench_scale.build_fsdp2(cfg, torch.device('cpu'), train.model_args(cfg, 128), 4)
    params = engine.populations()['params']
    assert engine.psi <= params <= 1.05 * engine.psi, (params, engine.psi)


def test_bench_zeros_transient_peak_stays_within_its_bound_and_counts_a_lent_shard_once(fake_world):
    # bench_zero.meter_transient / transient_bound / transient_bytes, rank 0 of 4: the peak metered over two steps never
    # passes the bound from the engine's counters (gathered units x the largest + the root, gathered to the step, + the
    # grad buffers); a gathered unit holds its own shard in place (lends_shard): it adds its size less that shard
    import bench_zero
    fake_world(4)
    for stage in (2, 3):
        cfg = train.parse_config(['--n_layer=3', '--n_head=2', '--n_embd=32', '--block_size=16', '--dtype=float32',
                                  '--device=cpu', f'--zero_stage={stage}', '--batch_size=2', '--bucket_mb=0.01',
                                  '--gradient_accumulation_steps=4'])
        _, engine = train.build(cfg, torch.device('cpu'), train.model_args(cfg, 128))
        peak, x = [0], torch.randint(128, (2, 16))
        handles = bench_zero.meter_transient(engine, peak)
        for _ in range(2):
            train.train_step(engine, [(x, x)], 1e-3, nullcontext())
        for h in handles:
            h.remove()
        assert 0 < peak[0] <= bench_zero.transient_bound(engine), (stage, peak[0], bench_zero.transient_bound(engine))
        assert bench_zero.transient_bytes(engine) == 0  # between steps: no grad buffer, every unit sharded
    unit = next(u for u in engine.units if not u.is_root)
    unit.unshard()
    unit.wait_for_unshard()
    assert unit.lends_shard and bench_zero.transient_bytes(engine) == unit.nbytes - unit.shard_nbytes == unit.nbytes * 3 // 4
    unit.reshard()


def test_the_link_needs_the_fake_process_group(gloo_world):
    with pytest.raises(ValueError, match='fake process group'):
        comm.Comm().use_link(comm.parse_link('ib400'))


# -----------------------------------------------------------------------------
# overlap: compute on a clock of CPU time (one thread), so a busy machine's preemptions do not stretch it


@pytest.fixture
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # process_time is then the compute's own time
    yield
    torch.set_num_threads(threads)


class RecordingLink(comm.Link):
    """The link, also recording the seconds each wait blocked, in order."""

    def wait_until(self, kind, end):
        before = sum(self.blocked.values())
        super().wait_until(kind, end)
        self.waits.append((kind, sum(self.blocked.values()) - before))


def block_forward_seconds(engine, batch):
    """The fastest block forward of a step, in CPU time, with no link (collectives take no time)."""
    starts, times = {}, []
    for block in engine.model.transformer.h:
        block.register_forward_pre_hook(lambda m, a: starts.__setitem__(m, time.process_time()))
        block.register_forward_hook(lambda m, a, o: times.append(time.process_time() - starts[m]))
    step(engine, batch)
    return min(times)


@pytest.mark.parametrize('prefetch', [0, 1])
def test_with_prefetch_an_all_gather_that_fits_under_a_block_exposes_nothing(fake_world, one_thread, prefetch):
    """Stage 3 at prefetch=1: a block's all-gather is launched while the previous unit computes, so one that
    takes a fiftieth of a block's forward is never waited for, in forward or backward, except the root's (nothing
    runs before it) and the first block's (behind the root's on the link, with only an embedding lookup to hide
    under). With prefetch=0 every all-gather is launched right before its wait: each one blocks."""
    fake_world(8)
    model_kw, batch = dict(n_layer=4, n_head=4, n_embd=128, block_size=64), 16
    engine = build(3, model_kw, prefetch=prefetch)
    step(engine, batch)  # warm-up: the forward order recorded
    # the time of one block's all-gather, by its latency: a tenth of a block's forward (a fiftieth with prefetch, so a
    # block that computes faster than the measured minimum, or a scheduling hiccup, still leaves it hidden)
    gather = (0.02 if prefetch else 0.1) * block_forward_seconds(engine, batch)
    link = RecordingLink(bandwidth=1e15, latency=gather / 7, clock=comm.VirtualClock(source=time.process_time))
    link.waits = []  # (7 ring steps at 8 ranks; the bytes take ~no time)
    engine.comm.use_link(link)
    step(engine, batch)
    gathers = [blocked for kind, blocked in link.waits if kind == 'all_gather']
    # the root once, each block in forward, all but the last again in backward ([Note: the last unit stays gathered])
    assert len(gathers) == 2 * model_kw['n_layer']
    if prefetch:
        assert gathers[2:] == [0] * (len(gathers) - 2), gathers  # never waited for: hidden
    else:  # (less the few µs of Python between a launch and its wait)
        assert all(blocked > 0.5 * gather for blocked in gathers), gathers


# -----------------------------------------------------------------------------
# bench.py scale --link


def test_bench_scale_with_a_link_prints_exposed_communication_per_kind():
    cmd = [sys.executable, 'bench.py', 'scale', '--quick', '--world=64', '--link=ib400', '--kinds=zero2,zero3'] + [
        f'--set={kv}' for kv in ('n_layer=2', 'n_head=2', 'n_embd=32', 'block_size=16', 'batch_size=2')]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [[c.strip() for c in line.strip('|').split('|')] for line in out.stdout.splitlines() if line.startswith('| ')]
    link_rows = {r[0]: r for r in rows if len(r) > 1 and r[1] == 'ib400'}
    assert list(link_rows) == ['zero2', 'zero3'], out.stdout
    for kind, row in link_rows.items():
        assert float(row[2]) > 0 and float(row[3]) > 0, row  # step ms with the link, compute alone


def test_bench_scale_times_every_step_on_the_link_afresh(monkeypatch, fake_world):  # fake_world: its teardown
    """bench_scale.measure with a link and --speedup inf (compute takes no time on the link's virtual clock): each of
    the 3 timed steps runs once alone (0 ms on that clock) and once on the link, which is never idle, so the step
    lasts exactly the link's time for that step's collectives, all of it exposed. The link's busy and blocked times
    are each step's own (Link.reset before each): carried over, their medians were twice a step's."""
    monkeypatch.setattr(bench_scale, 'matmul_flops', lambda device, dtype: 1e11)  # the MFU's peak: not measured here
    cfg = bench_scale.scale_config(argparse.Namespace(world=8, config='config/shakespeare_cpu.py', set=[
        'device=cpu', 'n_layer=2', 'n_head=2', 'n_embd=32', 'block_size=16', 'batch_size=2']))
    result = bench_scale.measure('zero2', cfg, 8, quick=False, link_specs=['ag=2,30/rs=1,50'], speedup=math.inf)
    (link,) = result['links']
    assert link['alone'] == 0 and link['step'] > 0
    assert link['busy'] == pytest.approx(link['step'], rel=1e-9)  # this step's collectives, not the steps' so far
    assert link['blocked'] == pytest.approx(link['step'], rel=1e-9)


def test_the_link_table_prints_exposed_hidden_tokens_and_mfu_from_the_kinds_figures(capsys):
    """bench_scale.print_link_table from one kind's figures: exposed = the time blocked in waits on a CPU (step -
    compute alone on a GPU), hidden = 1 - exposed / comm alone, the whole job's tokens a step (micro-steps x batch x
    block) over the step's time, and MFU = FLOPs a token x job tokens/s / ranks / the peak of one rank."""
    args = argparse.Namespace(world=8, speedup=None)
    done = [dict(kind='zero3', peak_flops=1e12, flops_per_token=1e9,
                 links=[dict(name='ib400', step=0.1, alone=0.08, blocked=0.03, busy=0.04)])]
    rows = {}
    for device in ('cpu', 'cuda'):
        cfg = {'gradient_accumulation_steps': 8, 'batch_size': 2, 'block_size': 16, 'device': device}
        bench_scale.print_link_table(args, cfg, done)
        rows[device] = [line for line in capsys.readouterr().out.splitlines() if line.startswith('| zero3 |')]
    # 8 x 2 x 16 = 256 tokens in 0.1 s: 2,560 tokens/s; 1e9 x 2560 / 8 ranks / 1e12 = 32% MFU
    assert rows['cpu'] == ['| zero3 | ib400 | 100.0 | 80.0 | 30.0 (30%) | 40.0 | 25% | 2,560 | 32.0% |'], rows
    assert rows['cuda'] == ['| zero3 | ib400 | 100.0 | 80.0 | 20.0 (20%) | 40.0 | 50% | 2,560 | 32.0% |'], rows


def test_bench_scale_link_table_reads_each_column_from_its_own_figure(capsys):
    # link_results: each column the median of its own figure over the timed steps (step, compute alone, blocked,
    # busy, in measure's order); the table: exposed is the time blocked in waits on a CPU, tokens/s the whole job's
    # (8 ranks, 8 micro-steps of 2 x 16 tokens in all) over the step with the link, MFU per rank
    link = types.SimpleNamespace(name='ib400', bandwidth=50e9, latency=5e-6)
    steps = [(0.05, 0.030, 0.01, 0.02), (0.04, 0.020, 0.02, 0.03), (0.03, 0.025, 0.00, 0.01)]
    [x] = bench_scale.link_results({'ib400': steps}, [link])
    assert x == dict(name='ib400', bandwidth=50e9, latency=5e-6, step=0.04, alone=0.025, blocked=0.01, busy=0.02)
    args = argparse.Namespace(world=8, speedup=None)
    cfg = {'gradient_accumulation_steps': 8, 'batch_size': 2, 'block_size': 16, 'device': 'cpu'}
    bench_scale.print_link_table(args, cfg, [dict(kind='zero3', links=[x], flops_per_token=1e6, peak_flops=1e9)])
    out = capsys.readouterr().out
    rows = [[c.strip() for c in line.strip('|').split('|')] for line in out.splitlines() if line.startswith('| zero')]
    # 256 tokens / 0.04 s = 6,400 tokens/s; 1e6 FLOPs a token x 6,400 / 8 ranks / 1e9 = 80%; hidden 1 - 10 / 20 ms
    assert rows == [['zero3', 'ib400', '40.0', '25.0', '10.0 (25%)', '20.0', '50%', '6,400', '80.0%']], out


# -----------------------------------------------------------------------------
# collectives that land only at their wait: what NCCL may do and gloo never does


class LateCollectives:
    """comm.py's async all-gathers and reduce-scatters as NCCL may run them, late: nothing moves until wait(). At launch
    the input is copied aside and the output poisoned (NaN); wait() checks that nothing freed, moved or wrote the two
    tensors meanwhile, then runs the collective on the copy. gloo is done before wait() returns, so without this the
    CPU suite cannot see a read before the wait, a buffer freed or reused in flight, or a collective never waited."""

    def __init__(self, monkeypatch):
        self.pending, self.errors = [], []
        for name in ('ALL_GATHER', 'REDUCE_SCATTER'):
            monkeypatch.setattr(comm, name, functools.partial(self.launch, name, getattr(comm, name)))
        resize = torch.UntypedStorage.resize_

        def resize_(storage, nbytes):  # freeing (or regrowing) a storage a collective still uses
            self.errors += [f'{w.name}: storage resized in flight' for w in self.pending if storage._cdata in w.storages]
            return resize(storage, nbytes)
        monkeypatch.setattr(torch.UntypedStorage, 'resize_', resize_)

    def launch(self, name, collective, out, inp, async_op=False, **kw):
        if not async_op:
            return collective(out, inp, **kw)
        work = LateWork(name, collective, out, inp, kw, self)
        self.pending.append(work)
        return work


class LateWork:
    def __init__(self, name, collective, out, inp, kw, late):
        self.name, self.out, self.inp, self.late = name, out, inp, late
        self.storages = {out.untyped_storage()._cdata, inp.untyped_storage()._cdata}
        self.where = (out.data_ptr(), inp.data_ptr())
        self.in_place = inp.untyped_storage()._cdata == out.untyped_storage()._cdata  # stages 1/2, and 3 with a cast
        self.copy = inp.clone()  # before the poison: an in-place gather's input is a row of its output
        self.run = functools.partial(collective, out, self.copy, **kw)
        out.detach().fill_(math.nan)  # read before the wait: NaN in the loss

    def wait(self):
        if self not in self.late.pending:
            return
        self.late.pending.remove(self)
        if (self.out.data_ptr(), self.inp.data_ptr()) != self.where or not self.out.isnan().all() or (
                not self.in_place and not torch.equal(self.inp, self.copy)):
            self.late.errors.append(f'{self.name}: its tensors moved or written before the wait')
        self.run()


def run_stage(device, stage, dtype=torch.float32, checkpointing=False, in_flight=(), **zero_kw):
    """MODEL (odd sizes, tied embeddings) trained as train.py trains it, at world 1: built on the meta device at stages
    1-3, 3 steps of 2 micro-steps, clipping on, and an eval forward after each step (its units reshard in no-grad
    forwards). in_flight: the collectives launched and not yet waited (a LateCollectives' pending), empty after each
    step. Returns the losses, the pre-clip grad norms, the eval losses and every fp32 param: stage 0's own, the masters
    of stages 1-3 (at world 1 a bucket's shard is the whole bucket). test_gpu.py runs it on NCCL."""
    with torch.device('meta' if stage else device):
        model = GPT(GPTConfig(**MODEL))
    cfg = zero.ZeroConfig(stage=stage, param_dtype=dtype, grad_clip=0.05, **zero_kw)
    engine = zero.build_engine(model, cfg, units=list(model.transformer.h), device=device)
    if checkpointing:
        fsdp_lite.checkpoint_activations(model.transformer.h)
    autocast = torch.autocast(device.type, dtype) if dtype != torch.float32 else nullcontext()
    data, run = torch.Generator().manual_seed(1234), dict(losses=[], norms=[], evals=[])
    for step in range(3):
        x = torch.randint(MODEL['vocab_size'], (2, 2, MODEL['block_size'] + 1), generator=data).to(device)
        batches = [(m[:, :-1].contiguous(), m[:, 1:].contiguous()) for m in x]
        loss, norm = train.train_step(engine, batches, 3e-3, autocast)
        with torch.no_grad(), autocast:
            run['evals'].append(model(*batches[0])[1].item())
        assert not in_flight, f'step {step}: {len(in_flight)} collectives never waited'
        run['losses'].append(loss.item())
        run['norms'].append(norm)
    if stage == 0:
        run['params'] = {n: p.detach().float().cpu() for n, p in model.named_parameters()}
    else:
        by_param = {p: v.cpu() for b in engine.buckets for p, v in b.views(engine.master_values(b))}
        run['params'] = {n: by_param[p] for n, p in model.named_parameters()}
    return run


LATE = {'stage 1': dict(stage=1), 'stage 2, bf16': dict(stage=2, dtype=torch.bfloat16),
        'stage 3, 2 blocks a unit, prefetch 2': dict(stage=3, blocks_per_unit=2, prefetch=2),
        'stage 3, bf16, checkpointing': dict(stage=3, dtype=torch.bfloat16, checkpointing=True),
        'stage 3, kept gathered after forward': dict(stage=3, reshard_after_forward=False),
        'stage 3, bf16, remainder master': dict(stage=3, dtype=torch.bfloat16,
                                                precision=kernels.Precision(master_weights='remainder'))}


@pytest.mark.parametrize('kind', LATE)
def test_collectives_that_land_only_at_their_wait_change_no_number(gloo_world, monkeypatch, kind):
    """Every async collective of stages 1-3 read, freed and reused only after its wait: with every one landing as late
    as NCCL may land it, the run is bit for bit the on-time one (at world 1, where comm skips the backend otherwise:
    the on-time run does, so it also equals the backend's, late)."""
    monkeypatch.setattr(comm.Comm, 'skip_backend_alone', False)
    late, cpu = LateCollectives(monkeypatch), torch.device('cpu')
    run = run_stage(cpu, **LATE[kind], in_flight=late.pending)
    assert not late.errors, late.errors  # before the on-time run: a buffer freed in flight may crash gloo's thread
    monkeypatch.undo()
    on_time = run_stage(cpu, **LATE[kind])
    assert_same_run(run, on_time, rtol=0, atol=0)  # bit for bit: losses, grad norms, every param
    assert run['evals'] == on_time['evals']


def test_at_world_1_a_collective_is_a_copy_or_nothing_counted_as_sent_and_never_the_backends(gloo_world, monkeypatch):
    """[Note: one rank]: at world 1 comm never calls the backend (its entry points raise here), does each collective as
    the copy it amounts to, or nothing, counts what it would send at any world size, and hands an async caller a done
    handle. Stages 1-3 then end bit for bit where they end through gloo, with the same counts."""
    def never(*args, **kwargs):
        raise AssertionError('a collective reached the backend at world 1')
    through = {}
    for skip in (False, True):
        monkeypatch.setattr(comm.Comm, 'skip_backend_alone', skip)
        if skip:
            for name in ('ALL_GATHER', 'REDUCE_SCATTER'):
                monkeypatch.setattr(comm, name, never)
            monkeypatch.setattr(dist, 'all_reduce', never)
        c = comm.Comm()
        assert c.alone is skip
        out, inp, total = torch.zeros(6), torch.arange(6.0), torch.tensor([2.5])
        assert c.reduce_scatter(out, inp) is None and torch.equal(out, inp)  # the average over one rank
        gathered = torch.zeros(6)
        assert c.all_gather(gathered, inp, async_op=True).wait() and torch.equal(gathered, inp)
        assert c.all_gather(inp, inp.view(6)) is None and torch.equal(inp, torch.arange(6.0))  # in place: no work
        c.all_reduce_sum(total)
        assert total.item() == 2.5 and dict(c.numel) == {'reduce_scatter': 6, 'all_gather': 12, 'all_reduce': 2}
        if skip:  # what the backend refuses, refused too: a collective of two sizes or dtypes
            for a, b in ((torch.zeros(3), inp), (torch.zeros(6, dtype=torch.bfloat16), inp)):
                for collective in (c.reduce_scatter, c.all_gather):
                    with pytest.raises(ValueError, match='a collective at world 1 of 6 torch.float32 into'):
                        collective(a, b)
        with torch.profiler.profile() as prof:  # train.py's profile=True names each collective, at world 1 too
            c.reduce_scatter(out, inp, name='reduce_scatter bucket 7')
            c.all_gather(inp, inp, name='all_gather unit 3')
        assert {'reduce_scatter bucket 7', 'all_gather unit 3'} <= {e.name for e in prof.events()}
        for name, kw in LATE.items():
            run = run_stage(torch.device('cpu'), **kw)
            if skip:
                assert_same_run(run, through[name], rtol=0, atol=0)  # bit for bit: losses, grad norms, every param
                assert run['evals'] == through[name]['evals']
            through[name] = run


def test_bench_zeros_through_backend_kind_calls_the_backend_at_world_1(gloo_world, monkeypatch):
    # bench.py zero's A/B of [Note: one rank]: 'zero2:through_backend' reduce-scatters through gloo, 'zero2' copies
    import bench_zero
    called = []
    monkeypatch.setattr(comm, 'REDUCE_SCATTER', lambda *a, real=comm.REDUCE_SCATTER, **kw: called.append(1) or real(*a, **kw))
    cfg = train.parse_config(['--device=cpu', '--n_layer=1', '--n_head=2', '--n_embd=16', '--block_size=8',
                              '--batch_size=1', '--dataset=shakespeare_char'])
    for kind, through in (('zero2', False), ('zero2:through_backend', True)):
        engine, before = bench_zero.build(kind, cfg, torch.device('cpu')), len(called)
        x = torch.randint(65, (1, 8))
        train.train_step(engine, [(x, x)], 1e-3, nullcontext())
        assert engine.comm.alone is not through and (len(called) > before) is through, kind


def test_bench_zero_counts_ddps_grads_once_in_its_buckets(gloo_world):
    # bench_zero.model_state_bytes: DDP with gradient_as_bucket_view holds its grads in its all-reduce buckets, no second
    # copy: params 4, grads 4 and AdamW's moments 8 bytes a param at world 1 (16Ψ), no 'ddp buckets' on top
    import bench_zero
    cfg = train.parse_config(['--device=cpu', '--n_layer=1', '--n_head=2', '--n_embd=16', '--block_size=8',
                              '--batch_size=1', '--dataset=shakespeare_char', '--dtype=float32'])
    engine = bench_zero.build('ddp', cfg, torch.device('cpu'))
    x = torch.randint(65, (1, 8))
    train.train_step(engine, [(x, x)], 1e-3, nullcontext())
    pops = bench_zero.model_state_bytes(engine)
    assert 'ddp buckets' not in pops and sum(pops.values()) == 16 * engine.psi, pops


# -----------------------------------------------------------------------------
# the end of a run ([Note: the end of a run])


def test_a_run_ends_only_once_nothing_else_holds_its_last_collectives_tensors(gloo_world):
    # a view dropped 0.3 s later, by another thread, stands in for gloo's worker: it lets go of a collective's
    # tensors after the caller has seen the collective complete. The run waits for it, with the GIL released
    # (the other thread needs it), and ends with the process group gone and no warning
    t = torch.zeros(4)
    dist.all_reduce(t)
    held = [t.view(-1)]
    threading.Timer(0.3, held.clear).start()
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        launch.end_process_group(torch.device('cpu'), t)
    assert t._use_count() == 1 and time.perf_counter() - t0 >= 0.3
    assert not dist.is_initialized()


def test_a_tensor_never_let_go_ends_the_run_after_the_timeout_with_a_warning(gloo_world):
    t = torch.zeros(4)
    held = t.view(-1)  # kept all along: the wait is bounded, and says why it gave up
    t0 = time.perf_counter()
    with pytest.warns(UserWarning, match='gloo still holds a tensor 0.2 s after the last collective'):
        launch.end_process_group(torch.device('cpu'), t, timeout=0.2)
    assert 0.2 <= time.perf_counter() - t0 < 5 and not dist.is_initialized() and t._use_count() == 2  # (the view)
    del held  # held to here


def test_on_nccl_the_end_waits_for_no_tensor_held(gloo_world, monkeypatch):
    # NCCL's worker is not gloo's: a tensor the caller still views is no reason to wait (test_gpu.py ends a real
    # NCCL run, test_a_nccl_run_ends_through_end_process_group); the backend stood in for, the wait must not start
    t = torch.zeros(4)
    held = t.view(-1)
    monkeypatch.setattr(dist, 'get_backend', lambda *args, **kwargs: 'nccl')
    with warnings.catch_warnings():
        warnings.simplefilter('error')  # a wait would end in gloo's warning, after the timeout
        launch.end_process_group(torch.device('cpu'), t, timeout=0.5)
    assert not dist.is_initialized() and t._use_count() == 2  # (the view, kept)
    del held

GLOO_THREADS_AFTER_THE_END = """
import os, sys, torch
sys.path.insert(0, os.getcwd())
import comm, launch  # first, as train.py and the benches import them
import torch.distributed as dist
def gloo_threads():
    names = [open(f'/proc/self/task/{tid}/comm').read().strip() for tid in os.listdir('/proc/self/task')]
    return sorted(n for n in names if 'gloo' in n)
assert 'torch._dynamo' not in sys.modules  # else the import below would not be the first
dist.init_process_group('gloo', rank=0, world_size=1, store=dist.HashStore())
import torch._dynamo  # noqa: F401  later, as meta init and torch.compile import it
KEPT = []  # stands in for a cache that keeps the mesh, out of our reach (torch 2.11 has one)
if sys.argv[1].startswith('fsdp2'):  # a module sharded by FSDP2 on this group (bench.py zero's fsdp2, test_zero.py's oracle)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    def run():
        m, mesh = torch.nn.Linear(4, 4), init_device_mesh('cpu', (1,))
        fully_shard(m, mesh=mesh)
        KEPT.extend([mesh] if sys.argv[1] == 'fsdp2-mesh-kept' else [])
        m(torch.ones(2, 4)).sum().backward()
        torch.nn.utils.clip_grad_norm_(list(m.parameters()), 1.0).full_tensor().item()  # as the oracle steps
    run()
t = torch.ones(4)
dist.all_reduce(t)
assert gloo_threads(), 'no thread named gloo while the group runs: the check below would see none either way'
launch.end_process_group(torch.device('cpu'), t)
print(gloo_threads())
"""


@pytest.mark.skipif(not os.path.isdir('/proc/self/task'), reason="reads the process's threads from Linux's /proc")
@pytest.mark.parametrize('run', ['plain', 'fsdp2', 'fsdp2-mesh-kept'])
def test_the_end_of_a_run_joins_gloos_threads_while_python_is_whole(run):
    # [Note: the end of a run]: torch._dynamo imported after the group started (as train.py's meta init and compile do)
    # kept the group alive past destroy_process_group, its worker threads too, into the interpreter's shutdown; and
    # after FSDP2, DTensor's caches (launch.DTENSOR_CACHES) and the module's cycles kept its mesh, and so the group;
    # under torch 2.11 a cache out of reach keeps the mesh too ('fsdp2' failed there): the mesh lets go of the group
    out = subprocess.run([sys.executable, '-c', GLOO_THREADS_AFTER_THE_END, run], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == '[]', out.stdout  # was ['gloo_tcp_loop', 'pt_gloo_runloop', 'pt_gloo_runloop']


def test_named_ranges_open_only_while_a_profiler_records(monkeypatch):
    """comm.traced ([Note: ranges only when traced]): no range is built outside a profiler (each costs host time on
    every collective and wait), and every one is inside it (test_memory.py checks they reach the trace)."""
    opened = []
    monkeypatch.setattr(comm, 'record_function', lambda name: opened.append(name) or nullcontext())
    with comm.traced('outside'):
        pass
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        with comm.traced('inside'):
            pass
    assert opened == ['inside']


def test_every_all_gather_and_reduce_scatter_goes_through_comms_pick_of_torchs_name():
    # torch 2.13 deprecates all_gather_into_tensor / reduce_scatter_tensor for *_single; comm.py picks the name torch
    # has, and nothing else calls the old ones (the CI run found check_same and two benches doing so)
    root = os.path.dirname(os.path.abspath(__file__))
    files = sorted(f for f in os.listdir(root) if f.endswith('.py') and not f.startswith('test_'))
    calls = [f'{f}:{n}' for f in files for n, line in enumerate(open(os.path.join(root, f)), 1)
             if 'dist.all_gather_into_tensor(' in line or 'dist.reduce_scatter_tensor(' in line]
    assert len(files) > 15 and calls == [], calls
    assert comm.ALL_GATHER is getattr(dist, 'all_gather_single', dist.all_gather_into_tensor)
    assert comm.REDUCE_SCATTER is getattr(dist, 'reduce_scatter_single', dist.reduce_scatter_tensor)

"""
comm: the collectives ZeRO needs, counted, on one process group; a run's process group, started
(start_process_group) and ended cleanly (end_process_group); and a simulated link for rank 0 of a big job.

`Comm` is what zero.py and fsdp_lite.py call: all-gather, reduce-scatter, all-reduce, each counted in elements
and bytes. Under torch's fake process group (bench.py scale: rank 0 of 64 ranks alone on one machine) every
collective returns at once; `Comm.use_link(Link(...))` makes each one take the time it would take on a real
network instead, asynchronously, while compute stays real:

    python bench.py scale --world 64 --link ib400 --kinds zero2,zero3
    python bench.py scale --world 64 --link 25,10 --kinds zero3       # 25 GB/s, 10 µs per ring step
    python bench.py scale --world 2 --link ag=0.89,331/rs=0.46,427    # each collective its own (bench.py link)
    python bench.py scale --world 64 --link ib400 --speedup h100      # as if the compute ran on an H100

[Note: simulated link] A collective of S bytes on N ranks takes the time of a ring (the convention of
nccl-tests' "bus bandwidth", doc/PERFORMANCE.md in github.com/NVIDIA/nccl-tests):
    all-gather, reduce-scatter    (N-1)/N * S / bandwidth + (N-1) * latency   (S: the full, unsharded buffer)
    all-reduce                    twice that (a reduce-scatter, then an all-gather)
Collectives run one after another on one link, as on NCCL's one communication stream: a collective launched
while another is in flight starts when that one ends. On a CPU the link uses no CPU, so it needs no thread:
its FIFO is one number, the time it will be free; a launch returns at once, and wait() sleeps until its
collective's end (and counts the time blocked). On a GPU it is the same FIFO on a side stream: the collective
waits for the compute that wrote its input, then the stream spins for its time (torch.cuda._sleep), and wait()
makes the current stream wait for it, as NCCL's work handles do; the host blocks nowhere.
[Note: one link per collective] A real backend need not run every collective at one bandwidth: gloo on this
CPU reduce-scatters at about half the bandwidth it all-gathers at (0.45 against 0.76-0.89 GB/s, fitted by
bench.py link), and all-reduces faster than either, so one α-β fit of them all is wrong for each.
`--link ag=B,L/rs=B,L/ar=B,L` gives each kind its own bandwidth and latency (bench.py link fits and prints them);
an all-reduce left out takes a reduce-scatter's time plus an all-gather's, and one given takes twice its ring
(2(N-1)/N * S / bandwidth + 2(N-1) * latency: nccl-tests' bus bandwidth for all-reduce).
What it cannot show: a real collective's bandwidth shared with other traffic, its own use of the cores and
memory bandwidth (gloo on a CPU competes with compute: see bench_link.py), and stragglers: every rank is rank 0.
"""
import atexit
import contextlib
import datetime
import gc
import importlib
import math
import os
import socket
import sys
import threading
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.distributed.nn.functional  # noqa: F401  before any process group: [Note: the end of a run]
from torch.profiler import record_function

# torch 2.13 renames these two collectives (the old names warn at every call, ~7 us); torch 2.11 (our GPU machines)
# has only the old names
warnings.filterwarnings('ignore', message=r'`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated')
ALL_GATHER = getattr(dist, 'all_gather_single', None) or dist.all_gather_into_tensor
REDUCE_SCATTER = getattr(dist, 'reduce_scatter_single', None) or dist.reduce_scatter_tensor


def traced(name):
    """A named range in a torch.profiler trace, only while a profiler records: [Note: ranges only when traced]."""
    return record_function(name) if torch.autograd._profiler_enabled() else contextlib.nullcontext()

# [Note: ranges only when traced] Our collectives and their waits are named ranges in a trace (train.py's
# profile=True). A record_function costs ~10 us of host time even with no profiler running (it builds its range),
# and stage 3 opens ~76 a micro-step with GPT-2 (a gather, its wait, a reduce-scatter, its wait per unit): on an
# H200 the compiled step is host-bound (README, "Measured: speed"), so they open only under a profiler.


def start_profiler(out_dir, rank, device):
    """train.py's profile=True: a torch.profiler trace of the run's iterations 2-4 (iteration 1 warms the profiler up),
    with the named ranges of our collectives and their waits (traced) to see the overlap."""
    os.makedirs(out_dir, exist_ok=True)
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if device.type == 'cuda' else [])
    path = os.path.join(out_dir, f'trace_rank{rank}.json')
    # repeat=1: one wait/warmup/active cycle; without it the schedule cycles until the end of the run
    profiler = torch.profiler.profile(activities=activities, on_trace_ready=lambda p: p.export_chrome_trace(path),
                                      schedule=torch.profiler.schedule(wait=0, warmup=1, active=3, repeat=1))
    profiler.start()
    return profiler


def profiler_step(profiler, out_dir, log):
    """After each iteration. The trace's ProfilerStep#1-#3 are iterations 2-4; after the 4th the trace is written and
    the profiler stopped (None is returned), so nothing profiles or slows the rest of the run."""
    profiler.step()
    if profiler.step_num < 4:
        return profiler
    profiler.stop()
    log(f"profiler trace of iterations 2-4: {out_dir}/trace_rank{{r}}.json (open in https://ui.perfetto.dev)")
    return None


# -----------------------------------------------------------------------------
# The collectives, counted


class Done:
    """The work handle of a collective done when launched: [Note: one rank]."""

    def wait(self):
        return True  # as a c10d work handle's wait()


DONE = Done()

# [Note: one rank] At world size 1 a collective has nothing to exchange: a reduce-scatter's output is its input (the
# average of one rank's values), an all-gather's is its input, an all-reduce leaves its tensor as it is. Comm does
# them as that copy, or nothing, and never calls the backend, which would still do its own work for each: gloo hands
# it to a worker thread and copies (here, 2 CPU cores: ~100 us a call, 6.1 ms to reduce-scatter 26 MB that a copy_
# moves in 1.8, 6.6 ms to all-gather 26 MB in place where nothing moves); NCCL launches a kernel on its own stream
# and orders it with the caller's by events. torch's FSDP2 skips them so too (and avoids NCCL's average at world 1,
# which "may produce incorrect results", its _fsdp_collectives.py says). They are still counted: the log's
# figures are what the same step sends at any world size. (An all-gather into its own input, as stages 1/2 gather
# their params, is then no work at all.) The async paths are then never taken at world 1, where the tests and a
# one-GPU machine run: tests of them set Comm.skip_backend_alone = False, which calls the backend as at any size.


class Comm:
    """The three collectives ZeRO needs, on one process group, counting the elements each one moves.
    Convention of the ZeRO paper: reduce-scattering an n-element buffer, or all-gathering into one,
    moves n elements per rank; an all-reduce is both, 2n. Divided by Ψ these are the table's figures.
    Each launch is a named range in a torch.profiler trace (train.py's profile=True): traced()."""
    skip_backend_alone = True  # False: call the backend at world size 1 too (tests of its async paths, A/B timings)

    def __init__(self, process_group=None, device=torch.device('cpu')):
        self.process_group = process_group
        self.device = device  # where its own tensors go: NCCL takes only CUDA tensors
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        # [Note: the fake process group] bench.py scale runs rank 0 of a 64-rank job alone, on torch's "fake"
        # backend: every collective returns at once and writes nothing. We then write what the collective
        # would have written if every rank held our data, so the numbers stay finite and every step is taken:
        # memory and compute are real, the losses are not.
        self.fake = dist.get_backend(process_group) == 'fake'
        self.alone = self.world_size == 1 and self.skip_backend_alone  # [Note: one rank]
        self.numel = Counter()  # collective kind -> elements moved since the caller last cleared it
        self.bytes = Counter()
        self.link = None  # fake process group only: a Link each collective also takes the time of

    def use_link(self, link):
        """From now on each collective takes `link`'s time ([Note: simulated link]); None: no time, as before."""
        if link is not None and not self.fake:
            raise ValueError("a simulated link needs the fake process group (bench.py scale): "
                             f"this process group ({dist.get_backend(self.process_group)}) has a real one")
        self.link = link

    def simulate(self, kind, nbytes, work, async_op):
        """The work handle a caller gets: the fake group's (done at once), or the simulated link's."""
        if self.link is None:
            return work
        work = self.link.start(kind, nbytes, self.world_size, self.device)
        return work if async_op else work.wait()  # a synchronous collective returns when it is done (None)

    @staticmethod
    def check_alone(out, inp):
        """What the backend refuses, refused at world 1 too ([Note: one rank]): out and inp of one size and dtype."""
        if out.numel() != inp.numel() or out.dtype != inp.dtype:
            raise ValueError(f"a collective at world 1 of {inp.numel()} {inp.dtype} into {out.numel()} {out.dtype}")

    def count(self, kind, tensor, factor=1):
        self.numel[kind] += factor * tensor.numel()
        self.bytes[kind] += factor * tensor.numel() * tensor.element_size()

    def all_gather(self, out, inp, async_op=False, name='all_gather'):
        self.count('all_gather', out)
        with traced(name):
            if self.alone:  # out is inp, so nothing moves where inp is out's one row (stages 1/2 gather in place)
                self.check_alone(out, inp)
                if out.data_ptr() != inp.data_ptr():
                    out.copy_(inp)
                return DONE if async_op else None
            work = ALL_GATHER(out, inp, group=self.process_group, async_op=async_op)
        if self.fake:  # (a copy of inp: stages 1/2 gather in place, inp is a row of out)
            out.view(self.world_size, -1).copy_(inp.clone())
        return self.simulate('all_gather', out.numel() * out.element_size(), work, async_op)

    def reduce_scatter(self, out, inp, async_op=False, name='reduce_scatter'):
        self.count('reduce_scatter', inp)
        with traced(name):
            if self.alone:  # the average of one rank's values: the values
                self.check_alone(out, inp)
                out.copy_(inp)
                return DONE if async_op else None
            work = REDUCE_SCATTER(out, inp, op=dist.ReduceOp.AVG, group=self.process_group, async_op=async_op)
        if self.fake:
            out.copy_(inp.view(self.world_size, -1)[self.rank])
        return self.simulate('reduce_scatter', inp.numel() * inp.element_size(), work, async_op)

    def all_reduce_sum(self, tensor):
        self.count('all_reduce', tensor, factor=2)
        if not self.alone:  # one rank's sum is its own tensor
            dist.all_reduce(tensor, group=self.process_group)
            if self.fake:  # the sum of world_size ranks' copies of our tensor
                tensor.mul_(self.world_size)
            self.simulate('all_reduce', tensor.numel() * tensor.element_size(), None, async_op=False)

    def broadcast(self, tensor):
        """Rank 0's values everywhere (start-up only, so not counted)."""
        src = 0 if self.process_group is None else dist.get_global_rank(self.process_group, 0)
        dist.broadcast(tensor, src=src, group=self.process_group)

    def check_same(self, what, values, fix="every rank must build the same model with the same config"):
        """Fail fast, instead of hanging or training on garbage, if the ranks built different layouts."""
        if self.fake or self.alone:
            return  # nobody else to compare with: the all-gather would return our own values at best
        mine = torch.tensor(values, dtype=torch.int64, device=self.device)
        every = torch.empty(self.world_size * len(values), dtype=torch.int64, device=self.device)
        ALL_GATHER(every, mine, group=self.process_group)  # not counted: start-up only
        for r, theirs in enumerate(every.view(self.world_size, -1).tolist()):
            if theirs != values:
                raise RuntimeError(f"rank {r} has a different {what} than rank {self.rank} ({theirs} vs {values}): {fix}")

# -----------------------------------------------------------------------------
# A run's process group: its start (start_process_group, restart_store) and its end (end_process_group)


def gather_objects(obj):
    """Every rank's obj (picklable), by rank: start-up checks only (not counted; not under the fake group)."""
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, obj)
    return every


def ranks_where(flag, device):
    """The ranks where flag is true, on every rank: one all-reduce of a flag a rank (start-up checks, not counted)."""
    flags = torch.zeros(dist.get_world_size(), dtype=torch.int32, device=device)
    flags[dist.get_rank()] = bool(flag)
    dist.all_reduce(flags)
    return flags.nonzero().flatten().tolist()


def first_on_machine():
    """This rank is its machine's first (LOCAL_RANK 0), or cannot tell (RANK set by hand, no torchrun's
    LOCAL_WORLD_SIZE): a line meant once a machine, not once a GPU."""
    return os.environ.get('LOCAL_RANK', '0') == '0' or 'LOCAL_WORLD_SIZE' not in os.environ


def launched_world_size():
    """The world size start_process_group will give this process: a launcher's WORLD_SIZE if it set RANK too, else 1."""
    return int(os.environ['WORLD_SIZE']) if 'RANK' in os.environ else 1


def absent_gpu(device_name):
    """What is wrong with 'cuda' or 'cuda:N' as a run alone's device (it takes the GPU it names), or None. train.py and
    sample.py ask, before any CUDA call fails on it with "invalid device ordinal"."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if int(device_name.partition(':')[2] or 0) >= gpus:
        return f"torch sees {gpus} GPU(s) here, cuda:0 to cuda:{gpus - 1}: name one of them" if gpus else \
            "torch sees no GPU here: use cpu"


class MachineError(ValueError):
    """A mistake of one machine's (its GPUs, its data), which other machines of the job may not share: each machine's
    first rank says it (train.config_error)."""


def gpu_problems(device, gpus):
    """Under a launcher each rank takes the GPU of its LOCAL_RANK (start_process_group), so a machine needs one GPU
    a rank it runs; a run alone takes the one it names."""
    if 'RANK' in os.environ:
        local = os.environ.get('LOCAL_WORLD_SIZE')  # torchrun's, per machine; else at least LOCAL_RANK + 1
        ranks = max(int(local or 1), int(os.environ.get('LOCAL_RANK', 0)) + 1)
        visible = os.environ.get('CUDA_VISIBLE_DEVICES')
        return [f"this machine runs {'at least ' * (not local)}{ranks} ranks, one GPU each (cuda:LOCAL_RANK), and torch "
                f"sees {gpus} GPU(s) here{f' (CUDA_VISIBLE_DEVICES={visible!r})' * (visible is not None)}: start at "
                f"most {gpus} a machine (torchrun --nproc_per_node={gpus}), or use device=cpu"] * (ranks > gpus)
    absent = absent_gpu(device)
    return [f"device={device!r}: {absent}"] * bool(absent)


def start_process_group(device_name, backend='', quiet_for=30.0):
    """Under torchrun: one process per rank, its device, its backend ('' = nccl on GPUs, gloo on CPUs). Without
    torchrun: world size 1 (a 1-rank process group, so every stage runs the same code). Returns (device, rank,
    world size). Beside it, from the rendezvous to the end, Stops.watch ([Note: a rank that stops on its own])."""
    launched = 'RANK' in os.environ
    if not launched:  # a port the OS says is free: two runs alone on one machine must not meet at one
        os.environ.update(RANK='0', WORLD_SIZE='1', LOCAL_RANK='0', MASTER_ADDR='127.0.0.1', MASTER_PORT=str(free_port()))
    device = torch.device(device_name)
    if device.type == 'cuda':  # a launched rank: its LOCAL_RANK's GPU; a run alone: the one named (cuda:1 is cuda:1)
        device = torch.device('cuda', int(os.environ['LOCAL_RANK']) if launched else device.index or 0)
        torch.cuda.set_device(device)
    backend = backend or ('nccl' if device.type == 'cuda' else 'gloo')
    rank, world_size = int(os.environ['RANK']), int(os.environ['WORLD_SIZE'])
    met, stops = threading.Event(), Stops()
    watcher = threading.Thread(target=stops.watch, args=(met, quiet_for), daemon=True)
    watcher.start()
    atexit.register(end_watch, stops, watcher)
    try:
        dist.init_process_group(backend=backend, device_id=device if backend == 'nccl' else None,
                                store=restart_store(), rank=rank, world_size=world_size)
    finally:
        met.set()
    return device, dist.get_rank(), dist.get_world_size()


# [Note: a rank that stops on its own] torchrun starts each machine's ranks on its own, and ends them on its own: when
# a rank stops, its machine's torchrun ends that machine's other ranks, and no other machine's. Those wait: at the
# rendezvous, for a rank that stopped before it (its machine's config mistake, a dataset it lacks), until torch's timeout
# (30 min for gloo); mid-run, under NCCL, in their next collective until its timeout (10 min), for a rank that raised
# (a CUDA out-of-memory on one GPU). gloo notices a peer gone at once, but each rank then prints a traceback of its own
# ("Connection closed by peer"), not the cause. So a rank that stops on its own says why as ever, and leaves its line
# in torchrun's store (key 'stopped': the first rank to stop keeps it). Each rank watches the store, once a second
# (twice before the ranks meet), beside its work: finding another machine's line, it marks it read ('read/<rank>')
# and stops with it; a line of its own machine's it only marks read (its torchrun ends it). A rank that raises after
# the line is there says that line, not its traceback. At its exit the rank that stopped waits (up to 2 s; 10 before
# the ranks meet, where some may be slow to arrive) until every rank has read it: node 0's torchrun holds the store,
# and ends, store and all, once node 0's ranks have. Under torchrun only (its store; the static rendezvous of
# --master_addr, or --standalone: the keys of a restart carry its count, which every machine's torchrun counts alike
# only when all of them restart together). Costs a connection and a request a second per rank at node 0's store.
class Stops:
    """This rank's side of [Note: a rank that stops on its own]: tell (it stops) and watch (for another's line)."""

    def __init__(self, timeout=5.0):
        self.rank, self.world_size = int(os.environ.get('RANK', 0)), launched_world_size()
        self.node, self.store, self.lost = os.environ.get('GROUP_RANK', '0'), None, False
        self.ended = threading.Event()  # set at exit: the watcher stops before Python does
        if os.environ.get('TORCHELASTIC_USE_AGENT_STORE') != 'True' or self.world_size == 1:
            return
        try:
            store = dist.TCPStore(os.environ['MASTER_ADDR'], int(os.environ['MASTER_PORT']), is_master=False,
                                  timeout=datetime.timedelta(seconds=timeout))
            self.store = dist.PrefixStore(f"nanozero/attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
        except RuntimeError:  # unreachable (node 0's torchrun ended): nobody to tell, nobody to hear
            self.lost = True

    def tell(self, line, before_meeting=False):
        """Leaves this rank's line for the others (after it has said why itself); returns the line of the rank that
        stopped first if that was another (this rank's stop may follow from it), else None."""
        if self.store is None:
            return None
        mine = (f"rank {self.rank} on node {self.node} ({socket.gethostname()}) stopped"
                f"{' before the ranks met' * before_meeting}: {line}")
        try:
            first = self.store.compare_set('stopped', '', mine).decode()
            self.store.set(f'read/{self.rank}', '1')
        except RuntimeError:  # the store went with node 0's torchrun: its ranks have ended
            return None
        atexit.register(self.wait_until_read, 10.0 if before_meeting else 2.0)
        return None if first == mine else first

    def wait_until_read(self, linger):
        keys, end = [f'read/{r}' for r in range(self.world_size)], time.monotonic() + linger
        try:
            while not self.store.check(keys) and time.monotonic() < end:
                time.sleep(0.05)
        except RuntimeError:
            pass

    def watch(self, met, quiet_for):
        """Beside a rank from its rendezvous to its end: stops it when another machine's rank stopped on its own;
        while it waits at the rendezvous (until `met` is set), says after quiet_for seconds what for (e.g. RANK and
        WORLD_SIZE set by hand, the other ranks never started), once a machine: a wait is never silent."""
        says, since, told = first_on_machine(), time.monotonic(), False
        theirs, read_at = None, None  # the line it stops with, and when it read a line
        while not (self.store is None and met.is_set()) and not self.ended.wait(1.0 if met.is_set() else min(0.5, quiet_for)):
            if self.lost and not met.is_set() and theirs is None:  # the rendezvous cannot happen
                theirs, read_at = (f"torchrun's store at {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} is gone "
                                   "before the ranks met: node 0's torchrun ended (its log says why)"), time.monotonic()
            elif self.store is not None and read_at is None and (line := self.line()) is not None:
                read_at = self.mark_read()
                if not line.split(' (', 1)[0].endswith(f' on node {self.node}'):  # "rank R on node N (host) ..."
                    theirs = line  # (its own machine's line: its torchrun ends it)
            if theirs is not None and (says or time.monotonic() - read_at > 5):  # the machine's first rank says it,
                self.stop(theirs, says)  # then its torchrun ends the others (theirs alone would end it unsaid)
            if says and not told and not met.is_set() and time.monotonic() - since >= quiet_for:
                told = True
                print(f"rank {self.rank}: still waiting for the other {self.world_size - 1} rank(s) at "
                      f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')} after {quiet_for:g} s: are they "
                      "started, with the same WORLD_SIZE and MASTER_ADDR:MASTER_PORT? (a rank that stopped before this "
                      "point said why in its machine's log)", file=sys.__stderr__, flush=True)

    def line(self):
        try:
            return self.store.get('stopped').decode() if self.store.check(['stopped']) else None
        except RuntimeError:  # node 0's torchrun ended
            self.store, self.lost = None, True
            return None

    def mark_read(self):
        with contextlib.suppress(RuntimeError):
            self.store.set(f'read/{self.rank}', '1')
        return time.monotonic()

    def stop(self, line, says):
        if says:  # (not sys.stderr: inside an excepthook torch's own, around it, holds sys.stderr in a buffer)
            print(f"rank {self.rank}: stopping: {line}", file=sys.__stderr__, flush=True)
        sys.stdout.flush()  # os._exit flushes nothing: the log's last lines
        os._exit(1)


def tell_on_a_crash():
    """sys.excepthook for a run's ranks (under torchrun, across ranks): an exception nothing caught is told to the
    others, and if another rank stopped first, said as that rank's stop in one line (this one's most likely follows
    from it: gloo's peer gone), not a traceback. Install it before the process group: torch's own, which prefixes
    [rankN] to each line, then goes around it."""
    if os.environ.get('TORCHELASTIC_USE_AGENT_STORE') != 'True' or launched_world_size() == 1:
        return
    previous_hook = sys.excepthook

    def hook(kind, e, tb):
        message = str(e).strip().splitlines()[0] if str(e).strip() else ''
        first = Stops().tell(f"{kind.__name__}: {message}", before_meeting=not dist.is_initialized())
        if first is None:
            return previous_hook(kind, e, tb)
        print(f"rank {os.environ['RANK']}: stopping: {first} (then here: {kind.__name__})", file=sys.__stderr__,
              flush=True)
    sys.excepthook = hook


def end_watch(stops, watcher):
    """At exit: the watcher ends before Python does (its store calls time out in 5 s), never inside a store call as
    Python finalizes ([Note: the end of a run])."""
    stops.ended.set()
    watcher.join(timeout=10)


def free_port():
    """A TCP port nothing listens on now (the OS's pick, let go at once)."""
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def restart_store():
    """After torchrun restarts the workers (--max-restarts), they rendezvous in torchrun's own TCP store again,
    which still holds the dead attempt's keys (the ranks' addresses): gloo then connects to dead processes
    (pytorch/pytorch#135712). A key prefix per attempt keeps each attempt to itself. None: the default store."""
    attempt = os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')
    if attempt == '0' or os.environ.get('TORCHELASTIC_USE_AGENT_STORE') != 'True':
        return None
    store = dist.TCPStore(os.environ['MASTER_ADDR'], int(os.environ['MASTER_PORT']), int(os.environ['WORLD_SIZE']),
                          is_master=False)
    return dist.PrefixStore(f'nanozero/attempt{attempt}', store)


# [Note: the end of a run] A gloo collective runs on one of gloo's worker threads. The caller sees it complete
# and moves on; a moment later the worker lets go of the collective's tensors, and because a tensor made in
# Python has a Python object, dropping the last C++ reference besides that object's takes the GIL. If Python
# is shutting down by then, the worker cannot take it and the process aborts ("terminate called without an
# active exception") after a run that succeeded. A final dist.barrier() makes that likely, not rare: it keeps
# the collectives still on a worker when it was called, their tensors included, until the barrier itself is let
# go, on a worker, after the caller has returned. A core dump of bench.py zero, which ended so 4 times in about
# 105 runs on 2 CPU cores (torch 2.13), shows the worker in ~AsyncBarrierWork -> ~AsyncAllgatherWork ->
# TensorImpl::decref_pyobject -> take_gil -> pthread_exit, while Python collects garbage on its way out.
# So a run ends with an all-reduce of a tensor it keeps (a barrier that keeps nothing alive) and waits, the GIL
# released, until gloo holds none of that tensor nor of `held`, the tensors of the caller's last collectives:
# until each one's C++ use count is back to the 1 of its own Python object. Earlier collectives' tensors are let
# go while the rank waits in that all-reduce and sleeps (their workers get the GIL then). NCCL runs its work on
# the GPU's streams and is left to destroy_process_group.
# That wait covers the tensors it knows; destroy_process_group covers the rest, by destroying the group, whose
# destructor lets go of the GIL and joins gloo's workers while Python is whole. It can only do so if nothing else
# holds the group, and torch itself did: torch.distributed.nn.functional writes `group=group.WORLD` as a default
# argument of ten functions, evaluated when the module is first imported, and torch._dynamo imports it (meta
# init and torch.compile import torch._dynamo). Imported after init_process_group, it kept the default group in
# those defaults for good, its workers alive into the shutdown: a short train.py run aborted so at exit once in
# 177 (2 ranks on 2 CPU cores). Imported before any group exists (3 ms), the defaults hold None, and the group
# goes at destroy_process_group (or, under DDP, which holds it too, when the engine goes: still before shutdown).
# Any module that takes group.WORLD as a default must be imported before the group starts: bench.py zero does so for
# ZeroRedundancyOptimizer's. After FSDP2 (bench.py zero's fsdp2 kind, test_zero.py's oracle), DTensor's caches hold
# its DeviceMesh, hence the group: sharding propagation's (one of them in C++), redistribution's plans and transforms,
# the mesh's topology (clip_grad_norm_ and full_tensor fill the last two), and the sharded module sits in reference
# cycles. So the end empties those caches and collects the cycles (let_go_of_dtensor_caches), once the caller has let
# go of its engines: bench.py zero drops them first; train.py's are gone when main returns, before shutdown. Under
# torch 2.11 (the GPU machines' torch) a cache we cannot reach by name keeps the mesh even so, from fully_shard on;
# a mesh holds its process groups in its `_pg_registry`, so the end empties that of every mesh still alive.


# torch's caches that keep a DeviceMesh (so its process group) after the DTensors that used it are gone; private
# names (torch 2.13): where one is missing, it is skipped
DTENSOR_CACHES = (('torch.distributed.tensor.debug', '_clear_sharding_prop_cache'),  # op sharding, Python and C++
                  ('torch.distributed.tensor._redistribute', 'clear_redistribute_planner_cache'),
                  ('torch.distributed.tensor._redistribute', '_gen_transform_infos.cache_clear'),
                  ('torch.distributed.tensor._collective_utils', 'MeshTopoInfo.build_from_mesh.cache_clear'))


def let_go_of_dtensor_caches():
    """Empty DTENSOR_CACHES, collect the cycles a sharded module leaves and empty the process groups of the meshes still
    alive, if DTensor ran: [Note: the end of a run]."""
    if 'torch.distributed.tensor' not in sys.modules:
        return
    for module, path in DTENSOR_CACHES:
        try:
            clear = importlib.import_module(module)
        except ImportError:
            continue
        for name in path.split('.'):
            clear = getattr(clear, name, None)
        if clear is not None:
            clear()
    gc.collect()
    DeviceMesh = getattr(sys.modules.get('torch.distributed.device_mesh'), 'DeviceMesh', None)
    if DeviceMesh is None:
        return
    # (by the type's mro, not isinstance: DeviceMesh's metaclass asks each object for its __class__, and some of
    # torch's objects warn when asked)
    for mesh in (obj for obj in gc.get_objects() if DeviceMesh in type(obj).__mro__):
        getattr(mesh, '_pg_registry', {}).clear()  # (torch 2.11: nothing else lets go of the mesh)


def end_process_group(device, *held, timeout=10.0):
    """Every rank done, then the default process group goes, no gloo worker left holding a tensor of ours."""
    done = torch.ones(1, device=device)
    dist.all_reduce(done)
    done.item()  # every rank is here (NCCL returns once the all-reduce is queued: this waits for its end)
    deadline = time.monotonic() + timeout
    while dist.get_backend() == 'gloo' and any(t._use_count() > 1 for t in (done, *held)):
        if time.monotonic() > deadline:  # e.g. `held` still viewed by the caller: say so, go
            warnings.warn(f"gloo still holds a tensor {timeout:g} s after the last collective; ending anyway")
            break
        time.sleep(1e-3)  # the GIL released: the worker takes it to let go
    let_go_of_dtensor_caches()  # FSDP2's mesh, and so the group, held by them
    dist.destroy_process_group()

# -----------------------------------------------------------------------------
# The simulated link ([Note: simulated link])

# name -> (bus bandwidth in bytes/s, latency in s per ring step, where the figures come from). Bandwidths are
# line rates per GPU and direction, so they are the best a ring can reach (nccl-tests measures somewhat less);
# latencies are assumptions of the usual order, not measurements: give your own as BANDWIDTH_GBps,LATENCY_us.
LINKS = {
    'nvlink': (450e9, 2e-6, "H100 SXM NVLink 4, 900 GB/s per GPU both ways together (NVIDIA's H100 datasheet): "
                            "450 GB/s each way; 2 µs per step assumed; within one 8-GPU node only"),
    'ib400': (50e9, 5e-6, "400 Gb/s InfiniBand NDR, one NIC per GPU (as in a DGX H100): 400/8 = 50 GB/s each way; "
                          "5 µs per step assumed (NIC, switch and NCCL's per-step overhead)"),
    'eth100': (12.5e9, 20e-6, "100 Gb/s Ethernet, one NIC per GPU: 100/8 = 12.5 GB/s each way; 20 µs per step assumed"),
}


KIND_KEYS = {'ag': 'all_gather', 'rs': 'reduce_scatter', 'ar': 'all_reduce'}  # per-collective --link keys


def parse_numbers(spec, key=''):
    """'BANDWIDTH_GBps[,LATENCY_us]' -> (bytes/s, seconds); latency 0 if left out; ValueError if not that."""
    try:
        numbers = [float(x) for x in spec.split(',')]
    except ValueError:
        numbers = []
    if not 1 <= len(numbers) <= 2 or numbers[0] <= 0 or min(numbers) < 0 or not all(map(math.isfinite, numbers)):
        raise ValueError(f"{key}{spec!r} is not a bandwidth > 0 and a latency >= 0")
    return numbers[0] * 1e9, (numbers[1] if len(numbers) == 2 else 0.0) / 1e6


def parse_link(spec, clock=None):
    """'ib400' (a name of LINKS), 'BANDWIDTH_GBps[,LATENCY_us]' (latency 0 if left out), or one of those per
    collective, 'ag=B,L/rs=B,L[/ar=B,L]' ([Note: one link per collective]) -> a Link."""
    clock = clock or Clock()
    if spec in LINKS:
        bandwidth, latency, _ = LINKS[spec]
        return Link(bandwidth, latency, spec, clock)
    try:
        if '=' not in spec:
            bandwidth, latency = parse_numbers(spec)
            return Link(bandwidth, latency, f"{bandwidth / 1e9:g} GB/s, {latency * 1e6:g} µs", clock)
        per_kind = {}
        for part in spec.split('/'):
            key, _, numbers = part.partition('=')
            if key not in KIND_KEYS:
                raise ValueError(f"unknown collective {key!r} (ag, rs or ar)")
            if KIND_KEYS[key] in per_kind:
                raise ValueError(f"{key}= given twice")
            per_kind[KIND_KEYS[key]] = parse_numbers(numbers, f"{key}=")
        missing = [key for key in ('ag', 'rs') if KIND_KEYS[key] not in per_kind]
        if missing:
            raise ValueError(f"{' and '.join(missing)}= missing")
    except ValueError as e:
        raise ValueError(f"--link {spec!r}: {e}; give one of {', '.join(LINKS)}, BANDWIDTH_GBps[,LATENCY_us] (e.g. 50,5), "
                         "or one per collective: ag=B,L/rs=B,L[/ar=B,L] (B in GB/s, L in µs)") from None
    return Link(*per_kind['all_gather'], spec, clock, per_kind=per_kind)


class Clock:
    """Real time: a wait sleeps."""

    def now(self):
        return time.perf_counter()

    def wait_until(self, t):  # a sleep wakes ~0.1 ms late (more on a busy machine): sleep to 1 ms short, then spin
        left = t - time.perf_counter()  # read once: a second read may be later than t
        if left > 1e-3:
            time.sleep(left - 1e-3)
        while time.perf_counter() < t:
            pass


class VirtualClock:
    """Link time without sleeping: now() is the time `source` measured since the clock started divided by
    `speedup` (compute as if on a device that many times faster; math.inf: compute takes no time), plus every
    wait so far. Exact where waiting costs the compute nothing, as on a CPU whose link uses no CPU. source
    time.process_time: the CPU time this process computed, which a busy machine's preemptions do not stretch
    (with one thread; the tests use it). Not on CUDA: kernels run on their own time, the host's clock misses them."""

    def __init__(self, speedup=1.0, source=time.perf_counter):
        self.speedup, self.source, self.waited = speedup, source, 0.0
        self.start = source()

    def now(self):
        return (self.source() - self.start) / self.speedup + self.waited

    def wait_until(self, t):
        self.waited += max(0.0, t - self.now())


@dataclass
class Link:
    bandwidth: float  # bytes/s per rank and direction: nccl-tests' "bus bandwidth"
    latency: float  # seconds per ring step
    name: str = ''
    clock: object = field(default_factory=Clock)
    free_at: float = 0.0  # when the collectives launched so far are done (the FIFO)
    busy: Counter = field(default_factory=Counter)  # kind -> seconds the link took, since reset()
    blocked: Counter = field(default_factory=Counter)  # kind -> seconds the host waited for it (CPU), since reset()
    per_kind: dict = field(default_factory=dict)  # kind -> its own (bandwidth, latency), where given

    def seconds(self, kind, nbytes, world_size):
        """The ring's time for a collective over an nbytes buffer (the full one: all-gather output,
        reduce-scatter input, all-reduce tensor) on world_size ranks, with the collective's own bandwidth and
        latency if the link has them ([Note: one link per collective])."""
        if kind == 'all_reduce' and kind not in self.per_kind:  # a reduce-scatter, then an all-gather
            return self.seconds('reduce_scatter', nbytes, world_size) + self.seconds('all_gather', nbytes, world_size)
        bandwidth, latency = self.per_kind.get(kind, (self.bandwidth, self.latency))
        n, steps = world_size, 2 if kind == 'all_reduce' else 1  # an all-reduce's own fit: twice the ring's steps
        return steps * ((n - 1) / n * nbytes / bandwidth + (n - 1) * latency)

    def reset(self):
        self.busy, self.blocked = Counter(), Counter()

    def start(self, kind, nbytes, world_size, device):
        seconds = self.seconds(kind, nbytes, world_size)
        self.busy[kind] += seconds
        if device.type == 'cuda':
            return CudaLinkWork(self, device, seconds)
        self.free_at = max(self.clock.now(), self.free_at) + seconds  # queued behind whatever is in flight
        return LinkWork(self, kind, self.free_at)

    def wait_until(self, kind, end):
        now = self.clock.now()
        if end > now:
            self.clock.wait_until(end)
            self.blocked[kind] += end - now  # the link's time, not the clock's overshoot (exposed <= busy)

    # --- on CUDA: a side stream that spins for each collective's time

    def cuda_stream(self, device):
        if getattr(self, '_stream', None) is None:
            self._stream = torch.cuda.Stream(device)
            self._cycles_per_s = cuda_cycles_per_second(device)
        return self._stream


class LinkWork:
    """A collective in flight on the CPU's simulated link: done at `end` on the link's clock."""

    def __init__(self, link, kind, end):
        self.link, self.kind, self.end = link, kind, end

    def wait(self):
        self.link.wait_until(self.kind, self.end)


class CudaLinkWork:
    """A collective in flight on the simulated link's stream: it starts once the current stream's work so far
    (the compute that wrote its input) is done and after the collectives before it, spins for its time, and
    wait() orders the current stream after it. Buffers need no record_stream: the spin touches no memory."""

    def __init__(self, link, device, seconds):
        stream = link.cuda_stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            torch.cuda._sleep(max(1, round(seconds * link._cycles_per_s)))
            self.done = torch.cuda.Event()
            self.done.record(stream)
        self.device = device

    def wait(self):
        torch.cuda.current_stream(self.device).wait_event(self.done)


def cuda_cycles_per_second(device, cycles=50_000_000):
    """How many cycles torch.cuda._sleep spins per second on this GPU (its clock, measured once)."""
    with torch.cuda.device(device):
        torch.cuda._sleep(1000)  # load the kernel
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(cycles)
        end.record()
        end.synchronize()
        return cycles / (start.elapsed_time(end) / 1e3)

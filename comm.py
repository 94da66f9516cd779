"""
comm: the collectives ZeRO needs, counted, on one process group, and a simulated link for rank 0 of a big job.
(A run's process group, its start, its watch and its end: launch.py.)

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
import contextlib
import math
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.distributed.nn.functional  # noqa: F401  before any process group: [Note: the end of a run] (launch.py)
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

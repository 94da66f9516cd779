"""
Benchmarks, one mode per idea:

    python bench.py kernels                                # on the GPU if there is one: sizes 1M..256M
    python bench.py kernels --device cpu                   # CPU sizes 1M..64M (256M needs ~9 GB of RAM)
    python bench.py kernels --sizes 1M,16M --device cpu
    python bench.py kernels --grad_dtype bfloat16          # grads reduced in bf16 (reduce_dtype='bfloat16')
    python bench.py kernels --modes --sizes 16M            # each storage-precision mode against the fp32 master
    python bench.py kernels --modes --against HEAD~3       # ... and each against the kernel of another commit
    OMP_NUM_THREADS=1 python bench.py kernels --device cpu # steadier numbers on a shared machine
    torchrun --standalone --nproc_per_node=2 bench.py zero # a training step: ZeRO-1/2/3 vs DDP, ZeRO optimizer, FSDP2
    python bench.py scale --world 64                       # rank 0 of 64 ranks, alone: model states, peaks
    python bench.py scale --world 64 --link ib400          # ... and each collective takes a simulated link's time
    torchrun --standalone --nproc_per_node=2 bench.py link # gloo's latency and bandwidth here, fitted
    python bench.py train --vary zero_stage=2,3            # train.py's own runs, side by side: tok/s, peak memory

kernels: for each flat shard size n, time kernels.adamw_step (fp32 master/m/v, fp32 grad, bf16 param out)
against the best torch offers on the same buffers: torch.optim.AdamW(fused=True) stepping the fp32 master,
plus the `param.copy_(master)` cast to bf16 that it needs afterwards (and the foreach path, for context).
Goals: time ratio <= 0.9 on CPU and GPU; on GPU >= 0.85 of the copy bandwidth. The bandwidth counts the
bytes the step must move (30 B/elem) and the copy's read + write (8 B/elem); on a CPU the copy also pays
a read of each destination line before writing it, so there "of copy" can exceed 1.

kernels --modes: for each n, the time of each storage-precision mode of kernels.adamw_step (kernels.py's docstring)
as a ratio to the fp32-master step on the same n, with the bytes per element each one must move, and the fraction
of the copy bandwidth those bytes reach (goal on GPU: >= 0.85 for every mode, 8-bit ones included). With --against
REV, each mode also runs in the library built from csrc/ as it was at git revision REV (today's compiler and flags),
the two taking turns on the same buffers: "vs REV" is this tree's time over that one's (a change to a kernel, timed
against its baseline in one run, on one machine).

zero: see bench_zero.py (step time ratios, bytes per rank, exposed communication).
scale: see bench_scale.py (estimated vs measured model states, peak memory, at any world size on one machine).
link: see bench_link.py (the simulated link of comm.py, calibrated on this machine's gloo).
train: see bench_train.py (train.py jobs of each variant in turn: tokens/s, step time, MFU, peak memory, ratios).
"""
import argparse
import functools
import os
import subprocess
import sys
import time

import torch

import bench_link
import bench_scale
import bench_train
import bench_zero
import kernels
import library

# ----------------------------------------------------------------------------
# timing


def time_ms(fns, device, repeats=10, warmup=3):
    """Median wall time in ms of each fn in the dict fns: CUDA events on GPU, perf_counter on CPU. The fns take
    turns, so a machine that slows down for a while (shared CPUs) slows all of them alike, in an order reversed every
    other round: a fn that reads the buffers its neighbour just wrote finds them in cache (1M elements, 30 MB: a CPU's
    L3, a GPU's L2), and would be the faster for its place alone."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times = {name: [] for name in fns}
    for turn in range(repeats):
        for name, fn in list(fns.items())[::1 if turn % 2 == 0 else -1]:
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times[name].append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times[name].append((time.perf_counter() - t0) * 1e3)
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}


def parse_size(s):
    """'16M' -> 16 * 2**20, '4K' -> 4096, '1000' -> 1000; ValueError for anything else, or below 1."""
    scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(s[-1:].upper(), 1)
    try:
        n = int(float(s[:-1] if scale > 1 else s) * scale)
    except ValueError:
        n = 0
    if n < 1:
        raise ValueError(f"--sizes: {s!r} is not a shard size: give elements, e.g. 1000, 4K, 16M")
    return n

# ----------------------------------------------------------------------------
# mode: kernels


def copy_bandwidth(device, n):
    """GB/s of dst.copy_(src) over n fp32 elements, counting the read and the write (8 B/elem)."""
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    return 8 * n / time_ms({"copy": lambda: dst.copy_(src)}, device)["copy"] / 1e6


def bench_kernels(args):
    if args.device.split(":")[0] == "cuda" and not torch.cuda.is_available():  # before: torch's AssertionError
        raise ValueError(f"--device {args.device}: torch sees no GPU here, use --device cpu")
    device = torch.device(args.device)
    sizes = [parse_size(s) for s in args.sizes.split(",")] if args.sizes else \
        [2**20 * k for k in ((1, 4, 16, 64, 256) if device.type == "cuda" else (1, 4, 16, 64))]
    if args.modes and min(sizes) < 256:  # bench_modes rounds each size down to whole blocks: below one, nothing is left
        raise ValueError(f"--sizes {args.sizes}: --modes needs sizes of at least 256 (one 8-bit block)")
    if args.modes:
        return bench_modes(device, sizes, getattr(torch, args.grad_dtype), args.against)
    impl = kernels.resolve_impl("auto", device)
    hp = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
    copy_gbs = copy_bandwidth(device, max(sizes + [2**26]))  # >= 256 MB each way: bigger than any cache
    print(f"device {device} ({torch.get_num_threads()} threads)" if device.type == "cpu" else
          f"device {torch.cuda.get_device_name(device)}", f"| impl {impl} | grads {args.grad_dtype}",
          f"| copy bandwidth {copy_gbs:.1f} GB/s")
    print(f"{'n':>11} {'MB moved':>9} {'ours ms':>9} {'GB/s':>7} {'of copy':>8} "
          f"{'torch fused+cast ms':>20} {'ratio':>6} {'torch foreach+cast ms':>22} {'ratio':>6}")
    for n in sizes:
        torch.manual_seed(0)
        master = torch.randn(n, device=device)
        grad = torch.randn(n, device=device).to(getattr(torch, args.grad_dtype))
        exp_avg, exp_avg_sq = torch.zeros_like(master), torch.zeros_like(master)
        param = torch.empty(n, device=device, dtype=torch.bfloat16)
        found_inf = torch.zeros(1, device=device)
        decay_numel = n * 3 // 4  # most of a real shard is >= 2-D weights

        def ours():
            kernels.adamw_step(master, grad, exp_avg, exp_avg_sq, param, found_inf, decay_numel=decay_numel,
                               step=10, grad_scale=0.5, impl=impl, **hp)

        def torch_step(opt):
            if p.grad is not grad:
                p.grad.copy_(grad)  # bf16 grads: torch's AdamW needs them in the param's dtype, fp32
            opt.step()
            param.copy_(master)  # the bf16 cast that torch's step leaves to do

        # torch on the same buffers: the master is the Parameter, each optimizer keeps its own m and v
        p = torch.nn.Parameter(master)
        p.grad = grad if grad.dtype == torch.float32 else torch.empty_like(master)
        fns = {"ours": ours}
        for variant in ("fused", "foreach"):
            opt = torch.optim.AdamW([p], lr=hp["lr"], betas=(hp["beta1"], hp["beta2"]), eps=hp["eps"],
                                    weight_decay=hp["weight_decay"], fused=variant == "fused",
                                    foreach=variant == "foreach")
            fns[variant] = functools.partial(torch_step, opt)
        ms = time_ms(fns, device, repeats=max(10, min(100, 2**26 // n)))  # more repeats where they are cheap
        # 8 master + 8 exp_avg + 8 exp_avg_sq (read + write) + 4 grad read + 2 bf16 param write = 30 B/elem
        # (28 with bf16 grads; torch then moves 28 + 6 for the grad cast + 6 for the param cast = 40)
        moved = n * (24 + grad.element_size() + param.element_size())
        gbs = moved / ms["ours"] / 1e6
        print(f"{n:>11,} {moved / 1e6:>9.0f} {ms['ours']:>9.2f} {gbs:>7.1f} {gbs / copy_gbs:>8.2f} "
              f"{ms['fused']:>20.2f} {ms['ours'] / ms['fused']:>6.2f} "
              f"{ms['foreach']:>22.2f} {ms['ours'] / ms['foreach']:>6.2f}")
        del master, grad, exp_avg, exp_avg_sq, param, p, fns


# (name, master dtype, param dtype, state dtype, stochastic rounding): the first row is the one the others are timed against
PRECISION_MODES = [
    ("fp32 master -> bf16 param", torch.float32, torch.bfloat16, torch.float32, False),
    ("fp32 master -> bf16, bf16 m/v", torch.float32, torch.bfloat16, torch.bfloat16, False),
    ("fp32 master -> bf16, int8 m/v", torch.float32, torch.bfloat16, torch.uint8, False),
    ("fp32 master, no param", torch.float32, None, torch.float32, False),
    ("fp32 master -> fp16 param", torch.float32, torch.float16, torch.float32, False),
    ("remainder + bf16 param", torch.int16, torch.bfloat16, torch.float32, False),
    ("remainder, int8 m/v", torch.int16, torch.bfloat16, torch.uint8, False),
    ("bf16 param only", None, torch.bfloat16, torch.float32, False),
    ("bf16 param only, stochastic", None, torch.bfloat16, torch.float32, True),
    ("bf16 param only, stoch., int8", None, torch.bfloat16, torch.uint8, True),
]


def bytes_moved(master, param, state, grad):
    """Bytes per element one step must move: master and m/v read + written, the param written (and read when it
    holds the weights: no fp32 master), the grad read; int8 state adds an fp32 absmax per 256 elements."""
    nbytes = lambda dtype: dtype.itemsize if dtype else 0
    state_bytes = nbytes(state) + (4 / 256 if state == torch.uint8 else 0)
    reads_param = master != torch.float32
    return 2 * nbytes(master) + (1 + reads_param) * nbytes(param) + nbytes(grad) + 4 * state_bytes


def library_at(rev, impl):
    """kernels' library for impl ('cpu' / 'cuda') built from csrc/ at git revision rev, or from the folder rev (a
    machine without the repository's history: `git archive REV csrc | tar x -C some/folder`, then some/folder/csrc)."""
    def show(name):
        if os.path.isdir(rev):
            with open(os.path.join(rev, name)) as f:
                return f.read()
        done = subprocess.run(["git", "show", f"{rev}:csrc/{name}"], capture_output=True, text=True,
                              cwd=os.path.dirname(os.path.abspath(__file__)))
        if done.returncode:
            raise SystemExit(f"--against {rev}: git cannot show csrc/{name} there: {done.stderr.strip()}")
        return done.stdout
    source, common = show("adamw_cpu.cpp" if impl == "cpu" else "adamw.cu"), show("adamw_common.h")
    try:
        lib = library.build(impl, source.replace('#include "adamw_common.h"', common))
    except RuntimeError as e:  # e.g. its AdamWArgs has other fields than library.AdamWArgs
        raise SystemExit(f"--against {rev}: {e}") from None
    # csrc/ before the 8-bit bucket tables were stored rotated (6b343c3) reads them in order: give it them so
    lib.buckets_in_order = "(int32_t)(b ^ 0x80000000u) >> 16" in common
    return lib


def with_library(impl, lib, fn):
    """fn() with kernels.adamw_step(impl=impl) running lib (a library.Library), and the code tables lib reads."""
    ours, kernels._LIBRARIES[impl] = kernels._LIBRARIES[impl], lib
    tables = kernels._code_tables
    if getattr(lib, "buckets_in_order", False):
        made = lib.__dict__.setdefault("tables_in_order", {})  # once a device (same_bits runs lib before any timing)

        def in_order(device):
            if device not in made:
                maps, buckets = tables(device)
                made[device] = maps, torch.cat([b.roll(1 << 15) for b in buckets.split(1 << 16)])
            return made[device]
        kernels._code_tables = in_order
    try:
        fn()
    finally:
        kernels._LIBRARIES[impl], kernels._code_tables = ours, tables


def mode_shard(mode, n, device, weights):
    """One shard's tensors in a storage-precision mode, for adamw_step: (master, param, exp_avg, exp_avg_sq, absmax)."""
    _, master_dtype, param_dtype, state_dtype, _ = mode
    master = None if master_dtype is None else torch.zeros(n, device=device, dtype=master_dtype)
    param = None if param_dtype is None else weights.to(param_dtype)
    state = [torch.zeros(n, device=device, dtype=state_dtype) for _ in range(2)]
    absmax = [torch.zeros(n // 256, device=device) for _ in range(2)] if state_dtype == torch.uint8 else None
    return master, param, *state, absmax


def mode_step(mode, shard, grad, step, impl):
    master, param, exp_avg, exp_avg_sq, absmax = shard
    kernels.adamw_step(master, grad, exp_avg, exp_avg_sq, param, torch.zeros(1, device=grad.device),
                       decay_numel=grad.numel() * 3 // 4, step=step, absmax=absmax, impl=impl,
                       rounding_seed=1234 if mode[4] else None, lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8,
                       weight_decay=0.1)


def same_bits(impl, lib, device, n=2**16):
    """The modes in which `lib` leaves every state tensor bit for bit as ours does after 3 steps (normal grads,
    and zero, tiny and huge ones: sqrt's and the divide's slow paths, all-zero blocks)."""
    torch.manual_seed(1)
    weights, grad = torch.randn(n, device=device), torch.randn(n, device=device)
    grad[:n // 8] = 0
    grad[n // 8:n // 4] *= 1e-30
    grad[n // 4:n // 4 + 1000] *= 1e30
    as_bytes = lambda shard: [t.view(torch.uint8) for t in (*shard[:4], *(shard[4] or [])) if t is not None]  # noqa: E731
    same = []
    for mode in PRECISION_MODES:
        ours, theirs = mode_shard(mode, n, device, weights), mode_shard(mode, n, device, weights)
        for step in (1, 2, 3):
            mode_step(mode, ours, grad, step, impl)
            with_library(impl, lib, functools.partial(mode_step, mode, theirs, grad, step, impl))
        if all(torch.equal(a, b) for a, b in zip(as_bytes(ours), as_bytes(theirs))):
            same.append(mode[0])
    return same


def bench_modes(device, sizes, grad_dtype, against=None):
    """Every mode against the fp32-master step; `against`: REV[,REV...], each a git revision or a folder of csrc/'s
    files (library_at), built and timed in turns with ours, first checked bit for bit against ours (same_bits)."""
    impl = kernels.resolve_impl("auto", device)
    if against and impl == "reference":
        raise SystemExit(f"--against needs the {device.type} kernel, and it does not build here (see the warning)")
    baselines = {rev: library_at(rev, impl) for rev in against.split(",")} if against else {}
    for rev, lib in baselines.items():
        same = same_bits(impl, lib, device)
        print(f"{rev}: the same bits as ours after 3 steps in " + (
            "every mode" if len(same) == len(PRECISION_MODES) else f"{len(same)} of {len(PRECISION_MODES)} modes, "
            f"not in: {', '.join(m[0] for m in PRECISION_MODES if m[0] not in same)}"))
    copy_gbs = copy_bandwidth(device, max(sizes + [2**26]))  # >= 256 MB each way: bigger than any cache
    print(f"device {device}" + (f" ({torch.get_num_threads()} threads)" if device.type == "cpu" else
          f" ({torch.cuda.get_device_name(device)})"), f"| impl {impl} | grads {grad_dtype}",
          f"| copy bandwidth {copy_gbs:.1f} GB/s")
    print("ratio: time / the first row's time on the same n; of copy: the mode's bytes / time, over the copy bandwidth"
          + "".join(f"; vs {rev}: time / the time of the kernel at {rev}" for rev in baselines))
    print(f"{'n':>11} {'mode':<31} {'B/elem':>7} {'ms':>8} {'ratio':>6} {'of copy':>8}"
          + "".join(f" {rev + ' ms':>12} {'vs ' + rev:>12}" for rev in baselines))
    for n in sizes:
        n = n // 256 * 256  # int8 state works in blocks of 256
        torch.manual_seed(0)
        weights, grad = torch.randn(n, device=device), torch.randn(n, device=device).to(grad_dtype)
        fns = {}
        for mode in PRECISION_MODES:
            fns[mode[0]] = functools.partial(mode_step, mode, mode_shard(mode, n, device, weights), grad, 10, impl)
            for rev, lib in baselines.items():
                fns[mode[0], rev] = functools.partial(with_library, impl, lib, fns[mode[0]])
        ms = time_ms(fns, device, repeats=max(10, min(100, 2**26 // n)))
        for name, master_dtype, param_dtype, state_dtype, _ in PRECISION_MODES:
            moved = bytes_moved(master_dtype, param_dtype, state_dtype, grad_dtype)
            of_copy = moved * n / ms[name] / 1e6 / copy_gbs
            print(f"{n:>11,} {name:<31} {moved:>7.2f} {ms[name]:>8.2f} {ms[name] / ms[PRECISION_MODES[0][0]]:>6.2f} "
                  f"{of_copy:>8.2f}" + "".join(f" {ms[name, rev]:>12.2f} {ms[name] / ms[name, rev]:>12.2f}"
                                               for rev in baselines))
        del fns

# ----------------------------------------------------------------------------
# the dispatcher: one entry per mode, each a function taking the parsed args

MODES = {"kernels": bench_kernels, "zero": bench_zero.bench_zero, "scale": bench_scale.bench_scale,
         "link": bench_link.bench_link, "train": bench_train.bench_train}

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", choices=sorted(MODES))
    parser.add_argument("--sizes", default=None, help="comma-separated shard sizes, e.g. 1M,4M,16M")
    parser.add_argument("--grad_dtype", default="float32", choices=["float32", "bfloat16"],
                        help="kernels: the grad shard's dtype (torch's AdamW then also pays the cast to fp32)")
    parser.add_argument("--modes", action="store_true",
                        help="kernels: time every storage-precision mode against the fp32-master step instead")
    parser.add_argument("--against", default=None, metavar="REV",
                        help="kernels --modes: also time the kernel built from csrc/ at git revision REV (or from the "
                             "folder REV; several: REV,REV,...), in turns, after a bit-for-bit check against ours")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cpu", "cuda"],
                        help="kernels: where to run (zero takes its device from the config: --set device=cuda)")
    bench_zero.add_arguments(parser)
    bench_scale.add_arguments(parser)
    bench_train.add_arguments(parser)
    args = parser.parse_args()
    try:
        MODES[args.mode](args)
    except ValueError as e:  # a setting the bench cannot run (each checks its settings first): one line, once
        if os.environ.get("RANK", "0") == "0":
            print(f"bench.py {args.mode}: {e}", file=sys.stderr)
        sys.exit(2)

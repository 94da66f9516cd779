"""
The real link here, measured and fitted, so a simulated one (comm.py, [Note: simulated link]) can be checked
against it: time all-gathers, reduce-scatters and all-reduces of 4 KB to 64 MB on N gloo ranks, fit the ring's time

    t = (N-1) * latency + (N-1)/N * S / bandwidth          (S: the full buffer's bytes; all-reduce: twice that)

by least squares, once for all-gathers and reduce-scatters together and once per collective ([Note: one link
per collective] in comm.py), and print both as `bench.py scale --link` takes them:

    torchrun --standalone --nproc_per_node=2 bench.py link
    torchrun --standalone --nproc_per_node=4 bench.py link

Then simulate the same world and config and compare with the real run (README, "Does prefetch hide the network"):

    OMP_NUM_THREADS=1 python bench.py scale --world 2 --link B,L --kinds zero1,zero2,zero3
    torchrun --standalone --nproc_per_node=2 bench.py zero --kinds zero1,zero2,zero3

On a CPU, gloo's collectives run on threads that compete with the compute for the cores, and they copy
through memory the compute also uses: a fit of collectives timed alone says what they cost on an idle
machine, not what they take away from compute running beside them (see the README's calibration row).
"""
import time

import torch
import torch.distributed as dist

import comm
import launch

SIZES = [2**k for k in range(10, 25, 2)]  # full-buffer elements, fp32: 4 KB .. 64 MB
KINDS = ('all_gather', 'reduce_scatter', 'all_reduce')
KEYS = {kind: key for key, kind in comm.KIND_KEYS.items()}  # all_gather -> ag, as --link takes it


def buffer_numels(world_size):
    return [size - size % world_size for size in SIZES]  # each a multiple of N: at 3 ranks 1023 elements, not 1024


def time_collective(kind, numel, world_size, repeats):
    """Median seconds of one collective over a numel-element fp32 buffer, the slowest rank's (numel: a multiple of
    world_size, as every collective of ours: a flat buffer is padded to one, [Note: padding] in zero.py)."""
    full, shard = torch.zeros(numel, device='cpu'), torch.zeros(numel // world_size, device='cpu')  # gloo
    times = []
    for _ in range(repeats + 2):  # the first two are a warm-up
        dist.barrier()
        t0 = time.perf_counter()
        if kind == 'all_gather':
            comm.ALL_GATHER(full, shard)  # all_gather_single where torch has it (comm.py)
        elif kind == 'reduce_scatter':
            comm.REDUCE_SCATTER(shard, full, op=dist.ReduceOp.AVG)
        else:
            dist.all_reduce(full)
        times.append(time.perf_counter() - t0)
    slowest = torch.tensor(times[2:], device='cpu')
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.median().item()


def fit(points, world_size, kind='all_gather'):
    """Least squares of comm.Link.seconds, t = steps * ((N-1) * latency + (N-1)/N * bytes / bandwidth) (steps: 2
    for an all-reduce, else 1), in relative error (each row divided by its t, so 4 KB counts as much as 64 MB)
    -> (bandwidth B/s, latency s)."""
    steps = 2 if kind == 'all_reduce' else 1
    x = torch.tensor([steps * (world_size - 1) / world_size * nbytes for nbytes, _ in points], dtype=torch.float64,
                     device='cpu')
    t = torch.tensor([seconds for _, seconds in points], dtype=torch.float64, device='cpu')
    design = torch.stack([torch.full_like(x, steps * (world_size - 1.0)), x], dim=1) / t.unsqueeze(1)
    latency, inverse_bandwidth = torch.linalg.lstsq(design, torch.ones_like(t).unsqueeze(1)).solution.squeeze(1).tolist()
    if inverse_bandwidth <= 0:
        raise RuntimeError(f"{kind}: the timings do not fit a ring (larger buffers were not slower): run again on a "
                           "quieter machine")
    return 1 / inverse_bandwidth, max(latency, 0.0)  # noise can fit a latency a hair below 0


def bench_link(args):
    if launch.launched_world_size() < 2:  # one rank has no link to time (the fit said "run again ..." after it)
        raise ValueError("needs at least 2 ranks: torchrun --standalone --nproc_per_node=2 bench.py link")
    dist.init_process_group('gloo')
    rank, world_size = dist.get_rank(), dist.get_world_size()
    rows = []
    for numel in buffer_numels(world_size):
        for kind in KINDS:
            rows.append((kind, 4 * numel, time_collective(kind, numel, world_size, repeats=max(3, min(20, 2**22 // numel)))))
    if rank == 0:
        # one fit of all-gathers and reduce-scatters together (an all-reduce: twice that), and one per collective
        one = comm.Link(*fit([(b, t) for k, b, t in rows if k != 'all_reduce'], world_size), 'one fit')
        per_kind = {kind: fit([(b, t) for k, b, t in rows if k == kind], world_size, kind) for kind in KINDS}
        spec = '/'.join(f"{KEYS[kind]}={bw / 1e9:.4g},{lat * 1e6:.4g}" for kind, (bw, lat) in per_kind.items())
        each = comm.parse_link(spec)
        print(f"gloo, {world_size} ranks, torch {torch.__version__}, {torch.get_num_threads()} thread(s)/rank\n")
        print("| collective | MB | measured ms | one fit ms | / measured | per-collective fit ms | / measured |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for kind, nbytes, seconds in sorted(rows, key=lambda r: KINDS.index(r[0])):
            a, b = one.seconds(kind, nbytes, world_size), each.seconds(kind, nbytes, world_size)
            print(f"| {kind} | {nbytes / 1e6:.3f} | {seconds * 1e3:.3f} | {a * 1e3:.3f} | {a / seconds:.2f} | "
                  f"{b * 1e3:.3f} | {b / seconds:.2f} |")
        print(f"\none fit: bandwidth {one.bandwidth / 1e9:.3f} GB/s, latency {one.latency * 1e6:.1f} µs per ring step "
              f"(all-gathers and reduce-scatters)")
        for kind, (bw, lat) in per_kind.items():
            print(f"{kind}: bandwidth {bw / 1e9:.3f} GB/s, latency {lat * 1e6:.1f} µs per ring step")
        print(f"--link {one.bandwidth / 1e9:.4g},{one.latency * 1e6:.4g}")
        print(f"--link {spec}")
    launch.end_process_group(torch.device('cpu'))  # [Note: the end of a run]

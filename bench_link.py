"""
The real link here, measured and fitted, so a simulated one (comm.py, [Note: simulated link]) can be checked
against it: time all-gathers and reduce-scatters of 4 KB to 64 MB on N gloo ranks, fit the ring's time

    t = (N-1) * latency + (N-1)/N * S / bandwidth          (S: the full buffer's bytes)

by least squares, and print the link as `bench.py scale --link BANDWIDTH_GBps,LATENCY_us` takes it:

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

SIZES = [2**k for k in range(10, 25, 2)]  # full-buffer elements, fp32: 4 KB .. 64 MB


def time_collective(kind, numel, world_size, repeats):
    """Median seconds of one collective over a numel-element fp32 buffer, the slowest rank's."""
    full, shard = torch.zeros(numel), torch.zeros(numel // world_size)
    times = []
    for _ in range(repeats + 2):  # the first two are a warm-up
        dist.barrier()
        t0 = time.perf_counter()
        if kind == 'all_gather':
            dist.all_gather_into_tensor(full, shard)
        else:
            dist.reduce_scatter_tensor(shard, full, op=dist.ReduceOp.AVG)
        times.append(time.perf_counter() - t0)
    slowest = torch.tensor(times[2:])
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return slowest.median().item()


def fit(points, world_size):
    """Least squares of t = (N-1) * latency + x / bandwidth, x = (N-1)/N * bytes, in relative error (each row
    divided by its t, so 4 KB counts as much as 64 MB) -> (bandwidth B/s, latency s)."""
    x = torch.tensor([(world_size - 1) / world_size * nbytes for nbytes, _ in points], dtype=torch.float64)
    t = torch.tensor([seconds for _, seconds in points], dtype=torch.float64)
    design = torch.stack([torch.full_like(x, world_size - 1.0), x], dim=1) / t.unsqueeze(1)
    latency, inverse_bandwidth = torch.linalg.lstsq(design, torch.ones_like(t).unsqueeze(1)).solution.squeeze(1).tolist()
    return 1 / inverse_bandwidth, latency


def bench_link(args):
    dist.init_process_group('gloo')
    rank, world_size = dist.get_rank(), dist.get_world_size()
    rows, points = [], []
    for numel in SIZES:
        for kind in ('all_gather', 'reduce_scatter'):
            seconds = time_collective(kind, numel, world_size, repeats=max(3, min(20, 2**22 // numel)))
            rows.append((kind, 4 * numel, seconds))
            points.append((4 * numel, seconds))
    bandwidth, latency = fit(points, world_size)
    if rank == 0:
        link = comm.Link(bandwidth, latency)
        print(f"gloo, {world_size} ranks, torch {torch.__version__}, {torch.get_num_threads()} thread(s)/rank\n")
        print("| collective | MB | measured ms | fitted ms | fitted / measured |")
        print("|---|---:|---:|---:|---:|")
        for kind, nbytes, seconds in rows:
            model = link.seconds(kind, nbytes, world_size)
            print(f"| {kind} | {nbytes / 1e6:.3f} | {seconds * 1e3:.3f} | {model * 1e3:.3f} | {model / seconds:.2f} |")
        print(f"\nfit: bandwidth {bandwidth / 1e9:.3f} GB/s, latency {latency * 1e6:.1f} µs per ring step")
        print(f"--link {bandwidth / 1e9:.4g},{latency * 1e6:.4g}")
    dist.barrier()
    dist.destroy_process_group()

"""
Issue 17 diagnostic: why is compiled ZeRO-3 slower than ZeRO-2 per micro-step on one GPU?

Builds the engines exactly as bench_zero.build does (train.build: meta init, compiled per unit), config/zero3.py's
model (GPT-2 124M, bf16 autocast, 12 x 1024 micro-batches), in one process (as bench zero does). Per kind:
  A) `--warm` warm-up steps of `--micro` micro-steps, then `--steps` steps under torch.profiler (CPU + CUDA):
     wall ms/step, GPU busy (union of device intervals) and kernel-time sum per step, GPU idle fraction, launches,
     sync-type runtime calls per step (cudaStreamSynchronize, cudaDeviceSynchronize, cudaEventSynchronize,
     cudaMemcpy (not Async), cudaMalloc/cudaFree/cudaHostAlloc), top 10 kernels, top 10 CPU ops by self time;
  B) one step with torch.cuda.set_sync_debug_mode('warn'): each synchronizing call site (Python stack) counted,
     all warnings with stacks written to OUT/sync_warnings_<kind>.txt;
  C) a step of `--long` micro-steps (default 40, as config/zero3.py), then one more timed, without the profiler, a CUDA event and a host
     timestamp at each micro-step's forward: ms per micro-step on host and device, and the device's lag behind the
     host (lag ~0: the GPU waits for the host = host-bound or a sync; lag growing: the host runs ahead = GPU-bound).

GPU (world 1, NCCL):   torchrun --standalone --nproc_per_node=1 .ci/stage3_diag.py
CPU dry run (gloo):    torchrun --standalone --nproc_per_node=1 .ci/stage3_diag.py --tiny
Options: --kinds zero3,zero2 (build/compile zero3 first), --micro 4, --long 40 (0: skip C), --compile 0,
         --parts C (only the timeline, no profiler in the process), --loss-chunk N (model.LOSS_CHUNK),
         --turns R [--ranges-ab] (R rounds of C with the kinds in turns; with the ranges always open too),
         --cprofile (one step per kind under cProfile: top Python costs and zero3 - zero2), --set key=value.
"""
import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time
import traceback
import warnings
from collections import Counter, defaultdict
from contextlib import nullcontext

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.chdir(ROOT)  # the configs exec config/gpt2_124m.py relative to the repository root

import torch  # noqa: E402
from torch.autograd import DeviceType  # noqa: E402

import bench_zero  # noqa: E402
import comm  # noqa: E402
import launch  # noqa: E402
import train  # noqa: E402

TINY = ['device=cpu', 'dtype=bfloat16', 'dataset=shakespeare_char', 'n_layer=12', 'n_embd=64', 'n_head=4',
        'block_size=64', 'batch_size=1', 'bucket_mb=0.19']  # 0.19 MB: 13 stage-2 buckets, as 13 stage-3 units (124M: 17)
SYNC_NAMES = ('cudaStreamSynchronize', 'cudaDeviceSynchronize', 'cudaEventSynchronize', 'cudaMemcpy',
              'cudaMemcpy2D', 'cudaMalloc', 'cudaFree', 'cudaHostAlloc', 'cudaMallocHost', 'cudaFreeHost',
              'cudaStreamWaitEvent', 'cudaEventQuery')
BLOCKING = ('cudaStreamSynchronize', 'cudaDeviceSynchronize', 'cudaEventSynchronize', 'cudaMemcpy', 'cudaMemcpy2D')
PROJECT = ('zero.py', 'fsdp_lite.py', 'train.py', 'model.py', 'kernels.py', 'library.py', 'comm.py', 'bench_zero.py')


def args_():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument('--tiny', action='store_true', help="small model on CPU/gloo (a dry run)")
    p.add_argument('--kinds', default='zero2,zero3')
    p.add_argument('--micro', type=int, default=4, help="micro-steps per step in A) and B)")
    p.add_argument('--long', type=int, default=40, help="micro-steps of C)'s step (0: skip C)")
    p.add_argument('--warm', type=int, default=2)
    p.add_argument('--steps', type=int, default=2)
    p.add_argument('--compile', type=int, default=1)
    p.add_argument('--cprofile', action='store_true')
    p.add_argument('--parts', default='A,B,C', help="A: torch.profiler, B: sync sites, C: the long step's timeline")
    p.add_argument('--loss-chunk', type=int, default=0, help="model.LOSS_CHUNK (logits a head chunk) if not 0")
    p.add_argument('--turns', type=int, default=0, help="then R rounds of C, the kinds in turns: per-round ratios")
    p.add_argument('--ranges-ab', action='store_true', help="in --turns, each kind also with comm.traced's ranges "
                   "always open (the cost of [Note: ranges only when traced], in the same process)")
    p.add_argument('--out', default='out-stage3-diag')
    p.add_argument('--set', action='append', default=[], metavar='KEY=VALUE')
    return p.parse_args()


def fmt_ms(us):
    return f"{us / 1e3:.2f}"


def union_us(intervals):
    total, end = 0.0, -1e30
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def main():
    a = args_()
    if a.loss_chunk:
        import model
        model.LOSS_CHUNK = a.loss_chunk
    overrides = (TINY if a.tiny else []) + [f'compile={bool(a.compile)}', f'gradient_accumulation_steps={a.micro}'] + a.set
    cfg = train.parse_config(['config/zero3.py'] + [f'--{kv}' for kv in overrides])
    device, rank, world = launch.start_process_group(cfg['device'], cfg['backend'])
    train.check_config(cfg, world)
    train.prepare_data(cfg, rank, device)
    data = train.load_split(train.data_dir(cfg), 'train')
    cuda = device.type == 'cuda'
    os.makedirs(a.out, exist_ok=True)
    log = print if rank == 0 else (lambda *x, **k: None)
    autocast = nullcontext() if cfg['dtype'] == 'float32' else torch.autocast(device.type, getattr(torch, cfg['dtype']))
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    lr, it = cfg['learning_rate'], [0]

    def step(engine, micro):
        it[0] += 1
        c = {**cfg, 'gradient_accumulation_steps': micro}
        return train.train_step(engine, train.train_batches(data, it[0], c, rank, world, device), lr, autocast)

    kinds = a.kinds.split(',')
    t0 = time.perf_counter()
    engines = {k: bench_zero.build(k, cfg, device) for k in kinds}
    log(f"torch {torch.__version__}, {torch.cuda.get_device_name(device) if cuda else 'cpu'}, world {world} "
        f"({torch.distributed.get_backend()}), {cfg['n_layer']}x{cfg['n_embd']}, {cfg['batch_size']}x{cfg['block_size']} "
        f"tokens, dtype {cfg['dtype']}, compile {cfg['compile']}, TORCH_NCCL_AVOID_RECORD_STREAMS="
        f"{os.environ.get('TORCH_NCCL_AVOID_RECORD_STREAMS', 'unset')}; built in {time.perf_counter() - t0:.1f} s")
    t0 = time.perf_counter()
    for k in kinds:  # warm-up: compile, optimizer state, stage 3's recorded order
        for _ in range(a.warm):
            step(engines[k], a.micro)
    sync()
    from torch._dynamo.utils import counters
    log(f"warm-up {time.perf_counter() - t0:.1f} s; dynamo: unique_graphs {counters['stats'].get('unique_graphs', 0)}, "
        f"calls_captured {counters['stats'].get('calls_captured', 0)}, graph_breaks {sum(counters['graph_break'].values())}")
    summary = {}
    for k in kinds:
        summary[k] = guarded(log, diagnose, k, engines[k], step, a, cuda, sync, log) or {}
    log("\n== summary (ms)")
    for k, s in summary.items():
        log(f"  {k}: " + ', '.join(f"{n} {v:.2f}" for n, v in s.items()))
    if a.turns and a.long:
        turns(engines, kinds, step, a, cuda, sync, log)
    if a.cprofile:
        profile_python(engines, kinds, step, a, sync, log)
    launch.end_process_group(device)


def diagnose(kind, engine, step, a, cuda, sync, log):
    parts = a.parts.split(',')
    if 'A' not in parts:
        log(f"\n=== {kind}")
        if cuda and 'B' in parts:
            guarded(log, sync_sites, kind, engine, step, a, sync, log)
        return guarded(log, micro_timeline, engine, step, a, cuda, sync, log) if 'C' in parts and a.long else {}
    log(f"\n=== {kind}: {a.steps} steps x {a.micro} micro-steps under torch.profiler")
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    mem0 = torch.cuda.memory_stats() if cuda else {}
    walls = []  # the profiler's first step (warmup, not recorded) takes its start-up costs
    got = {}

    def ready(p):  # the active steps' results, before the profiler's next cycle clears them
        got['events'], got['avgs'] = p.events(), p.key_averages()
    with torch.profiler.profile(activities=acts, schedule=torch.profiler.schedule(wait=0, warmup=1, active=a.steps, repeat=1),
                                on_trace_ready=ready) as prof:
        for i in range(a.steps + 1):
            sync()
            t = time.perf_counter()
            step(engine, a.micro)
            sync()
            walls += [(time.perf_counter() - t) * 1e3] if i else []
            prof.step()
    mem1 = torch.cuda.memory_stats() if cuda else {}
    n = a.steps
    events = got['events']
    # device work: kernels, memcpy, memset (not the GPU mirrors of record_function ranges, which span whole steps)
    dev = [e for e in events if e.device_type != DeviceType.CPU and not e.is_user_annotation
           and 'annotation' not in str(getattr(e, 'activity_type', '') or '')]
    runtime = Counter(e.name for e in events if e.device_type == DeviceType.CPU and e.name.startswith('cu'))
    rt_time = defaultdict(float)
    for e in events:
        if e.device_type == DeviceType.CPU and e.name in BLOCKING:
            rt_time[e.name] += e.time_range.end - e.time_range.start
    wall = statistics.median(walls)
    out = {'wall/step': wall, 'wall/micro': wall / a.micro}
    if cuda:
        busy = union_us([(e.time_range.start, e.time_range.end) for e in dev]) / n
        ksum = sum(e.time_range.end - e.time_range.start for e in dev) / n
        launches = sum(v for name, v in runtime.items() if 'Launch' in name) / n
        log(f"wall ms/step {wall:.2f} (steps {', '.join(f'{w:.1f}' for w in walls)}); GPU busy {fmt_ms(busy)} ms/step "
            f"(idle {1 - busy / 1e3 / wall:.0%}); device-op time sum {fmt_ms(ksum)} ms/step; {len(dev) / n:.0f} device ops "
            f"and {launches:.0f} launches per step")
        streams = defaultdict(list)
        for e in dev:
            streams[getattr(e, 'device_resource_id', 0)].append((e.time_range.start, e.time_range.end))
        log("busy per stream, ms/step: " + ', '.join(f"stream {sid} {fmt_ms(union_us(iv) / n)} ({len(iv) / n:g} ops)"
                                                     for sid, iv in sorted(streams.items(), key=lambda kv: -len(kv[1]))[:4]))
        log("per step: " + ', '.join(f"{name} {runtime[name] / n:g}" for name in SYNC_NAMES if runtime[name])
            + "  (own: 1 cudaDeviceSynchronize; grad norm .item(): 1 sync)")
        log("host blocked in sync calls, ms/step: " + (', '.join(f"{k} {v / n / 1e3:.2f}" for k, v in rt_time.items()) or '0'))
        log("allocator during the profiled steps: " + ', '.join(
            f"{key} +{mem1.get(key, 0) - mem0.get(key, 0)}" for key in ('num_device_alloc', 'num_device_free',
                                                                        'num_alloc_retries', 'num_sync_all_streams')))
        out.update({'gpu busy/step': busy / 1e3, 'gpu idle %': 100 * (1 - busy / 1e3 / wall)})
        per = defaultdict(lambda: [0.0, 0])
        for e in dev:
            per[e.name][0] += e.time_range.end - e.time_range.start
            per[e.name][1] += 1
        log("top 10 device ops:  ms/step  calls/step  name")
        for name, (us, c) in sorted(per.items(), key=lambda kv: -kv[1][0])[:10]:
            log(f"  {fmt_ms(us / n):>8} {c / n:>8g}  {name[:90]}")
    else:
        log(f"wall ms/step {wall:.2f} (steps {', '.join(f'{w:.1f}' for w in walls)}); CPU only: no device timeline")
    log("top 10 CPU ops by self time:  self ms/step  calls/step  name")
    cpu_avgs = [e for e in got['avgs'] if e.device_type == DeviceType.CPU]
    for e in sorted(cpu_avgs, key=lambda e: -e.self_cpu_time_total)[:10]:
        log(f"  {fmt_ms(e.self_cpu_time_total / n):>8} {e.count / n:>8g}  {e.key[:90]}")
    if cuda and 'B' in parts:
        guarded(log, sync_sites, kind, engine, step, a, sync, log)
    if a.long and 'C' in parts:
        out.update(guarded(log, micro_timeline, engine, step, a, cuda, sync, log) or {})
    return out


def guarded(log, fn, *args):
    """One part failing (on a GPU this script could not be tried on) leaves the others' output."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001
        log(f"!! {fn.__name__} failed: {type(e).__name__}: {e}")
        torch.cuda.set_sync_debug_mode('default') if torch.cuda.is_available() else None
        return None


def sync_sites(kind, engine, step, a, sync, log):
    """One step with set_sync_debug_mode('warn'): every synchronizing call, with its Python stack."""
    sites, records = Counter(), []
    show = warnings.showwarning

    def handler(message, category, filename, lineno, file=None, line=None):
        if 'synchroniz' not in str(message):
            return show(message, category, filename, lineno, file, line)
        stack = traceback.extract_stack()[:-1]
        ours = [f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in stack
                if os.path.basename(f.filename) in PROJECT]
        sites[(f"{os.path.basename(filename)}:{lineno}", ' < '.join(ours[::-1][:4]))] += 1
        records.append(f"{message}\n" + ''.join(traceback.format_list(stack[-14:])))

    sync()
    with warnings.catch_warnings():
        warnings.simplefilter('always')
        warnings.showwarning = handler
        torch.cuda.set_sync_debug_mode('warn')
        try:
            step(engine, a.micro)
        finally:
            torch.cuda.set_sync_debug_mode('default')
    sync()
    path = os.path.join(a.out, f'sync_warnings_{kind}.txt')
    with open(path, 'w') as f:
        f.write('\n'.join(records))
    log(f"sync debug mode, one step of {a.micro} micro-steps: {sum(sites.values())} synchronizing calls at "
        f"{len(sites)} sites (stacks: {path})")
    for (where, ours), c in sites.most_common(8):
        log(f"  {c:>4}x  {where}  <  {ours}")


def micro_timeline(engine, step, a, cuda, sync, log):
    """One step of a.long micro-steps: host time and device time at each micro-step's forward."""
    marks = []

    def mark(*_):
        ev = None
        if cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
        marks.append((time.perf_counter(), ev))
    step(engine, a.long)  # a first one: allocator and pinned-memory caches grow to a step of this many micro-steps
    handle = engine.module.register_forward_pre_hook(mark)
    try:
        sync()
        mark()
        step(engine, a.long)
        mark()  # host: the step returned (its grad norm .item() waited for the device)
        sync()
        end = time.perf_counter()
    finally:
        handle.remove()
    h0, e0 = marks[0]
    host = [(t - h0) * 1e3 for t, _ in marks]
    devt = [e0.elapsed_time(e) for _, e in marks] if cuda else host
    # marks: start, forward 1..long, after step. Micro-step i spans forward i -> forward i+1 (the last one: -> step end)
    hm = [host[i + 1] - host[i] for i in range(1, a.long)]
    dm = [devt[i + 1] - devt[i] for i in range(1, a.long)]
    lag = [d - h for h, d in zip(host[1:-1], devt[1:-1])]
    wall = (end - h0) * 1e3
    log(f"one step of {a.long} micro-steps: wall {wall:.1f} ms = {wall / a.long:.2f} ms/micro-step; "
        f"micro-steps 1..{a.long - 1} (forward to next forward), ms: host median {statistics.median(hm):.2f} "
        f"(first {hm[0]:.2f}, last {hm[-1]:.2f})" + (f", device median {statistics.median(dm):.2f} (first {dm[0]:.2f}, "
                                                     f"last {dm[-1]:.2f})" if cuda else ''))
    if cuda:
        picks = sorted({0, 1, 2, len(lag) // 2, len(lag) - 1})
        log("device lag behind host at forward k (ms; ~0 = GPU waits for host, growing = host ahead): "
            + ', '.join(f"k={i + 1} {lag[i]:.1f}" for i in picks)
            + f"; optimizer step + tail {devt[-1] - devt[-2]:.1f} ms device, {host[-1] - host[-2]:.1f} ms host")
        return {f'wall/micro @{a.long}': wall / a.long, f'device/micro @{a.long}': statistics.median(dm),
                f'host/micro @{a.long}': statistics.median(hm)}
    return {f'wall/micro @{a.long}': wall / a.long}


def turns(engines, kinds, step, a, cuda, sync, log):
    """a.turns rounds, each kind's long step once a round (rotated order, as bench.py zero): the median of each kind's
    wall ms a micro-step (the step's wall time over its micro-steps), and of each round's ratio to the first kind,
    which a slow spell of the host cancels out of."""
    variants = [(k, False) for k in kinds] + ([(k, True) for k in kinds] if a.ranges_ab else [])
    users = (comm, sys.modules['zero'], sys.modules['fsdp_lite'])  # zero and fsdp_lite hold their own `traced`
    real_traced = comm.traced
    always = comm.record_function
    quiet = lambda *x, **k: None  # noqa: E731
    host = defaultdict(list)
    try:
        for r in range(a.turns):
            for i in range(len(variants)):
                k, ranges = variants[(r + i) % len(variants)]
                for module in users:
                    module.traced = always if ranges else real_traced
                out = micro_timeline(engines[k], step, a, cuda, sync, quiet)
                host[k + (' +ranges' if ranges else '')].append(out[f'wall/micro @{a.long}'])
    finally:
        for module in users:
            module.traced = real_traced
    first = list(host)[0]
    log(f"\n== {a.turns} rounds in turns, {a.long} micro-steps a step: wall ms a micro-step, median (each round's ratio "
        f"to {first}, median, min-max)")
    for name, values in host.items():
        ratios = [v / f for v, f in zip(values, host[first])]
        log(f"  {name:<16} {statistics.median(values):7.2f}  ({statistics.median(ratios):.3f}x, "
            f"{min(ratios):.3f}-{max(ratios):.3f})")


def profile_python(engines, kinds, step, a, sync, log):
    """One step per kind under cProfile: top Python-side costs, and what zero3 spends that zero2 does not."""
    stats = {}
    for k in kinds:
        pr = cProfile.Profile()
        sync()
        pr.enable()
        step(engines[k], a.micro)
        sync()
        pr.disable()
        st = pstats.Stats(pr)
        stats[k] = {f"{os.path.basename(f)}:{line}({fn})": (v[1], v[2], v[3]) for (f, line, fn), v in st.stats.items()}
        top = sorted(stats[k].items(), key=lambda kv: -kv[1][1])[:12]
        log(f"\n== cProfile {k}, one step of {a.micro} micro-steps: top by own time (ms/micro-step, calls/micro-step)")
        for name, (calls, tt, ct) in top:
            log(f"  {tt * 1e3 / a.micro:7.3f} {calls / a.micro:7.1f}  {name[:100]}")
    if len(kinds) >= 2:
        x, y = kinds[1], kinds[0]
        diff = {n: (stats[x].get(n, (0, 0, 0))[1] - stats[y].get(n, (0, 0, 0))[1],
                    stats[x].get(n, (0, 0, 0))[0] - stats[y].get(n, (0, 0, 0))[0]) for n in set(stats[x]) | set(stats[y])}
        log(f"\n== own time {x} - {y} (ms/micro-step, calls/micro-step): largest")
        for name, (dt, dc) in sorted(diff.items(), key=lambda kv: -kv[1][0])[:15]:
            log(f"  {dt * 1e3 / a.micro:+7.3f} {dc / a.micro:+7.1f}  {name[:100]}")
        interesting = ('_pre_forward', '_post_forward', '_pre_backward', 'unshard', 'reshard', 'wait_for_unshard',
                       'all_gather_input', 'cast_param', 'all_gather', 'reduce_scatter', '_on_grad', 'grad_buffer',
                       '_launch_ready_buckets', '_wait_in_flight', 'register_multi_grad_hook', 'post_backward')
        log("calls per micro-step (" + ' / '.join(kinds) + "): " + ', '.join(
            f"{fn} " + '/'.join(f"{sum(v[0] for n, v in stats[k].items() if n.endswith(f'({fn})')) / a.micro:g}"
                                for k in kinds) for fn in interesting))


if __name__ == '__main__':
    main()

"""
Rank 0 of a big job, alone on one machine: what one rank of 64 or 1024 holds, without renting them.

    python bench.py scale --world 64 --set n_layer=4 --set n_embd=256
    python bench.py scale --world 1024 --kinds zero3,fsdp2 --set n_layer=48 --set n_head=25 --set n_embd=1600 --set batch_size=1
    python bench.py scale --world 8 --config config/gpt2_124m.py --set batch_size=1   # on a GPU (the config's device)
    python bench.py scale --world 1024 --kinds zero3 --quick --set n_layer=80 --set n_head=64 --set n_embd=8192 --set block_size=16 --set batch_size=1 --set activation_checkpointing=True --set prefetch=0   # 70B: 12 min here

The process joins torch's "fake" process group as rank 0 of --world ranks ([Note: the fake process group] in
zero.py): every collective returns at once, so memory and compute are rank 0's own and real, the losses are
not. Torch DDP cannot run under it, so the kinds are zero1, zero2, zero3 (train.py's build: stages 1-3 start
on the meta device and materialize one bucket or unit at a time) and fsdp2 (torch's fully_shard, built the
same way). Each kind runs in a fresh subprocess, so one kind's peak cannot hide in another's. The config is
train.py's (config/shakespeare_cpu.py unless --config; --set KEY=VALUE overrides a key); its
gradient_accumulation_steps is raised to a multiple of --world, one micro-step per rank at least.

With --link (comm.py, [Note: simulated link]) every collective of ours also takes the time a ring of --world
ranks would take on that link, asynchronously; each timed step (compute alone) then runs again with each link,
and a second table gives the step time, the communication exposed, and tokens/s and MFU projected for the whole
job. --speedup (CPU) projects onto compute that much faster than this CPU's:

    python bench.py scale --world 64 --link ib400 --kinds zero2,zero3 --set n_layer=4 --set n_embd=256
    python bench.py scale --world 64 --link ib400 --link eth100 --speedup h100 --kinds zero3 --set prefetch=2
"""
import argparse
import json
import os
import re
import subprocess
import sys
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import bench_zero
import comm
import fsdp_lite
import memory
import model as model_py
import train
from model import GPT, GPTConfig

KINDS = ('zero1', 'zero2', 'zero3', 'fsdp2')
MB = 1e6  # as memory.py's startup table

# -----------------------------------------------------------------------------
# memory, as the operating system or the CUDA allocator sees it


def proc_status_bytes(field):
    """VmRSS (resident now) or VmHWM (its high-water mark) of this process, from /proc/self/status (Linux)."""
    return int(re.search(rf'{field}:\s+(\d+) kB', open('/proc/self/status').read()).group(1)) * 1024


def peak_bytes(device):
    return torch.cuda.max_memory_allocated(device) if device.type == 'cuda' else proc_status_bytes('VmHWM')


def reset_peak(device):
    """From here on, peak_bytes is the peak since now. On Linux writing 5 to clear_refs sets VmHWM to the
    current RSS (and ru_maxrss with it: getrusage reads the same high-water mark)."""
    if device.type == 'cuda':
        torch.cuda.reset_peak_memory_stats(device)
    else:
        with open('/proc/self/clear_refs', 'w') as f:
            f.write('5')

# -----------------------------------------------------------------------------
# one kind, in its own process


def build_fsdp2(cfg, device, args, world_size):
    """torch FSDP2 as fsdp_lite: each block, then the root; built on the meta device, then only this rank's
    shards are allocated (to_empty) and filled (the values do not matter under the fake process group)."""
    zcfg = train.zero_config(cfg)
    with torch.device('meta'):
        model = GPT(GPTConfig(**args), seed=cfg['seed'])
    bench_zero.shard_fsdp2(model, device, world_size, cfg)  # units and reshard_after_forward as ours
    if cfg['activation_checkpointing']:
        fsdp_lite.checkpoint_activations(model.transformer.h)
    model.to_empty(device=device)
    with torch.no_grad():
        for name, p in model.named_parameters():
            model.init_param(name, p.to_local())  # this rank's rows, drawn as if they were the whole param
    optimizer = torch.optim.AdamW(model.param_groups(zcfg.weight_decay), lr=cfg['learning_rate'],
                                  betas=(zcfg.beta1, zcfg.beta2), eps=zcfg.eps)
    engine = bench_zero.TorchEngine(model, model, optimizer, zcfg.grad_clip)  # zero_grad(set_to_none) each step
    if cfg['compile']:  # per unit, as our stages (before, zero3 ran compiled beside an eager fsdp2)
        train.compile_model(model, engine)
    return model, engine


def states_after_step(engine):
    """Model-state bytes alive between steps, counted from tensors: both free their grads after the step."""
    if bench_zero.ours(engine):
        pops = {k: b for k, (_, b) in memory.counted_states(engine).items() if k != 'grads'}
        return sum(pops.values()) + sum(memory.nbytes(b.grad_shard) for b in engine.buckets) + memory.nbytes(engine.flat_grad)
    pops = engine.populations()  # bench_zero.TorchEngine: torch's tensors
    return pops['params'] + pops['optimizer state'] + sum(bench_zero.nbytes(p.grad) for p in engine.params if p.grad is not None)


def measure(kind, cfg, world_size, quick, build_only=False, link_specs=(), speedup=None):
    """Build one kind as rank 0 of world_size, warm up 2 steps and time 3 (quick: 1 and 1); return what was measured.
    link_specs: simulated links (comm.parse_link) each timed step also runs with, after running without."""
    device = torch.device(cfg['device'])
    if device.type == 'cuda':  # the GPU named, as train.py run alone takes it (cuda:1 is cuda:1; cuda is cuda:0)
        device = torch.device('cuda', device.index or 0)
        torch.cuda.set_device(device)
    dist.init_process_group('fake', rank=0, world_size=world_size, store=FakeStore())
    train.prepare_data(cfg, 0, device)
    data = train.load_split(train.data_dir(cfg), 'train')
    args = train.model_args(cfg, train.vocab_size(cfg))
    sync = torch.cuda.synchronize if device.type == 'cuda' else (lambda: None)
    runtime = torch.cuda.memory_allocated(device) if device.type == 'cuda' else None  # CPU: between steps, below
    t_build = time.perf_counter()  # build time: from model construction to the first step (initial values included)
    model, engine = build_fsdp2(cfg, device, args, world_size) if kind == 'fsdp2' else train.build(cfg, device, args)
    sync()
    build_s = time.perf_counter() - t_build
    zcfg = train.zero_config(cfg)  # fsdp2 runs with zero_stage=3: it holds what our stage 3 holds, 16Ψ/N
    estimate = memory.model_states(zcfg.stage, engine.psi, world_size, zcfg)
    act = memory.activations(cfg['n_layer'], cfg['n_embd'], args['vocab_size'], cfg['batch_size'] * cfg['block_size'],
                             zcfg.param_dtype.itemsize, cfg['activation_checkpointing'])
    peak_estimate = sum(b for _, b in estimate.values()) + memory.transient_bytes(
        zcfg.stage, zcfg, *memory.unit_sizes(model, model.transformer.h), engine.psi, world_size, act)
    autocast = nullcontext() if cfg['dtype'] == 'float32' else torch.autocast(device.type, getattr(torch, cfg['dtype']))

    # warm-up: optimizer state allocated (FSDP2's lazily), stage 3's forward order recorded; our transient
    # buffers metered (bucket grad buffers, unsharded units), the hooks removed before timing
    transient = [0]
    handles = bench_zero.meter_transient(engine, transient) if bench_zero.ours(engine) else []
    warmup = 0 if build_only else 1 if quick else 2  # one is enough to allocate everything and record stage 3's order
    for it in range(warmup):
        train.train_step(engine, train.train_batches(data, it, cfg, 0, world_size, device), cfg['learning_rate'], autocast)
    for h in handles:
        h.remove()
    sync()
    build_peak = peak_bytes(device)
    if runtime is None:  # CPU: the RSS no tensor of ours explains, once a step has loaded the kernels and threads
        runtime = proc_status_bytes('VmRSS') - states_after_step(engine)
    reset_peak(device)
    times = []
    links = [comm.parse_link(spec, link_clock(device, speedup)) for spec in link_specs] if bench_zero.ours(engine) else []
    runs = {link.name: [] for link in links}  # link -> (step, compute alone, blocked, busy) per timed step
    for it in range(warmup, warmup + (0 if build_only else 1 if quick else 3)):
        batches = train.train_batches(data, it, cfg, 0, world_size, device)
        t0, starts = time.perf_counter(), [link.clock.now() for link in links]
        train.train_step(engine, batches, cfg['learning_rate'], autocast)
        sync()
        times.append(time.perf_counter() - t0)
        alone = [link.clock.now() - start for link, start in zip(links, starts)]  # this step on each link's clock
        for link, seconds in zip(links, alone):  # the same batches again, with the link
            step, blocked, busy = timed_with_link(engine, link, batches, cfg, autocast, sync)
            runs[link.name].append((step, seconds, blocked, busy))
    steps_peak = peak_bytes(device)
    pops = bench_zero.model_state_bytes(engine)
    dist.destroy_process_group()
    return dict(kind=kind, psi=engine.psi, estimate=sum(b for _, b in estimate.values()), populations=pops,
                pads=engine.flat_numel - engine.psi if bench_zero.ours(engine) else None,
                transient=transient[0] if handles else None, after_step=states_after_step(engine),
                runtime=runtime, steps_peak=steps_peak, process_peak=max(build_peak, steps_peak),
                step_ms=1e3 * sorted(times)[len(times) // 2] if times else None, build_s=build_s,
                peak_estimate=peak_estimate, threads=torch.get_num_threads(),
                links=link_results(runs, links), flops_per_token=model.flops_per_token(),
                peak_flops=job_peak_flops(device, cfg, speedup) if links else None)

# -----------------------------------------------------------------------------
# a simulated link (comm.py): the same step with and without it


def link_clock(device, speedup):
    """Real time (a wait sleeps), or with --speedup a virtual clock: compute time / speedup, waits not slept."""
    if speedup is None:
        return comm.Clock()
    if device.type == 'cuda':
        raise ValueError("--speedup projects a CPU's compute onto a faster device's: on a GPU, leave it out")
    return comm.VirtualClock(speedup)


def timed_with_link(engine, link, batches, cfg, autocast, sync):
    """(step, blocked in waits, link busy) in seconds, on the link's clock (so --speedup scales it as it scales
    compute alone: the step before, without the link, read on the same clock)."""
    if engine.comm.device.type == 'cuda':  # the link's spin clock is timed once (~25 ms of spinning): before t0
        link.cuda_stream(engine.comm.device)
    engine.comm.use_link(link)
    link.reset()
    sync()
    t0 = link.clock.now()
    train.train_step(engine, batches, cfg['learning_rate'], autocast)
    sync()
    engine.comm.use_link(None)
    return link.clock.now() - t0, sum(link.blocked.values()), sum(link.busy.values())


def link_results(runs, links):
    """Per link: the medians of each column over the timed steps, and the link's figures."""
    def median(xs):
        return sorted(xs)[len(xs) // 2]
    return [dict(name=link.name, bandwidth=link.bandwidth, latency=link.latency,
                 **{key: median([r[i] for r in runs[link.name]]) for i, key in enumerate(('step', 'alone', 'blocked', 'busy'))})
            for link in links]


def matmul_flops(device, dtype, n=2048):
    """This device's measured matmul FLOP/s (the best of 5 n x n products): a CPU's peak, for MFU."""
    a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    sync = torch.cuda.synchronize if device.type == 'cuda' else (lambda: None)  # a CUDA matmul returns once queued
    best = float('inf')
    for _ in range(5):
        sync()
        t0 = time.perf_counter()
        a @ b
        sync()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


H100_FLOPS = 989e12  # dense bf16, NVIDIA's H100 SXM datasheet (model.peak_flops)


def job_peak_flops(device, cfg, speedup):
    """The peak MFU is measured against: a known GPU's datasheet bf16 peak; on a CPU this CPU's matmul FLOP/s, timed
    in this kind's process, times --speedup. So the MFU is the fraction of this CPU's own matmul speed the step
    reached, whatever the speedup; with --speedup h100 the peak is about the H100's 989 TFLOP/s (the factor was timed
    in the parent process, the peak here: a few percent apart on a busy machine; the table's line prints the peak)."""
    if device.type == 'cuda':
        return model_py.peak_flops(device) or matmul_flops(device, getattr(torch, cfg['dtype']))
    return matmul_flops(device, getattr(torch, cfg['dtype'])) * (speedup or 1.0)


def parse_speedup(spec, dtype=torch.float32):
    """--speedup: a number, or 'h100': the H100's bf16 peak over this CPU's matmul FLOP/s in the job's dtype (the
    one the job computes in: a CPU's bf16 or fp16 matmul can be far from its fp32 one)."""
    if spec is None:
        return None
    if spec == 'h100':
        return H100_FLOPS / matmul_flops(torch.device('cpu'), dtype)
    try:
        value = float(spec)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise ValueError(f"--speedup {spec!r}: give a number > 0 (compute that many times faster) or h100")
    return value

# -----------------------------------------------------------------------------
# the table, from one subprocess per kind


def scale_config(args):
    if args.world < 1:  # before, -4 printed four tracebacks and a table of kinds that "did not run", and exit code 0
        raise ValueError(f"--world {args.world}: give the number of ranks to be rank 0 of, at least 1")
    cfg = train.parse_config([args.config] + [f'--{kv}' for kv in args.set])
    micro = max(1, cfg['gradient_accumulation_steps'] // args.world)  # micro-steps per rank
    cfg['gradient_accumulation_steps'] = micro * args.world
    train.check_config(cfg, args.world)
    return cfg


def run_kind(kind, args):
    """One kind in a fresh process. MALLOC_MMAP_THRESHOLD_: glibc then serves every buffer over 64 KiB with
    its own mmap and unmaps it when freed, so the RSS falls when tensors die and its peak is a real peak. Each of
    those fresh mmaps is faulted in again at every step, at 2 MB a fault where kernels.py turned on torch's huge
    pages ([Note: huge pages on CPU]; 4 GB allocated and filled: 0.27-0.31 s with them, 1.1-3.8 s without).
    [Note: malloc for timing] Not with --link: even so, the threshold made a zero2 step here 554 ms instead of 440
    (world 2, 1 thread, quiet machine). With --link the time is what counts, so the kinds run with the allocators
    as train.py and bench.py zero have them (the RSS peaks then include freed heap: run without --link for those)."""
    cmd = [sys.executable, os.path.abspath(__file__), kind, f'--world={args.world}', f'--config={args.config}']
    cmd += [f'--set={kv}' for kv in args.set] + (['--quick'] if args.quick else []) + (['--build_only'] if args.build_only else [])
    cmd += [f'--link={spec}' for spec in args.link] + ([f'--speedup={args.speedup}'] if args.speedup else [])
    env = dict(os.environ) if args.link else {**os.environ, 'MALLOC_MMAP_THRESHOLD_': '65536'}
    out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env)
    results = [line[len('RESULT '):] for line in out.stdout.splitlines() if line.startswith('RESULT ')]
    if out.returncode != 0 or not results:
        killed = ' (killed: out of memory?)' if out.returncode in (-9, 137) else ''
        return dict(kind=kind, failed=f"exit code {out.returncode}{killed}")
    return json.loads(results[-1])


NOTES = """\
- model states: params + grads + optimizer state of rank 0, MB = 1e6 bytes. estimated: memory.model_states (the
  estimator, Ψ/N per sharded population; fsdp2 with stage 3's: it holds the same 16Ψ/N). measured: counted from
  tensors, ours by memory.counted_states(engine) (grads: the bytes they take during a step), fsdp2 from the DTensor local
  shards of params, of grads right after backward, and of the optimizer state. B/param: measured / Ψ.
- after step: the same, counted from live tensors between steps (both free their grads after a step).
- peak during steps: after 2 warm-up steps (--quick: 1), the high-water mark over the timed steps; on CPU of the process's
  RSS (VmHWM after writing 5 to /proc/self/clear_refs; MALLOC_MMAP_THRESHOLD_=65536, so freed buffers leave the
  RSS), on CUDA torch.cuda.max_memory_allocated. process: the same from the start (model building included).
  runtime: what the peaks hold beside our tensors. On CPU: the RSS between the warm-up and the timed
  steps less the tensors alive then (after step): torch's code and threads, the data, the allocator's small-block
  heap; measured before the model is built it is ~60 MB smaller (kernels' code, thread pools, autograd's threads
  come with the first step). On CUDA: memory allocated before the model is built.
- our transient peak: stage 2/3 bucket grad buffers + stage 3 unsharded units live at once, sampled during warm-up at
  every grad and every unit's forward (a moment between two samples is missed: the root's grad buffer while the root
  is still unsharded). Not counted: autograd's .grad before it is copied into a bucket. pads: elements of padding in
  the flat layout, the whole of measured/estimated - 1 for ours (fsdp2 pads each param's dim 0 to a multiple of N).
- peak estimated: memory.transient_bytes ([Note: the peak]) on top of the model states: states + the buffers and
  activations alive at the worst of four moments of a micro-step (memory.activations, with activation_checkpointing as
  configured). It counts tensors only, so it is compared with the peak during steps less the runtime. Left out: a
  block's backward temporaries beyond ~8 values per token and channel, allocator slack, RSS pages of freed small
  blocks; measured with the profiler's CPU memory events on GPT-2 1.5B (rank 0 of 64): 1,823 MB allocated at the peak
  (the last block's grad buffer, its grads, 2 blocks and the root gathered, the pending embedding grad) vs 1,824 estimated.
- build: wall time from the model's construction (on the meta device) to the first step: initial values drawn,
  shards and optimizer state allocated (fsdp2: its to_empty and our init_param on its local shards).
- step: median wall time of the timed steps; collectives cost nothing here (fake process group)."""


LINK_NOTES = """\
- with a link: every timed step (compute alone) run again with each link (comm.py [Note: simulated link]: each
  collective takes a ring's time, (N-1)/N * bytes / bandwidth + (N-1) * latency, all-reduce twice, one after
  another on one link, asynchronously; or each collective its own: [Note: one link per collective]). exposed: on
  CPU the time blocked in waits, on CUDA step - compute alone; comm alone: the link's time for all the step's
  collectives, back to back. tokens/s: of the whole job (N ranks x their tokens per step / step). MFU: (6Ψ +
  attention) FLOPs per token, against the peak printed. fsdp2: torch's collectives, not comm.Comm's, so no link.
  Medians over the timed steps. With --link the kinds run with the allocators' defaults ([Note: malloc for timing]):
  the RSS peaks above then include freed heap."""


def print_link_table(args, cfg, done):
    ours = [r for r in done if r.get('links')]
    if not ours:
        return
    tokens = cfg['gradient_accumulation_steps'] * cfg['batch_size'] * cfg['block_size']  # the whole job's, per step
    peak = ours[0]['peak_flops']
    where = ('this CPU\'s measured matmul FLOP/s' + (f" x speedup {args.speedup}" if args.speedup else '')
             if cfg['device'] == 'cpu' else 'the GPU\'s datasheet bf16 peak')
    clock = (f"compute on a virtual clock, {args.speedup}x faster than this CPU (waits not slept)" if args.speedup
             else "real time (a wait sleeps)")
    print(f"\nsimulated link, {args.world} ranks; {clock}; MFU against {peak / 1e12:.3g} TFLOP/s per rank ({where})")
    print("\n| kind | link | step ms | compute alone ms | exposed comm ms (of step) | comm alone ms | hidden "
          "| job tokens/s | MFU |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in ours:
        for x in r['links']:
            exposed = x['blocked'] if cfg['device'] == 'cpu' else max(0.0, x['step'] - x['alone'])
            tps = tokens / x['step']
            mfu = r['flops_per_token'] * tps / args.world / peak
            hidden = f"{1 - exposed / x['busy']:.0%}" if x['busy'] > 0 else '–'
            print(f"| {r['kind']} | {x['name']} | {x['step'] * 1e3:.1f} | {x['alone'] * 1e3:.1f} | "
                  f"{exposed * 1e3:.1f} ({exposed / x['step']:.0%}) | {x['busy'] * 1e3:.1f} | {hidden} | "
                  f"{tps:,.0f} | {mfu:.1%} |")


def bench_scale(args):
    t_start = time.perf_counter()
    cfg = scale_config(args)
    if args.speedup and not args.link:  # it sets the clock a link's step is timed on: without one, nothing reads it
        raise ValueError("--speedup needs --link: it projects the step time on a simulated link, e.g. --link ib400")
    if args.speedup and cfg['device'].startswith('cuda'):  # here, not in each kind's process after its build
        raise ValueError("--speedup projects a CPU's compute onto a faster device's: on a GPU, leave it out")
    if args.speedup == 'h100':  # measured once, here, so every kind uses the same factor
        args.speedup = f"{parse_speedup('h100', getattr(torch, cfg['dtype'])):.4g}"
    parse_speedup(args.speedup)
    for spec in args.link:
        comm.parse_link(spec)  # a bad --link fails here, in one line
    if len(set(args.link)) < len(args.link):  # (one row a link: two of one name pooled their steps)
        raise ValueError(f"--link {' --link '.join(args.link)}: a link is named twice; give each once")
    kinds = args.kinds.split(',')
    if set(kinds) - set(KINDS) - set(bench_zero.KINDS):
        raise ValueError(f"unknown kinds {sorted(set(kinds) - set(KINDS) - set(bench_zero.KINDS))}: choose from {','.join(KINDS)}")
    skipped = [k for k in kinds if k not in KINDS]  # the DDP kinds: DDP's comm hook fails under the fake group
    kinds = [k for k in kinds if k in KINDS]
    results = [run_kind(kind, args) for kind in kinds]
    print(f"$ python bench.py scale {' '.join(sys.argv[2:])}\n")
    done = [r for r in results if 'failed' not in r]
    psi = done[0]['psi'] if done else 0
    print(f"rank 0 of {args.world} (torch's fake process group), device {cfg['device']}, dtype {cfg['dtype']}, "
          f"torch {torch.__version__}, {done[0]['threads'] if done else '?'} threads; Ψ = {psi:,} params ({cfg['n_layer']} "
          f"layers x {cfg['n_embd']}); {cfg['gradient_accumulation_steps'] // args.world} micro-step x {cfg['batch_size']}"
          f" x {cfg['block_size']} tokens per rank" + (f"; skipped {', '.join(skipped)}: torch DDP cannot run under the "
                                                       f"fake process group" if skipped else ''))
    print("\n| kind | model states MB: estimated | measured | measured/estimated | B/param | after step MB "
          "| peak MB during steps | process peak MB | runtime MB | peak MB: estimated | (peak - runtime)/estimated "
          "| build s | step ms |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        if 'failed' in r:
            print(f"| {r['kind']} | did not run: {r['failed']} |" + " |" * 11)
            continue
        measured = sum(r['populations'].values())
        if r['step_ms'] is None:  # --build_only: no step, so no peak during steps
            r['steps_peak'], r['step_ms'] = float('nan'), float('nan')
        print(f"| {r['kind']} | {r['estimate'] / MB:.2f} | {measured / MB:.2f} | {measured / r['estimate']:.4f} | "
              f"{measured / r['psi']:.3f} | {r['after_step'] / MB:.2f} | {r['steps_peak'] / MB:.0f} | "
              f"{r['process_peak'] / MB:.0f} | {r['runtime'] / MB:.0f} | {r['peak_estimate'] / MB:.0f} | "
              f"{(r['steps_peak'] - r['runtime']) / r['peak_estimate']:.3f} | {r['build_s']:.1f} | {r['step_ms']:.0f} |")
    print("\nrank 0, MB: measured model states by population; our transient peak; pads")
    for r in done:
        line = ', '.join(f"{name} {b / MB:.2f}" for name, b in r['populations'].items())
        if r['transient'] is not None:
            line += f"; transient peak {r['transient'] / MB:.2f}; pads {r['pads']:,} elements ({r['pads'] / r['psi']:.3%} of Ψ)"
        print(f"  {r['kind']:<6} {line}")
    if args.link:
        print_link_table(args, cfg, done)
    print(f"\n{NOTES}" + (f"\n{LINK_NOTES}" if args.link else '') + f"\n\nwall time {time.perf_counter() - t_start:.0f} s")


def add_arguments(parser):
    parser.add_argument('--world', type=int, default=64, help="scale: the number of ranks rank 0 is one of")
    parser.add_argument('--build_only', action='store_true', help="scale: build and count, take no step (the peak columns "
                        "print nan): a model whose CPU step takes hours")
    parser.add_argument('--quick', action='store_true', help="scale: one warm-up step and one timed, not 2 and 3 (tests, models whose step takes minutes)")
    parser.add_argument('--link', action='append', default=[], help="scale: a simulated link each collective takes "
                        f"the time of: {', '.join(comm.LINKS)} or BANDWIDTH_GBps[,LATENCY_us] (repeatable)")
    parser.add_argument('--speedup', default=None, help="scale, with --link, CPU: compute as if X times faster "
                        "(a virtual clock; waits are not slept); h100: the H100's bf16 peak / this CPU's matmul FLOP/s")


if __name__ == '__main__':  # one kind, run by run_kind in a fresh process: prints one RESULT line
    parser = argparse.ArgumentParser()
    parser.add_argument('kind', choices=KINDS)
    parser.add_argument('--config', required=True)
    parser.add_argument('--set', action='append', default=[])
    add_arguments(parser)
    child = parser.parse_args()
    cfg = scale_config(child)
    cfg['zero_stage'] = 3 if child.kind == 'fsdp2' else int(child.kind[-1])  # fsdp2: for the dtypes and the estimate
    print('RESULT ' + json.dumps(measure(child.kind, cfg, child.world, child.quick, child.build_only, child.link,
                                         parse_speedup(child.speedup))), flush=True)

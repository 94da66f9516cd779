"""
Training-step benchmark: nanozero's ZeRO-1/2/3 against torch's DDP, DDP + ZeroRedundancyOptimizer and FSDP2,
same model, seed and batches, in one run (2 gloo ranks on CPU, config/shakespeare_cpu.py by default):

    torchrun --standalone --nproc_per_node=2 bench.py zero
    torchrun --standalone --nproc_per_node=2 bench.py zero --rounds=10 --kinds=ddp,zero2,zero3,fsdp2
    torchrun --standalone --nproc_per_node=2 bench.py zero --config=config/shakespeare_cpu.py --set n_layer=8
    torchrun --standalone --nproc_per_node=2 bench.py zero --kinds=zero2,zero3,zero3:blocks_per_unit=2

A kind of ours (ddp, zero1-3) may carry settings of its own after a colon (kind:key=value:key=value, from
SETTINGS: how the engine is built): the same kind under two settings takes turns like any two kinds. At world 1,
zero1-3 may also take `through_backend`: their collectives then go through gloo or NCCL instead of comm's copies
([Note: one rank]), e.g. --kinds=ddp,zero2,zero2:through_backend on one GPU.

Per kind: the median step time (what train.py's loop does per iteration at a fixed lr: train.train_batches, this
rank's gradient_accumulation_steps / world micro-batches, then train.train_step; the slowest rank; ours and DDP built
and, with --set compile=True, compiled by train.build) and its ratio to the torch
baselines; the model-state bytes a rank holds, counted from tensors, and the peak of our transient bucket-sized
buffers; for our stages, the communication time the step is blocked on ("exposed") against the same collectives
issued alone without compute, hence the fraction of communication hidden behind compute. Kinds take turns,
rotating each round, so a shared machine that slows down for a while slows all alike. Exposed time is time the
host is blocked: meaningful with gloo on CPU (on CUDA, wait() only orders streams, so it prints '–'; use the
profiler there). On GPUs, one per rank, NCCL, bf16 compute, GPT-2 124M (its config's defaults: cuda, bfloat16):

    torchrun --standalone --nproc_per_node=8 bench.py zero --config=config/gpt2_124m.py --rounds=5
"""
import argparse
import resource
import sys
import time
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

import comm
import launch
import memory
import train
import zero
from model import GPT, GPTConfig

KINDS = ('ddp', 'ddp+zero_redundancy', 'zero1', 'zero2', 'zero3', 'fsdp2')
REFERENCES = {'zero1': ('ddp+zero_redundancy',), 'zero2': ('ddp+zero_redundancy',), 'zero3': ('fsdp2', 'zero2')}
MB = 1e6  # as train.py's startup table and bench.py scale (this bench once printed MiB as MB: 4.9% above)
QUARTILES = torch.tensor([0.25, 0.5, 0.75], device='cpu')  # p25, median, p75 of fp32 timings


def nbytes(t):
    t = t.to_local() if isinstance(t, DTensor) else t  # FSDP2: this rank's shard only
    return t.numel() * t.element_size()


def ours(engine):
    return hasattr(engine, 'buckets')  # zero.py's stages 1-3, not DataParallel, not torch's

# -----------------------------------------------------------------------------
# torch's engines, behind zero.DataParallel's interface


class TorchEngine:
    """module, set_grad_sync, backward, step(lr) -> grad norm, over a torch-wrapped module and optimizer.
    Records the grads' bytes right after backward, before step frees them."""

    def __init__(self, module, model, optimizer, grad_clip):
        self.module, self.optimizer, self.grad_clip = module, optimizer, grad_clip
        self.params = [p for p in model.parameters() if p.requires_grad]  # DTensors after fully_shard
        self.psi = sum(p.numel() for p in self.params)  # a DTensor's numel is the full tensor's
        self.grad_bytes = 0

    def set_grad_sync(self, sync):
        if isinstance(self.module, DDP):
            self.module.require_backward_grad_sync = sync  # FSDP2 reduce-scatters every micro-step

    def backward(self, loss):
        loss.backward()
        self.grad_bytes = sum(nbytes(p.grad) for p in self.params if p.grad is not None)

    def step(self, lr):
        norm = torch.nn.utils.clip_grad_norm_(self.params, self.grad_clip or float('inf'))
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        for group in self.optimizer.param_groups:  # ZeroRedundancyOptimizer copies these to its local optimizer
            group['lr'] = lr
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return norm.item()

    def populations(self):
        local = getattr(self.optimizer, 'optim', self.optimizer)  # ZeroRedundancyOptimizer: this rank's share
        state = sum(nbytes(t) for s in local.state.values() for t in s.values() if torch.is_tensor(t))
        return {'params': sum(nbytes(p) for p in self.params), 'grads': self.grad_bytes, 'optimizer state': state}


def build(kind, cfg, device):
    """The engine of one kind: ours and DDP exactly as train.py builds them (train.build: on the meta device for
    stages 1-3, compiled as train.py compiles them); torch's from the same weights, compiled alike."""
    kind, cfg = settings_of(kind, cfg)
    args = train.model_args(cfg, train.vocab_size(cfg))
    if kind == 'ddp' or kind.startswith('zero'):
        engine = train.build({**cfg, 'zero_stage': 0 if kind == 'ddp' else int(kind[-1])}, device, args)[1]
        engine.comm.alone &= not cfg['through_backend']
        return engine
    with torch.device('cpu'):  # the same weights (meta init equals a plain GPT's), then on the run's device
        model = GPT(GPTConfig(**args), seed=cfg['seed']).to(device)
    zcfg = train.zero_config(cfg)
    adamw = dict(lr=cfg['learning_rate'], betas=(zcfg.beta1, zcfg.beta2), eps=zcfg.eps)
    if kind == 'ddp+zero_redundancy':
        from torch.distributed.optim import ZeroRedundancyOptimizer
        module = DDP(model, gradient_as_bucket_view=True)  # as zero.DataParallel: one copy of the grads
        optimizer = ZeroRedundancyOptimizer(model.param_groups(zcfg.weight_decay), torch.optim.AdamW, **adamw)
    else:
        module = shard_fsdp2(model, device, dist.get_world_size(), cfg)
        optimizer = torch.optim.AdamW(model.param_groups(zcfg.weight_decay), **adamw)  # of the DTensor params
    engine = TorchEngine(module, model, optimizer, zcfg.grad_clip)
    if cfg['compile']:  # FSDP2 per unit, as our stages 1-3; DDP + ZeroRedundancyOptimizer whole, as our stage 0
        train.compile_model(model, engine)
    return engine


def shard_fsdp2(model, device, world_size, cfg):
    """torch FSDP2 as fsdp_lite shards: units of blocks_per_unit blocks, then the root (embeddings, tied lm_head,
    ln_f), reshard_after_forward as ours (before, a --set of either changed our stage 3 and not FSDP2)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    mesh = init_device_mesh(device.type, (world_size,))  # named: left out, FSDP2 picks a GPU even on gloo
    policy = MixedPrecisionPolicy(param_dtype=train.zero_config(cfg).param_dtype, reduce_dtype=torch.float32)
    blocks, k = list(model.transformer.h), cfg['blocks_per_unit']
    for i in range(0, len(blocks), k):  # a list of modules: one unit, one all-gather
        fully_shard(blocks[i:i + k] if k > 1 else blocks[i], mesh=mesh, mp_policy=policy,
                    reshard_after_forward=cfg['reshard_after_forward'])
    return fully_shard(model, mesh=mesh, mp_policy=policy)


SETTINGS = ('blocks_per_unit', 'prefetch', 'reshard_after_forward', 'bucket_mb', 'reduce_dtype', 'compile',
            'activation_checkpointing', 'optimizer_impl')  # read where the engine is built (train.build), nowhere else


def settings_of(kind, cfg):
    """'zero3:blocks_per_unit=2' -> ('zero3', cfg with blocks_per_unit=2), checked as train.py checks --key=value.
    'zero2:through_backend': at world 1 our collectives call the backend as at any world size, where comm otherwise
    copies (comm [Note: one rank]): the two side by side time what skipping it saves (cfg['through_backend'])."""
    kind, *sets = kind.split(':')
    through = 'through_backend' in sets
    sets = [s for s in sets if s != 'through_backend']
    keys = [s.partition('=')[0] for s in sets]
    if through and kind not in ('zero1', 'zero2', 'zero3'):
        raise ValueError(f"{kind}:through_backend: only zero1-3 call the backend through comm (DDP and FSDP2 call their own)")
    if sets and (kind not in ('ddp', 'zero1', 'zero2', 'zero3') or not set(keys) <= set(SETTINGS)):
        raise ValueError(f"{kind}:{':'.join(sets)}: only ddp and zero1-3 take settings of their own, and only "
                         f"{', '.join(SETTINGS)} or through_backend (the others apply to every kind: --set)")
    return kind, {**train.parse_config([f'--{s}' for s in sets], defaults=cfg), 'through_backend': through}


def model_state_bytes(engine):
    """population -> bytes on this rank. DDP's all-reduce buckets hold the grads themselves when
    gradient_as_bucket_view=True (both DDP kinds here); without it they are a second copy, kept all run."""
    pops = ({k: b for k, (_, b) in memory.counted_states(engine).items()} if hasattr(engine, 'stage')
            else engine.populations())  # ours: (dtype, bytes) each
    if isinstance(engine.module, DDP) and not engine.module.gradient_as_bucket_view:
        sizes = engine.module._get_ddp_logging_data().get('bucket_sizes', '')  # e.g. '26214400, 3807232' bytes
        pops['ddp buckets'] = sum(int(s) for s in str(sizes).split(',') if s.strip())
    return pops

# -----------------------------------------------------------------------------
# measuring our engines from outside: zero.py and fsdp_lite.py are untouched, zero.Comm is patched here


class TimedWork:
    """A collective's work handle whose wait() adds the time it blocks to clock.exposed."""

    def __init__(self, work, clock):
        self.work, self.clock = work, clock

    def wait(self):
        t0 = time.perf_counter()
        self.work.wait()
        self.clock.exposed += time.perf_counter() - t0


class CommClock:
    """Wraps zero.Comm's collectives: `exposed` adds up the seconds the caller is blocked on them (the launch,
    the .wait() on the work handle, all of a synchronous call). When `trace` is a list, each call is recorded
    with zero tensors of its shapes (one per shape and dtype, shared), to be replayed alone."""

    def __init__(self):
        self.exposed, self.trace, self.buffers = 0.0, None, {}
        for name in ('all_gather', 'reduce_scatter', 'all_reduce_sum'):
            setattr(zero.Comm, name, self.timed(getattr(zero.Comm, name)))

    def timed(self, real):
        def call(comm, *tensors, **kwargs):
            if self.trace is not None:
                keys = [(t.shape, t.dtype, t.device) for t in tensors]
                self.trace.append((real, [self.buffers.setdefault(key, torch.zeros(key[0], dtype=key[1], device=key[2]))
                                          for key in keys]))
            t0 = time.perf_counter()
            work = real(comm, *tensors, **kwargs)
            self.exposed += time.perf_counter() - t0
            return None if work is None else TimedWork(work, self)
        return call


class Marks:
    """[Note: does the GPU wait on the host?] From construction to lag(), each forward of the module (a micro-step's
    start; as .ci/stage3_diag.py marks them) records the host's clock and a timing event on the current stream. Once
    the step is synced, lag() is how far the device ran behind the host at the last micro-step: the device's time from
    the first event to the last, less the host's. ~0: each micro-step's work reached an idle GPU, which waited on the
    host (the host's work sets the step time, and a kind's extra host work shows in full); tens of ms: the host queued
    work ahead (GPU-bound: extra host work hides). Eager GPT-2 124M on an H200 sits between the two
    (assets/gpu_h200.md, "The sixth GPU pass"); .ci/stage3_diag.py --parts C prints the lag at every micro-step."""

    def __init__(self, module, event):
        self.event, self.marks = event, []
        self.handle = module.register_forward_pre_hook(self.mark)

    def mark(self, *_):
        e = self.event(enable_timing=True)
        e.record()
        self.marks.append((time.perf_counter(), e))

    def lag(self):
        """(ms the device ran behind the host at the last micro-step, micro-steps marked); the events done (synced)."""
        self.handle.remove()
        (h0, e0), (h1, e1) = self.marks[0], self.marks[-1]
        return e0.elapsed_time(e1) - (h1 - h0) * 1e3, len(self.marks)


def transient_bytes(engine):
    """Our buffers that live only during forward/backward: stage 2/3 bucket grad buffers, stage 3 unsharded
    units (a resharded unit's storage is resized to 0), less the shards gathered units free while gathered."""
    grads = sum(nbytes(b.flat_grad) for b in engine.buckets if b.flat_grad is not None) if engine.cfg.stage >= 2 else 0
    units = engine.units if engine.cfg.stage == 3 else []
    lent = sum(nbytes(u.sharded_param) for u in units if u.lends_shard and u.sharded_param.untyped_storage().nbytes() == 0)
    return grads + sum(u.unsharded_param.untyped_storage().nbytes() for u in units) - lent


def transient_bound(engine):
    """The same from the engine's counters: peak live grad buffers x the largest bucket, and in stage 3 peak live
    block units x the largest of them + the root unit (unsharded from its first forward of a step to the step)."""
    if not ours(engine) or engine.cfg.stage == 1:
        return 0
    bound = engine.peak_grad_buffers * max(b.padded_numel for b in engine.buckets) * engine.cfg.reduce_dtype.itemsize
    if engine.cfg.stage == 3:
        blocks = [u.nbytes for u in engine.units if not u.is_root]
        bound += engine.units[0].schedule.peak_live * max(blocks) + sum(u.nbytes for u in engine.units if u.is_root)
    return bound


def meter_transient(engine, peak):
    """Hooks that keep the peak of transient_bytes(engine) in peak[0]. The engine allocates grad buffers in its
    param grad hooks and unshards units in its forward and pre-backward hooks; ours, registered later, run after
    those (after every param's grad, every unit's forward pre-hook). Remove the returned handles before timing."""
    def sample(*_):
        peak[0] = max(peak[0], transient_bytes(engine))
    handles = [p.register_post_accumulate_grad_hook(sample) for p in engine.module.parameters() if p.requires_grad]
    return handles + [u.first.register_forward_pre_hook(sample) for u in getattr(engine, 'units', [])]

# -----------------------------------------------------------------------------
# the benchmark


def bench_zero(args):
    cfg = train.parse_config([args.config] + [f'--{kv}' for kv in args.set])
    if args.rounds < 1 or args.steps < 1:  # before any build, compile and warm-up
        raise ValueError(f"--rounds={args.rounds} --steps={args.steps}: use at least 1 of each")
    # ZeroRedundancyOptimizer's module takes group.WORLD as a default argument: import it before the group starts,
    # or the default keeps the group past its end ([Note: the end of a run]). (Not `import torch.distributed.optim`:
    # in a function that binds `torch` as a local name, unbound wherever the import did not run.)
    if 'ddp+zero_redundancy' in args.kinds.split(','):
        from torch.distributed import optim  # noqa: F401
    train.check_config(cfg, launch.launched_world_size())  # before the process group: device=tpu is one line
    device, rank, world_size = launch.start_process_group(cfg['device'], cfg['backend'])
    kinds = args.kinds.split(',')
    if {k.split(':')[0] for k in kinds} - set(KINDS):
        raise ValueError(f"unknown kinds {sorted({k.split(':')[0] for k in kinds} - set(KINDS))}: choose from "
                         f"{','.join(KINDS)} (a kind may add its own settings: zero3:blocks_per_unit=2)")
    if len(set(kinds)) < len(kinds):
        raise ValueError(f"--kinds={args.kinds} names a kind twice: each kind once")
    for kind in kinds:
        settings_of(kind, cfg)  # a bad setting stops the run here, before anything is built
    train.prepare_data(cfg, rank, device)
    data = train.load_split(train.data_dir(cfg), 'train')
    drawn = [0]  # iterations drawn so far: every kind trains on the same iterations' batches

    def draw(n):
        drawn[0] += n
        return range(drawn[0] - n, drawn[0])

    def step(engine, iteration):  # what train.py's loop does per iteration: this rank's micro-batches, then the step
        return train.train_step(engine, train.train_batches(data, iteration, cfg, rank, world_size, device), lr, autocast)
    autocast = nullcontext() if cfg['dtype'] == 'float32' else torch.autocast(device.type, getattr(torch, cfg['dtype']))
    sync = torch.cuda.synchronize if device.type == 'cuda' else (lambda: None)
    lr, clock = cfg['learning_rate'], CommClock()
    engines = {kind: build(kind, cfg, device) for kind in kinds}

    # warm-up, 2 steps each: optimizer state allocated, stage 3's forward order recorded, the AdamW kernel built;
    # the transient peak is metered, the second step's collectives recorded (to replay) and counted (to print).
    # Same weights, same batches: the first step's loss and grad norm must agree across kinds.
    first, traces, sent, peaks = {}, {}, {}, {}
    warm = draw(2)
    for kind, engine in engines.items():
        peak = [0]
        handles = meter_transient(engine, peak) if ours(engine) else []
        for i, iteration in enumerate(warm):
            clock.trace = [] if i == 1 and ours(engine) else None
            if hasattr(engine, 'comm'):
                engine.comm.bytes.clear()  # ours count what they send, DataParallel's all-reduce included
            loss, norm = step(engine, iteration)
            first.setdefault(kind, (loss.item(), norm))
        for h in handles:
            h.remove()
        traces[kind], peaks[kind], clock.trace = clock.trace, peak[0], None
        sent[kind] = dict(engine.comm.bytes) if hasattr(engine, 'comm') else {}

    steps = args.rounds * args.steps
    times, exposed, alone = (torch.zeros(len(kinds), n, device='cpu') for n in (steps, steps, args.rounds))  # seconds
    for r in range(args.rounds):
        iterations = draw(args.steps)
        for k in [(r + i) % len(kinds) for i in range(len(kinds))]:  # rotate the order each round
            engine = engines[kinds[k]]
            dist.barrier()  # the ranks start each timed block together
            for s, iteration in enumerate(iterations):
                clock.exposed, t0 = 0.0, time.perf_counter()
                step(engine, iteration)
                sync()
                times[k, r * args.steps + s], exposed[k, r * args.steps + s] = time.perf_counter() - t0, clock.exposed
            dist.barrier()
            if traces[kinds[k]]:  # the same collectives alone: each issued and waited for in turn, no compute
                t0 = time.perf_counter()  # the timed steps ended with sync() and a barrier: nothing in flight
                for real, tensors in traces[kinds[k]]:
                    real(engine.comm, *tensors)
                sync()  # NCCL returns once the collective is queued
                alone[k, r] = time.perf_counter() - t0
                dist.barrier()

    lags = {}  # CUDA: one more step a kind, untimed, marked at each micro-step ([Note: does the GPU wait on the host?])
    if device.type == 'cuda':
        iteration = draw(1)[0]
        for kind, engine in engines.items():
            marks = Marks(engine.module, torch.cuda.Event)
            step(engine, iteration)
            sync()
            lags[kind] = marks.lag()

    # a step lasts as long as its slowest rank. Blocked time also counts waiting for a rank still computing:
    # the rank blocked least waited least for the other, its blocked time is closest to the comm's own
    for t, op in ((times, dist.ReduceOp.MAX), (exposed, dist.ReduceOp.MIN), (alone, dist.ReduceOp.MIN)):
        on_device = t.to(device)  # the timings live on the host; NCCL reduces only CUDA tensors
        dist.all_reduce(on_device, op=op)
        t.copy_(on_device)
    pops = {kind: model_state_bytes(engines[kind]) for kind in kinds}
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB
    mine = torch.tensor([[sum(pops[kind].values()), peaks[kind], transient_bound(engines[kind])] for kind in kinds]
                        + [[rss, 0, 0]], dtype=torch.float64, device=device)  # (kinds + 1, 3) bytes
    every = torch.empty(world_size * mine.shape[0], 3, dtype=torch.float64, device=device)
    comm.ALL_GATHER(every, mine)
    if rank == 0:
        report(args, cfg, engines, first, sent, times, exposed, alone, pops, every.cpu().view(world_size, -1, 3), lags)
    engine = None  # the engines go before the group does (FSDP2's params hold its mesh): [Note: the end of a run]
    engines.clear()
    launch.end_process_group(device, mine, every)


NOTES = """\
- step: the slowest rank's wall time. Each kind's steps are spread over the whole run. Ratios: the median (p25-p75)
  over rounds of each round's ratio; within a round the kinds run back to back, so a slow spell cancels.
- model state: params + grads + optimizer state, counted from tensors (torch kinds: grads right after backward,
  DTensor local shards, ZeroRedundancyOptimizer's local state); DDP kinds use gradient_as_bucket_view=True.
- peak transient: our stage 2/3 bucket grad buffers + stage 3 unsharded units, sampled at every allocation;
  (bound): peak count x largest + root unit. Not counted: autograd's .grad before it is copied, FSDP2's buffers.
- exposed: time blocked in zero.Comm collectives (the rank blocked least); alone: the same collectives replayed
  without compute; hidden = 1 - exposed / alone. '–': not measured (torch's collectives run inside DDP/FSDP2;
  on CUDA, exposed time is not the host's: wait() only orders streams; at world size 1 comm copies in place of a
  collective, nothing to overlap).
- the GPU behind the host (CUDA, 2+ micro-steps a rank; one more step a kind, untimed): ~0 ms, the GPU waited on
  the host, whose work then sets the step time; tens of ms, the host ran ahead (bench_zero [Note: does the GPU wait
  on the host?])."""


def references(kind):
    """The kinds a kind is compared with: its torch counterparts, and its own kind where it carries settings."""
    base = kind.split(':')[0]
    return REFERENCES.get(base, ()) + ((base,) if base != kind else ())


def paired_ratio(times, ref):
    """(p25, median, p75) over rounds of times / ref, (rounds,) each: the two kinds of a pair ran back to back in every
    round, so a slow spell of a shared machine slows both and drops out of their ratio."""
    return (times / ref).quantile(QUARTILES).tolist()


def report(args, cfg, engines, first, sent, times, exposed, alone, pops, every, lags):
    kinds, (world_size, K) = list(engines), (every.shape[0], len(engines))
    psi = engines[kinds[0]].psi
    p25, median, p75 = times.quantile(QUARTILES, dim=1)  # (K,) seconds each
    per_round = times.view(K, args.rounds, args.steps).median(dim=2).values  # (K, rounds)

    def ratio(kind, ref):
        low, mid, high = paired_ratio(per_round[kinds.index(kind)], per_round[kinds.index(ref)])
        return f"{mid:.2f}x ({low:.2f}-{high:.2f})"

    print(f"world size {world_size} ({dist.get_backend()}), device {cfg['device']}, dtype {cfg['dtype']}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} thread(s)/rank; Ψ = {psi:,} params "
          f"({cfg['n_layer']} layers x {cfg['n_embd']}); {cfg['gradient_accumulation_steps'] // world_size} micro-step"
          f" x {cfg['batch_size']} x {cfg['block_size']} tokens per rank; {args.rounds} rounds x {args.steps} steps")
    losses, norms = zip(*first.values())
    print(f"first step, same weights and batches in every kind: loss {losses[0]:.5f} "
          f"(spread {max(losses) - min(losses):.1e}), grad norm {norms[0]:.5f} (spread {max(norms) - min(norms):.1e})")
    print(f"\n$ torchrun --standalone --nproc_per_node={world_size} {' '.join(sys.argv)}\n")
    print("| kind | step ms: median (p25-p75) | vs ddp | vs torch counterpart | model-state MB/rank "
          "| peak transient MB (bound) | exposed comm ms (of step) | comm alone ms | hidden |")
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|")
    for k, kind in enumerate(kinds):
        step = median[k].item()
        state = every[:, k, 0] / MB
        cells = [kind, f"{step * 1e3:.0f} ({p25[k] * 1e3:.0f}-{p75[k] * 1e3:.0f})",
                 ratio(kind, 'ddp') if 'ddp' in kinds else '–',
                 ', '.join(f"{ratio(kind, ref)} {ref}" for ref in references(kind) if ref in kinds) or '–',
                 f"{state.max():.1f}" + (f" (min {state.min():.1f})" if state.max() > 1.01 * state.min() else '')]
        if ours(engines[kind]):
            e, a = exposed[k].quantile(0.5).item(), alone[k].quantile(0.5).item()
            cells += [f"{every[:, k, 1].max() / MB:.1f} ({every[:, k, 2].max() / MB:.1f})"]
            if world_size == 1:  # comm's copies in place of the collectives ([Note: one rank]): nothing to hide, and
                # nothing to replay (the trace's buffers are one per shape: a copy's out and inp are one tensor there)
                cells += [f"{e * 1e3:.1f} ({e / step:.0%})" if torch.device(cfg['device']).type == 'cpu' else '–', '–', '–']
            elif torch.device(cfg['device']).type == 'cpu':
                cells += [f"{e * 1e3:.1f} ({e / step:.0%})", f"{a * 1e3:.1f}", f"{1 - e / a:.0%}"]
            else:  # wait() on a CUDA work handle only orders streams: the host is not blocked, nothing to time
                cells += ['–', f"{a * 1e3:.1f}", '–']
        else:
            cells += ['–'] * 4
        print('| ' + ' | '.join(cells) + ' |')

    print("\nrank 0, MB: model state (bytes/Ψ); sent per step (counted by zero.Comm); transient buffers live at once")
    for kind, engine in engines.items():
        line = ', '.join(f"{name} {b / MB:.1f}" for name, b in pops[kind].items())
        line += f" = {sum(pops[kind].values()) / psi:.1f} B/param"
        if sent[kind]:
            line += '; sent ' + ', '.join(f"{name} {b / MB:.1f}" for name, b in sorted(sent[kind].items()))
        if ours(engine) and engine.cfg.stage >= 2:
            line += f"; live at peak: {engine.peak_grad_buffers} bucket grad buffers"
        if ours(engine) and engine.cfg.stage == 3:
            live, per_unit = engine.units[0].schedule.peak_live, engine.cfg.blocks_per_unit
            line += (f", {live} unsharded unit{'s' * (live != 1)} (up to {per_unit} block{'s' * (per_unit > 1)} each)"
                     " + the root")
        if lags.get(kind, (0, 0))[1] > 1:
            line += f"; the GPU {lags[kind][0]:.1f} ms behind the host at micro-step {lags[kind][1]}"
        print(f"  {kind:<20} {line}")
    rss = ', '.join(f"rank {r} {every[r, K, 0] / MB:.0f}" for r in range(world_size))
    print(f"peak RSS MB: {rss}. Every kind lives in each process: their model states (rank 0: "
          f"{every[0, :K, 0].sum() / MB:.0f} MB) + activations, allocator caches, the runtime (a check of scale).\n")
    print(NOTES)


def add_arguments(parser):
    parser.add_argument('--config', default='config/shakespeare_cpu.py', help="a train.py config file")
    parser.add_argument('--set', action='append', default=[], metavar='KEY=VALUE',
                        help="override a train.py config key, e.g. --set n_layer=8 (repeatable)")
    parser.add_argument('--kinds', default=','.join(KINDS), help="comma-separated, from " + ','.join(KINDS)
                        + "; ours may add settings: zero3:blocks_per_unit=2 (SETTINGS)")
    parser.add_argument('--rounds', type=int, default=16, help="each round times every kind, in a rotated order")
    parser.add_argument('--steps', type=int, default=1, help="timed steps per kind per round")


if __name__ == '__main__':
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    bench_zero(parser.parse_args())

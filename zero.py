"""
ZeRO, one idea in three steps, on one flat layout.

Mixed-precision Adam keeps, per parameter, 2 bytes of bf16 param + 2 of grad + 12 of fp32 master, exp_avg
and exp_avg_sq: 16 bytes, "2Ψ + 2Ψ + 12Ψ" for Ψ parameters. Plain data parallelism (stage 0) keeps all of
it on every one of N ranks. ZeRO keeps each number on exactly one rank:

    stage 1  shard the optimizer state      2Ψ + 2Ψ + 12Ψ/N     reduce-scatter grads + all-gather params = 2Ψ
    stage 2  ... and the grads              2Ψ + (2Ψ + 12Ψ)/N   the same 2Ψ, reduced during backward
    stage 3  ... and the params (fsdp_lite) 16Ψ/N               + an all-gather per block in fwd and bwd = 3Ψ*

(communication in elements per rank per step; a DDP all-reduce = reduce-scatter + all-gather = 2Ψ.
*3Ψ less the root unit, which stays gathered from its forward to the end of backward, as in FSDP2 (and through
every micro-step of a step: fsdp_lite [Note: the root stays gathered through a step]), and the last block unit,
which stays gathered into its backward: fsdp_lite [Note: the last unit stays gathered]).
`comm.Comm` counts what this code actually sends, so the training log shows those figures.
What each rank holds, and what it would hold before you rent the GPUs: memory.py (`python zero.py estimate`).

Reading order: Bucket (the flat layout), DataParallel (stage 0, the baseline), Zero1, then what Zero2 and
Zero3 add on top of it. The collectives are comm.py's, stage 3's parameter gathering is fsdp_lite.py's, how
the optimizer stores each number (fp32, remainder, 8-bit, ...) is kernels.Precision.
"""
import math
import sys
import zlib
from collections import Counter
from dataclasses import dataclass, field

import torch

import fsdp_lite
import kernels
from comm import Comm, traced  # the collectives, counted (and zero.Comm for callers that import it from here)

# -----------------------------------------------------------------------------
# The flat layout
#
# [Note: padding] A Bucket packs params into one 1-D buffer and pads it to a multiple of world_size, so
# rank r's shard is the even slice flat.view(world_size, -1)[r] and one reduce_scatter_tensor /
# all_gather_into_tensor moves the whole bucket. Example, world_size=3, params a (5 elements) and b (6),
# and (for the example only) ALIGN=1:
#     numel 11 -> padded_numel 12, shard_numel 4
#     flat  = a0 a1 a2 a3 | a4 b0 b1 b2 | b3 b4 b5 pad
#             rank 0        rank 1        rank 2
# With ALIGN=8 every shard is a multiple of 8 elements (padded_numel 24 here, shard_numel 8), so every
# shard and every slice of the optimizer state starts 16-byte aligned: the fused kernel's vector loads.
# (8-bit optimizer state aligns shards to its 256-element blocks, so no block straddles two ranks.)
# A param may straddle ranks (a, b): AdamW is elementwise, so nothing cares, except weight decay; hence
# decayed params come first in a bucket and "decays" is one boundary, decay_numel = 5 + 6 here if both
# decay. Pads get zero grads, so their master, exp_avg and exp_avg_sq stay 0 forever.
# Stages 1 and 2 cut the model into buckets of ~bucket_mb in reverse registration order (roughly the
# order backward produces grads); stage 3 uses one bucket per fsdp_lite unit. A rank's optimizer state
# is the concatenation of its shards of every bucket, at bucket.shard_offset.


ALIGN = 8  # shard sizes are multiples of 8 elements: 16 bytes of bf16, 32 of fp32


class Bucket:

    def __init__(self, params, world_size, rank, decays, align=1):
        align = max(ALIGN, align)  # 8-bit state asks for its 256-element blocks
        self.params = sorted(params, key=lambda p: not decays(p))  # stable: decayed first, order kept
        sizes = [p.numel() for p in self.params]
        self.offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        self.offset_of = {p: o for p, o in zip(self.params, self.offsets)}
        self.numel = sum(sizes)
        self.decay_numel = sum(n for p, n in zip(self.params, sizes) if decays(p))
        self.padded_numel = math.ceil(self.numel / (world_size * align)) * world_size * align
        self.shard_numel = self.padded_numel // world_size
        self.world_size, self.rank = world_size, rank
        # set by Zero: position in the bucket order, this bucket's shard in the rank's optimizer state, and
        # its flat buffer in the concatenation of all buckets (a global index for every element)
        self.index = self.shard_offset = self.flat_offset = None
        self.flat_grad = None  # (padded_numel,) in reduce_dtype while grads are being collected
        self.grad_shard = None  # (shard_numel,) fp32: this rank's reduced grads, from the first reduce-scatter to the step
        self.ready = set()  # params whose grad is in flat_grad during this backward

    def views(self, flat):
        """(param, the piece of flat that holds it, shaped like it) for every param of the bucket."""
        return [(p, flat[o:o + p.numel()].view(p.shape)) for p, o in zip(self.params, self.offsets)]

    def shard(self, flat):
        return flat.view(self.world_size, -1)[self.rank]  # (shard_numel,)

    @property
    def shard_decay_numel(self):
        """How many leading elements of this rank's shard get weight decay (see [Note: padding])."""
        return min(max(self.decay_numel - self.rank * self.shard_numel, 0), self.shard_numel)

    @property
    def shard_slice(self):
        return slice(self.shard_offset, self.shard_offset + self.shard_numel)


def default_decays(param):
    return param.dim() >= 2  # matmul and embedding weights decay; biases and norm gains do not


def fingerprint(buckets):
    """A few integers that differ if two ranks' layouts differ (crc32 is the same in every process)."""
    shapes = repr([[tuple(p.shape) for p in b.params] for b in buckets]).encode()
    return [len(buckets), sum(b.padded_numel for b in buckets), zlib.crc32(shapes)]

# -----------------------------------------------------------------------------
# Stage 0: the baseline every stage is measured against


@dataclass
class ZeroConfig:
    stage: int = 1  # 0 = torch DDP + AdamW, 1/2/3 = ZeRO
    param_dtype: torch.dtype = torch.bfloat16  # the compute params forward/backward read
    reduce_dtype: torch.dtype = torch.float32  # grads are collected and reduce-scattered in this
    bucket_mb: float = 25.0  # stage 1/2 bucket size (of reduce_dtype grads); stage 3 buckets = units
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # clip the global grad norm to this; 0 = off
    optimizer_impl: str = 'auto'  # kernels.adamw_step: 'auto' | 'reference' | 'cpu' | 'cuda'
    prefetch: int = 1  # stage 3: all-gathers kept in flight ahead of compute; 0 = off
    reshard_after_forward: bool = True  # stage 3: free each unit's params after its forward
    blocks_per_unit: int = 1  # stage 3: consecutive blocks gathered as one unit (fsdp_lite [Note: blocks per unit])
    precision: kernels.Precision = field(default_factory=kernels.Precision)  # what the optimizer stores
    seed: int = 0  # stochastic rounding's counter-based hash starts from it (a 32-bit seed)

    def __post_init__(self):
        if self.stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage={self.stage} is not a ZeRO stage: use 0 (DDP), 1, 2 or 3")
        if not self.bucket_mb > 0:
            raise ValueError(f"bucket_mb={self.bucket_mb} must be > 0 (a bucket holds at least one param)")
        if self.prefetch < 0:
            raise ValueError(f"prefetch={self.prefetch} must be >= 0 (0 turns prefetching off)")
        if self.blocks_per_unit < 1:
            raise ValueError(f"blocks_per_unit={self.blocks_per_unit} must be >= 1 (1: a unit per block, as FSDP2)")
        if self.precision.stochastic_rounding and not 0 <= self.seed < 2**32:
            raise ValueError(f"seed={self.seed}: stochastic rounding hashes a 32-bit seed, use one in [0, 2^32)")
        if self.stage == 0 and self.precision != kernels.Precision():
            raise ValueError("master_weights / state_dtype / stochastic_rounding choose what ZeRO's fused step "
                             "stores: use zero_stage=1, 2 or 3 (stage 0 is torch's AdamW on fp32 params)")
        self.precision.check(self.param_dtype)

    def warnings(self):
        """What a user should hear before training: the precision's risk, and settings this stage never reads."""
        unread = {0: ('reduce_dtype', 'optimizer_impl')}.get(self.stage, ()) + (  # (DDP has buckets of its own)
            ('prefetch', 'reshard_after_forward', 'blocks_per_unit') if self.stage < 3 else ())
        unread = [k for k in unread if getattr(self, k) != getattr(ZeroConfig, k)]
        return [w for w in [self.precision.warning()] if w] + [
            f"{', '.join(unread)} set, but zero_stage={self.stage} never reads {'them' if len(unread) > 1 else 'it'}"] * bool(unread)


class DataParallel:
    """Stage 0: torch DDP all-reduces full grads (2Ψ sent), torch AdamW steps full fp32 params on every
    rank. Params, grads, exp_avg, exp_avg_sq: 4 + 4 + 4 + 4 = 16Ψ bytes on every rank."""
    stage = 0

    def __init__(self, model, cfg, process_group=None):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.cfg, self.model, self.comm = cfg, model, Comm(process_group, self.params[0].device)
        self.psi = sum(p.numel() for p in self.params)
        # gradient_as_bucket_view: grads live in DDP's all-reduce buckets, not in a second copy (4Ψ, not 8Ψ)
        self.module = torch.nn.parallel.DistributedDataParallel(model, process_group=process_group,
                                                                gradient_as_bucket_view=True)

        def counted_allreduce(comm, bucket):
            comm.count('all_reduce', bucket.buffer(), factor=2)
            return allreduce_hook(process_group, bucket)
        self.module.register_comm_hook(self.comm, counted_allreduce)
        groups = [{'params': [p for p in self.params if default_decays(p)], 'weight_decay': cfg.weight_decay},
                  {'params': [p for p in self.params if not default_decays(p)], 'weight_decay': 0.0}]
        self.optimizer = torch.optim.AdamW(groups, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                                           fused=self.params[0].is_cuda)
        # params stay fp32 here; param_dtype is the autocast dtype, and float16 needs loss scaling
        self.scaler = torch.amp.GradScaler(self.params[0].device.type, enabled=cfg.param_dtype == torch.float16)

    def set_grad_sync(self, sync):
        self.module.require_backward_grad_sync = sync  # False: keep accumulating locally, no all-reduce

    def backward(self, loss):
        self.scaler.scale(loss).backward()

    def step(self, lr):
        self.scaler.unscale_(self.optimizer)
        clip = self.cfg.grad_clip if self.cfg.grad_clip > 0 else float('inf')
        grad_norm = torch.nn.utils.clip_grad_norm_(self.params, clip).item()
        for group in self.optimizer.param_groups:
            group['lr'] = lr
        if math.isfinite(grad_norm):  # as in ZeRO: every rank sees the same norm and skips the same step
            self.scaler.step(self.optimizer)
        self.scaler.update()  # fp16: halves the scale after an overflow
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

# -----------------------------------------------------------------------------
# Stage 1: shard the optimizer state
#
# [Note: who holds the master] Each rank keeps the exact (fp32) value of the params of its shard in one of
# four forms (kernels.Precision decides; the fused step reads and writes each form):
#     fp32 compute         the fp32 param shard is the master: one copy, not two
#     master 'fp32'        an fp32 master shard; the bf16/fp16 compute params are its rounding
#     master 'remainder'   the bf16 param shard + an int16 remainder: together exactly the fp32 value
#     master 'none'        the bf16 param shard alone: each update is rounded into it
# Stage 3 keeps no bf16 shard beside an fp32 master: each all-gather rounds the master on the way in (as
# FSDP2 does), which saves 2Ψ/N bytes for one cast of the unit's Ψ/N-element shard per gather.


class LossScaler:
    """[Note: dynamic loss scaling] fp16 has 5 exponent bits: grads below ~6e-8 flush to zero. The loss is
    multiplied by S before backward, which lifts every grad by S, and the fused step divides by S for free
    (its grad_scale). An overflow shows as a non-finite global grad norm, which every rank computes from the
    same all-reduce: the step is skipped on every rank and S halves. After 2000 clean steps S doubles.
    S = 1 and nothing happens for fp32 and bf16 (8 exponent bits, like fp32)."""

    def __init__(self, enabled, scale=2.0**16, growth_interval=2000):
        self.enabled, self.scale, self.growth_interval, self.clean_steps = enabled, scale if enabled else 1.0, growth_interval, 0

    def get_scale(self):  # torch's GradScaler's names (stage 0), so train.py logs and checkpoint.py saves either alike
        return self.scale

    def state_dict(self):
        return {'scale': self.scale, '_growth_tracker': self.clean_steps}

    def load_state_dict(self, state):
        self.scale, self.clean_steps = state['scale'], state['_growth_tracker']

    def update(self, finite):
        if self.enabled:
            self.clean_steps = self.clean_steps + 1 if finite else 0
            if not finite or self.clean_steps == self.growth_interval:
                self.scale *= 2.0 if finite else 0.5
                self.clean_steps = 0


class Zero1:
    """Every rank keeps the full compute params and a full flat_grad, and owns 1/N of the master, exp_avg
    and exp_avg_sq. Grads are reduce-scattered bucket by bucket during the last micro-step's backward;
    after the step each bucket's new params are all-gathered."""
    stage = 1

    def __init__(self, model, cfg, units=(), process_group=None, device=None):
        params = [p for p in model.parameters() if p.requires_grad]  # tied params appear once
        self.names = {p: name for name, p in model.named_parameters()}
        self.device = device or params[0].device  # a model on the meta device is materialized there
        self.cfg, self.model, self.module, self.precision = cfg, model, model, cfg.precision
        self.comm = Comm(process_group, self.device)
        self.psi = sum(p.numel() for p in params)
        # 1) the layout: buckets in the order backward fills them, checked equal on every rank
        self.buckets = self.plan_buckets(model, params, units)
        self.comm.check_same('bucket layout', fingerprint(self.buckets) + [self.stage])
        self.shard_numel = self.flat_numel = 0
        for i, b in enumerate(self.buckets):
            b.index, b.shard_offset, b.flat_offset = i, self.shard_numel, self.flat_numel
            self.shard_numel, self.flat_numel = self.shard_numel + b.shard_numel, self.flat_numel + b.padded_numel
        self.bucket_of = {p: b for b in self.buckets for p in b.params}
        # 2) the sharded optimizer state: one (shard_numel,) tensor per population, a slice per bucket
        master_dtype = self.precision.master_dtype(cfg.param_dtype)
        self.master = None if master_dtype is None else torch.zeros(self.shard_numel, dtype=master_dtype, device=self.device)
        # (8-bit moments: uint8 codes, and self.absmax holds one fp32 scale per 256-element block of each)
        self.exp_avg, self.exp_avg_sq, self.absmax = self.precision.zero_moments(self.shard_numel, self.device)
        self.flat_grad = None  # stage 1's full grads: from a step's first grad to the end of its step
        self.found_inf = torch.zeros(1, device=self.device)  # the kernel's flag; step() already skips on a non-finite norm
        self.step_count = 0
        self.scaler = LossScaler(enabled=cfg.param_dtype == torch.float16)
        # 3) the compute params and the masters, from rank 0's values (like DDP) or from the model's own init
        self.init_params()
        for name, p in model.named_parameters():  # frozen params: not sharded, in the compute dtype everywhere
            if not p.requires_grad:
                value = torch.empty(p.shape, dtype=torch.float32, device=self.device)
                self.model.init_param(name, value) if p.is_meta else value.copy_(p.detach())
                self.comm.broadcast(value := value.to(cfg.param_dtype))  # as in pack()
                fsdp_lite.point_param_at(p, value)
        for p in params:
            p.register_post_accumulate_grad_hook(self._on_grad)
        self.sync = True
        self.next_bucket = 0  # buckets are reduce-scattered strictly in order: the same on every rank
        self.in_flight = []  # (bucket, work, output) of launched reduce-scatters
        self.live_grad_buffers = self.peak_grad_buffers = 0  # stages 2/3: bucket-sized grad buffers alive

    def plan_buckets(self, model, params, units):
        bucket_numel = self.cfg.bucket_mb * 2**20 // self.cfg.reduce_dtype.itemsize
        return plan_buckets(params[::-1], bucket_numel, self.comm.world_size, self.comm.rank, self.precision.align)

    def pack(self, b):
        """This rank's shard of the bucket's initial values, fp32 (shard_numel,). [Note: meta-device init] On the meta device
        model.init_param draws only this rank's elements (model.py [Note: counter-based init]). Real params: rank 0's (like DDP)."""
        if b.params[0].is_meta:
            shard, lo = torch.zeros(b.shard_numel, dtype=torch.float32, device=self.device), b.rank * b.shard_numel
            for p, o in zip(b.params, b.offsets):  # param p holds elements [o, o + numel) of the bucket
                start, end = max(lo, o), min(lo + b.shard_numel, o + p.numel())
                if start < end:
                    self.model.init_param(self.names[p], shard[start - lo:end - lo], start - o)
            return shard
        flat = torch.zeros(b.padded_numel, dtype=torch.float32, device=self.device)
        for p, view in b.views(flat):
            view.copy_(p.detach())
        self.comm.broadcast(flat)
        return b.shard(flat)

    def init_params(self):
        """Every param becomes a view into one flat_param (param_dtype), gathered from the shards as stored."""
        self.flat_param = torch.empty(self.flat_numel, dtype=self.cfg.param_dtype, device=self.device)
        for b in self.buckets:
            b.flat_param = self.flat_param[b.flat_offset:b.flat_offset + b.padded_numel]
            self.set_master(b, self.pack(b))
            self.gather_params(b).wait()  # each rank's params as their owner stores them (its precision's rounding)
            for p, view in b.views(b.flat_param):
                fsdp_lite.point_param_at(p, view)
        self.comm.numel, self.comm.bytes = Counter(), Counter()  # start-up is not counted (broadcast neither)

    def param_shard(self, b):
        return b.shard(b.flat_param)  # this rank's slice of the bucket's compute params

    def step_tensors(self, b):
        """The fused step's (master, param) for bucket b: see [Note: who holds the master]."""
        master, param = None if self.master is None else self.master[b.shard_slice], self.param_shard(b)
        if master is None and param.dtype == torch.float32:
            return param, None  # fp32 compute: the params are the masters
        return master, param

    def set_master(self, b, values):
        """Store the exact fp32 values of this rank's shard of b in the form the precision keeps."""
        kernels.store_weights(values, *self.step_tensors(b))

    def master_values(self, b):
        """The exact fp32 values of this rank's shard of b (a view where they are stored as fp32)."""
        return kernels.load_weights(*self.step_tensors(b))

    # --- grads: collected by per-param hooks, reduce-scattered bucket by bucket during backward

    def set_grad_sync(self, sync):
        """sync=False on all but the last micro-step: keep accumulating into the full flat_grad."""
        self.sync = sync

    def backward(self, loss):
        (loss * self.scaler.scale if self.scaler.enabled else loss).backward()
        self._finish_backward()

    def _on_grad(self, p):
        bucket = self.bucket_of[p]
        bucket.ready.add(p)
        self.grad_ready(bucket, p)
        if self.sync:
            self._launch_ready_buckets(flush=False)

    def grad_ready(self, b, p):
        self.grad_buffer(b)[b.offset_of[p]:][:p.numel()].add_(p.grad.view(-1))  # add: accumulates micro-steps
        p.grad = None  # the grad lives in flat_grad now

    def grad_buffer(self, b):
        if self.flat_grad is None:  # the step's first grad: a full flat_grad until the step is done
            self.flat_grad = torch.zeros(self.flat_numel, dtype=self.cfg.reduce_dtype, device=self.device)
            for bucket in self.buckets:
                bucket.flat_grad = self.flat_grad[bucket.flat_offset:bucket.flat_offset + bucket.padded_numel]
        return b.flat_grad

    def _launch_ready_buckets(self, flush):
        while self.next_bucket < len(self.buckets):
            b = self.buckets[self.next_bucket]
            if not flush and len(b.ready) < len(b.params):
                return
            # [Note: one grad buffer] waiting for the previous reduce-scatter before launching this one
            # keeps one bucket-sized grad buffer alive in stages 2/3 (the one in flight; the next bucket's
            # grads wait as p.grad, which autograd allocated anyway), while each reduce-scatter still
            # overlaps the backward of the next bucket
            self._wait_in_flight()
            out = torch.empty(b.shard_numel, dtype=self.cfg.reduce_dtype, device=self.device)
            work = self.comm.reduce_scatter(out, self.grad_buffer(b), async_op=True, name=f'reduce_scatter bucket {b.index}')
            self.in_flight.append((b, work, out))
            self.launched(b)
            self.next_bucket += 1

    def launched(self, b):
        pass

    def _wait_in_flight(self):
        for b, work, out in self.in_flight:
            with traced(f'wait reduce_scatter bucket {b.index}'):
                work.wait()
            # the bucket's fp32 grad shard starts as its first reduce-scatter's output and accumulates the next
            # micro-steps' (stages 2/3); it lives until the step, like FSDP2's sharded grads
            b.grad_shard = out.float() if b.grad_shard is None else b.grad_shard.add_(out)
            self.reduced(b)
        self.in_flight = []

    def reduced(self, b):
        pass

    def _finish_backward(self):
        """[Note: flush] A param that got no grad this step never fires its hook, and a bucket waiting for
        it would never launch on this rank while the others do: a hang. After every backward we launch
        what is left, in bucket order, with zeros for the missing grads (as DDP does)."""
        if self.sync:
            self._launch_ready_buckets(flush=True)
            self._wait_in_flight()
            self.next_bucket = 0
        for b in self.buckets:
            b.ready.clear()

    # --- the step: AdamW on this rank's master shard, then the compute params

    @torch.no_grad()
    def step(self, lr):
        cfg, scale = self.cfg, self.scaler.scale
        for b in self.buckets:
            if b.grad_shard is None:  # no backward since the last step
                b.grad_shard = torch.zeros(b.shard_numel, dtype=torch.float32, device=self.device)
        # global grad norm: shards are disjoint and pads are 0, so the sum of every rank's squares is exact
        sumsq = torch.stack([b.grad_shard.square().sum() for b in self.buckets]).sum()
        self.comm.all_reduce_sum(sumsq)
        grad_norm = sumsq.sqrt().item() / scale  # the grads hold the loss scale (1 unless fp16)
        self.scaler.update(finite=math.isfinite(grad_norm))
        if not math.isfinite(grad_norm):  # every rank sees the same norm, so every rank skips
            self.zero_grad()
            return grad_norm
        clip = min(1.0, cfg.grad_clip / (grad_norm + 1e-6)) if cfg.grad_clip > 0 else 1.0  # as clip_grad_norm_
        self.step_count += 1
        seed = cfg.seed if self.precision.stochastic_rounding else None
        gathers = []
        for b in self.buckets:
            s, (master, param) = b.shard_slice, self.step_tensors(b)
            kernels.adamw_step(master, b.grad_shard, self.exp_avg[s], self.exp_avg_sq[s], param, self.found_inf,
                               lr=lr, beta1=cfg.beta1, beta2=cfg.beta2, eps=cfg.eps, weight_decay=cfg.weight_decay,
                               decay_numel=b.shard_decay_numel, step=self.step_count, grad_scale=clip / scale,
                               absmax=self.absmax_of(b), rounding_seed=seed,
                               index_offset=b.flat_offset + self.comm.rank * b.shard_numel, impl=cfg.optimizer_impl)
            gathers.append(self.gather_params(b))  # async: the next bucket's step overlaps this gather
        for work in filter(None, gathers):  # stage 3 gathers in the next forward
            work.wait()
        self.zero_grad()
        return grad_norm

    def absmax_of(self, b):
        """8-bit state: this bucket's slice of the per-block scales (shard offsets are multiples of the block)."""
        blocks = slice(b.shard_offset // self.precision.align, (b.shard_offset + b.shard_numel) // self.precision.align)
        return None if self.absmax is None else tuple(a[blocks] for a in self.absmax)

    def gather_params(self, b):
        """Every rank needs every new param: all-gather in place (this rank's slice is the input)."""
        return self.comm.all_gather(b.flat_param, self.param_shard(b), async_op=True, name=f'all_gather bucket {b.index}')

    def zero_grad(self):
        self.flat_grad = None
        for b in self.buckets:
            b.flat_grad = b.grad_shard = None

# -----------------------------------------------------------------------------
# Stage 2: ... and shard the grads


class Zero2(Zero1):
    """No full flat_grad: a bucket's grad buffer exists only while its reduce-scatter is in flight; the
    reduced slice is added into the bucket's fp32 grad_shard. Since no full grad is kept, every
    micro-step's backward reduce-scatters (the trade: a Ψ per micro-step instead of Ψ per step)."""
    stage = 2

    def set_grad_sync(self, sync):
        self.sync = True

    def grad_ready(self, b, p):
        pass  # keep p.grad until the whole bucket is ready, then copy it into a fresh buffer

    def grad_buffer(self, b):
        # one cat writes every grad, cast to reduce_dtype, and the pads: no zero-fill pass, not a copy per param
        b.flat_grad = torch.empty(b.padded_numel, dtype=self.cfg.reduce_dtype, device=self.device)
        grads = [p.grad.reshape(-1) if p.grad is not None else p.new_zeros(p.numel()) for p in b.params]  # None: flush
        pad = [b.flat_grad.new_zeros(b.padded_numel - b.numel)] if b.padded_numel > b.numel else []
        torch.cat(grads + pad, out=b.flat_grad)
        for p in b.params:
            p.grad = None
        self.live_grad_buffers += 1
        self.peak_grad_buffers = max(self.peak_grad_buffers, self.live_grad_buffers)
        return b.flat_grad

    def reduced(self, b):
        b.flat_grad = None
        self.live_grad_buffers -= 1

# -----------------------------------------------------------------------------
# Stage 3: ... and shard the params (the mechanics are in fsdp_lite.py)


class Zero3(Zero2):
    """One bucket per fsdp_lite unit; the unit holds only its shard of the params between uses. The
    optimizer writes the sharded params (or the masters they are gathered from); the next forward
    all-gathers them, so the step gathers nothing."""
    stage = 3

    def plan_buckets(self, model, params, units):
        # one bucket per unit, in the order backward finishes them: last block first, the root last
        units = fsdp_lite.group_blocks(units, self.cfg.blocks_per_unit)
        unit_params = [(u, [p for p in u.parameters() if p.requires_grad]) for u in units]
        in_units = {p for _, ps in unit_params for p in ps}
        unit_params = unit_params[::-1] + [(model, [p for p in params if p not in in_units])]
        self.pairs = [(m, Bucket(ps, self.comm.world_size, self.comm.rank, default_decays, self.precision.align))
                      for m, ps in unit_params if ps]
        return [b for _, b in self.pairs]

    def init_params(self):
        # what each unit all-gathers from: the fp32 master (rounded to param_dtype on the way in), else a shard stored in
        # param_dtype ([Note: who holds the master]), a tensor per unit (fsdp_lite [Note: a gathered unit holds its shard once])
        keeps_shard = self.master is None or self.master.dtype != torch.float32
        self.param_shards = [torch.empty(b.shard_numel, dtype=self.cfg.param_dtype, device=self.device)
                             for b in self.buckets] if keeps_shard else None
        for b in self.buckets:
            self.set_master(b, self.pack(b))  # one unit's shard drawn at a time
        self.units = fsdp_lite.fully_shard([(m, b, self.param_shard(b) if keeps_shard else self.master[b.shard_slice])
                                            for m, b in self.pairs], self.model, self.comm, self.cfg)

    def param_shard(self, b):
        return None if self.param_shards is None else self.param_shards[b.index]

    def launched(self, b):
        self.units[b.index].post_backward()  # the unit's grads are all in its bucket: its params can go

    def _finish_backward(self):
        super()._finish_backward()
        fsdp_lite.finish_backward(self.units)

    def step(self, lr):
        # the root stays gathered through the micro-steps (fsdp_lite [Note: the root stays gathered through a step]), and
        # a forward that no backward followed leaves the last unit gathered too, a lent shard's storage freed (fsdp_lite
        # [Note: a gathered unit holds its shard once]): every shard goes back before the step writes them
        for unit in self.units:
            unit.reshard()  # after a backward: the root alone
        return super().step(lr)

    def gather_params(self, b):
        return None


def plan_buckets(params, bucket_numel, world_size, rank, align=1):
    """Greedy, in order: start a new bucket when the next param would overflow this one (a param bigger
    than bucket_numel gets a bucket to itself)."""
    buckets, current, numel = [], [], 0
    for p in params:
        if current and numel + p.numel() > bucket_numel:
            buckets.append(current)
            current, numel = [], 0
        current.append(p)
        numel += p.numel()
    if current:
        buckets.append(current)
    return [Bucket(ps, world_size, rank, default_decays, align) for ps in buckets]


def build_engine(model, cfg, units=(), process_group=None, device=None):
    """units: the submodules (e.g. the transformer blocks, in forward order) that become fsdp_lite units in stage 3,
    cfg.blocks_per_unit of them to a unit.
    device: where a model built on the meta device is materialized (stages 1-3)."""
    if cfg.stage == 0:
        return DataParallel(model, cfg, process_group)
    return (Zero1, Zero2, Zero3)[cfg.stage - 1](model, cfg, units, process_group, device)


if __name__ == '__main__':
    import estimate
    estimate.main(sys.argv[1:])

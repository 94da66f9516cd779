"""
ZeRO, one idea in three steps, on one flat layout.

Mixed-precision Adam keeps, per parameter, 2 bytes of bf16 param + 2 of grad + 12 of fp32 master, exp_avg
and exp_avg_sq: 16 bytes, "2Ψ + 2Ψ + 12Ψ" for Ψ parameters. Plain data parallelism (stage 0) keeps all of
it on every one of N ranks. ZeRO keeps each number on exactly one rank:

    stage 1  shard the optimizer state      2Ψ + 2Ψ + 12Ψ/N     reduce-scatter grads + all-gather params = 2Ψ
    stage 2  ... and the grads              2Ψ + (2Ψ + 12Ψ)/N   the same 2Ψ, reduced during backward
    stage 3  ... and the params (fsdp_lite) 16Ψ/N               + an all-gather per block in fwd and bwd = 3Ψ*

(communication in elements per rank per step; a DDP all-reduce = reduce-scatter + all-gather = 2Ψ.
*3Ψ less the root unit, which stays gathered from its forward to the end of backward, as in FSDP2).
The `Comm` object below counts what this code actually sends, so the training log shows those figures.

Reading order: Comm (the collectives), Bucket (the flat layout), DataParallel (stage 0, the baseline),
Zero1, then what Zero2 and Zero3 add on top of it. Stage 3's parameter gathering is in fsdp_lite.py.
"""
import math
import warnings
import zlib
from collections import Counter
from dataclasses import dataclass

import torch
import torch.distributed as dist

import fsdp_lite
import kernels

# torch 2.13 renames these two collectives; the old names are what torch 2.11 (our GPU machines) has
warnings.filterwarnings('ignore', message=r'`torch\.distributed\.(all_gather_into_tensor|reduce_scatter_tensor)` is deprecated')

# -----------------------------------------------------------------------------
# The collectives, counted


class Comm:
    """The three collectives ZeRO needs, on one process group, counting the elements each one moves.
    Convention of the ZeRO paper: reduce-scattering an n-element buffer, or all-gathering into one,
    moves n elements per rank; an all-reduce is both, 2n. Divided by Ψ these are the table's figures."""

    def __init__(self, process_group=None, device=torch.device('cpu')):
        self.process_group = process_group
        self.device = device  # where its own tensors go: NCCL takes only CUDA tensors
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self.numel = Counter()  # collective kind -> elements moved since the caller last cleared it
        self.bytes = Counter()

    def count(self, kind, tensor, factor=1):
        self.numel[kind] += factor * tensor.numel()
        self.bytes[kind] += factor * tensor.numel() * tensor.element_size()

    def all_gather(self, out, inp, async_op=False):
        self.count('all_gather', out)
        return dist.all_gather_into_tensor(out, inp, group=self.process_group, async_op=async_op)

    def reduce_scatter(self, out, inp, async_op=False):
        self.count('reduce_scatter', inp)
        return dist.reduce_scatter_tensor(out, inp, op=dist.ReduceOp.AVG, group=self.process_group,
                                          async_op=async_op)

    def all_reduce_sum(self, tensor):
        self.count('all_reduce', tensor, factor=2)
        dist.all_reduce(tensor, group=self.process_group)

    def broadcast(self, tensor):
        """Rank 0's values everywhere (start-up and checkpoints only, so not counted)."""
        src = 0 if self.process_group is None else dist.get_global_rank(self.process_group, 0)
        dist.broadcast(tensor, src=src, group=self.process_group)

    def check_same(self, what, values):
        """Fail fast, instead of hanging or training on garbage, if the ranks built different layouts."""
        mine = torch.tensor(values, dtype=torch.int64, device=self.device)
        every = torch.empty(self.world_size * len(values), dtype=torch.int64, device=self.device)
        dist.all_gather_into_tensor(every, mine, group=self.process_group)  # not counted: start-up only
        for r, theirs in enumerate(every.view(self.world_size, -1).tolist()):
            if theirs != values:
                raise RuntimeError(f"rank {r} has a different {what} than rank {self.rank} ({theirs} vs {values}): "
                                   "every rank must build the same model with the same config")

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
# A param may straddle ranks (a, b): AdamW is elementwise, so nothing cares, except weight decay; hence
# decayed params come first in a bucket and "decays" is one boundary, decay_numel = 5 + 6 here if both
# decay. Pads get zero grads, so their master, exp_avg and exp_avg_sq stay 0 forever.
# Stages 1 and 2 cut the model into buckets of ~bucket_mb in reverse registration order (roughly the
# order backward produces grads); stage 3 uses one bucket per fsdp_lite unit. A rank's optimizer state
# is the concatenation of its shards of every bucket, at bucket.shard_offset.


ALIGN = 8  # shard sizes are multiples of 8 elements: 16 bytes of bf16, 32 of fp32


class Bucket:

    def __init__(self, params, world_size, rank, decays):
        self.params = sorted(params, key=lambda p: not decays(p))  # stable: decayed first, order kept
        sizes = [p.numel() for p in self.params]
        self.offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        self.offset_of = {p: o for p, o in zip(self.params, self.offsets)}
        self.numel = sum(sizes)
        self.decay_numel = sum(n for p, n in zip(self.params, sizes) if decays(p))
        self.padded_numel = math.ceil(self.numel / (world_size * ALIGN)) * world_size * ALIGN
        self.shard_numel = self.padded_numel // world_size
        self.world_size, self.rank = world_size, rank
        self.shard_offset = None  # set by Zero: where this bucket's shard sits in the optimizer state
        self.flat_grad = None  # (padded_numel,) in reduce_dtype while grads are being collected
        self.ready = set()  # params whose grad is in flat_grad during this backward
        self.unit = None  # stage 3: the fsdp_lite.Unit that owns the params

    def views(self, flat):
        """(param, the piece of flat that holds it, shaped like it) for every param of the bucket."""
        return [(p, flat[o:o + p.numel()].view_as(p)) for p, o in zip(self.params, self.offsets)]

    def shard(self, flat):
        return flat.view(self.world_size, -1)[self.rank]  # (shard_numel,)

    def pack(self, dtype):
        flat = torch.zeros(self.padded_numel, dtype=dtype, device=self.params[0].device)
        for p, view in self.views(flat):
            view.copy_(p.detach())
        return flat

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
    reshard_after_forward: bool = True  # stage 3: free each block's params after its forward

    def __post_init__(self):
        if self.stage not in (0, 1, 2, 3):
            raise ValueError(f"zero_stage={self.stage} is not a ZeRO stage: use 0 (DDP), 1, 2 or 3")
        if not self.bucket_mb > 0:
            raise ValueError(f"bucket_mb={self.bucket_mb} must be > 0 (a bucket holds at least one param)")
        if self.prefetch < 0:
            raise ValueError(f"prefetch={self.prefetch} must be >= 0 (0 turns prefetching off)")


class DataParallel:
    """Stage 0: torch DDP all-reduces full grads (2Ψ sent), torch AdamW steps full fp32 params on every
    rank. Params, grads, exp_avg, exp_avg_sq: 4 + 4 + 4 + 4 = 16Ψ bytes on every rank."""

    def __init__(self, model, cfg, process_group=None):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.cfg, self.comm = cfg, Comm(process_group, self.params[0].device)
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
        self.scaler.step(self.optimizer)  # skipped if the grads hold inf/nan
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def populations(self):
        p = self.params[0]
        sizes = {'params': (p.dtype, self.psi), 'grads': (p.dtype, self.psi),
                 'exp_avg': (torch.float32, self.psi), 'exp_avg_sq': (torch.float32, self.psi)}
        return {k: (dt, n * dt.itemsize) for k, (dt, n) in sizes.items()}

    def full_state_dict(self):
        return {k: v.to('cpu', torch.float32, copy=True) for k, v in self.module.module.state_dict().items()}

    def state_dict(self):
        return {'optimizer': self.optimizer.state_dict()}

    def load_state_dict(self, state):
        self.optimizer.load_state_dict(state['optimizer'])

# -----------------------------------------------------------------------------
# Stage 1: shard the optimizer state


class Zero1:
    """Every rank keeps the full compute params and a full fp32 flat_grad, and owns 1/N of the fp32
    master, exp_avg and exp_avg_sq. Grads are reduce-scattered bucket by bucket during the last
    micro-step's backward; after the step each bucket's new params are all-gathered."""
    stage = 1

    def __init__(self, model, cfg, units=(), process_group=None):
        params = [p for p in model.parameters() if p.requires_grad]  # tied params appear once
        self.cfg, self.comm, self.model, self.module = cfg, Comm(process_group, params[0].device), model, model
        self.psi = sum(p.numel() for p in params)
        # 1) the layout: buckets in the order backward fills them, checked equal on every rank
        self.buckets = self.plan_buckets(model, params, units)
        self.comm.check_same('bucket layout', fingerprint(self.buckets) + [self.stage])
        shard_numel = 0
        for b in self.buckets:
            b.shard_offset, shard_numel = shard_numel, shard_numel + b.shard_numel
        self.bucket_of = {p: b for b in self.buckets for p in b.params}
        # 2) the sharded fp32 optimizer state: one (shard_numel,) tensor each, a slice per bucket
        device = params[0].device
        self.master_shard, self.exp_avg, self.exp_avg_sq, self.grad_shard = (
            torch.zeros(shard_numel, dtype=torch.float32, device=device) for _ in range(4))
        self.found_inf = torch.zeros(1, device=device)  # the kernel's flag; step() already skips on a non-finite norm
        self.step_count = 0
        # 3) the compute params, from rank 0's fp32 values (like DDP); the master shards from the same
        self.init_params()
        self.init_grads()
        for p in model.parameters():  # frozen params: not sharded, just in the compute dtype everywhere
            if not p.requires_grad:
                p.data = p.data.to(cfg.param_dtype)
                self.comm.broadcast(p.data)
        for p in params:
            p.register_post_accumulate_grad_hook(self._on_grad)
        self.sync = True
        self.next_bucket = 0  # buckets are reduce-scattered strictly in order: the same on every rank
        self.in_flight = []  # (bucket, work, output) of launched reduce-scatters
        self.live_grad_buffers = self.peak_grad_buffers = 0  # stages 2/3: bucket-sized grad buffers alive

    def plan_buckets(self, model, params, units):
        bucket_numel = self.cfg.bucket_mb * 2**20 // self.cfg.reduce_dtype.itemsize
        return plan_buckets(params[::-1], bucket_numel, self.comm.world_size, self.comm.rank)

    def init_params(self):
        """Every param becomes a view into one flat_param (param_dtype)."""
        self.flat_param = torch.empty(sum(b.padded_numel for b in self.buckets), dtype=self.cfg.param_dtype,
                                      device=self.master_shard.device)
        start = 0
        for b in self.buckets:
            flat32 = b.pack(torch.float32)
            self.comm.broadcast(flat32)
            self.master_shard[b.shard_slice] = b.shard(flat32)
            b.flat_param = self.flat_param[start:start + b.padded_numel]
            b.flat_param.copy_(flat32)
            for p, view in b.views(b.flat_param):
                p.data = view
            start += b.padded_numel

    def init_grads(self):
        """Stage 1 accumulates every grad, across micro-steps, into one full flat_grad (reduce_dtype)."""
        self.flat_grad = torch.zeros_like(self.flat_param, dtype=self.cfg.reduce_dtype)
        start = 0
        for b in self.buckets:
            b.flat_grad, start = self.flat_grad[start:start + b.padded_numel], start + b.padded_numel

    def param_shard(self, b):
        return b.shard(b.flat_param)  # this rank's slice of the bucket's compute params

    # --- grads: collected by per-param hooks, reduce-scattered bucket by bucket during backward

    def set_grad_sync(self, sync):
        """sync=False on all but the last micro-step: keep accumulating into the full flat_grad."""
        self.sync = sync

    def backward(self, loss):
        loss.backward()
        self._finish_backward()

    def _on_grad(self, p):
        bucket = self.bucket_of[p]
        bucket.ready.add(p)
        self.grad_ready(bucket, p)
        if self.sync:
            self._launch_ready_buckets(flush=False)

    def grad_ready(self, b, p):
        b.flat_grad[b.offset_of[p]:][:p.numel()].add_(p.grad.view(-1))  # add: accumulates micro-steps
        p.grad = None  # the grad lives in flat_grad now

    def grad_buffer(self, b):
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
            out = torch.empty(b.shard_numel, dtype=self.cfg.reduce_dtype, device=self.grad_shard.device)
            self.in_flight.append((b, self.comm.reduce_scatter(out, self.grad_buffer(b), async_op=True), out))
            self.launched(b)
            self.next_bucket += 1

    def launched(self, b):
        pass

    def _wait_in_flight(self):
        for b, work, out in self.in_flight:
            work.wait()
            self.grad_shard[b.shard_slice] += out  # fp32 accumulator (stages 2/3: across micro-steps)
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

    # --- the step: AdamW on this rank's fp32 master shard, then the compute params

    @torch.no_grad()
    def step(self, lr):
        cfg = self.cfg
        # global grad norm: shards are disjoint and pads are 0, so the sum of every rank's squares is exact
        sumsq = self.grad_shard.square().sum()
        self.comm.all_reduce_sum(sumsq)
        grad_norm = sumsq.sqrt().item()
        if not math.isfinite(grad_norm):  # every rank sees the same norm, so every rank skips
            self.zero_grad()
            return grad_norm
        clip = min(1.0, cfg.grad_clip / (grad_norm + 1e-6)) if cfg.grad_clip > 0 else 1.0  # as clip_grad_norm_
        self.step_count += 1
        gathers = []
        for b in self.buckets:
            s = b.shard_slice
            kernels.adamw_step(self.master_shard[s], self.grad_shard[s], self.exp_avg[s], self.exp_avg_sq[s],
                               self.param_shard(b), self.found_inf, lr=lr, beta1=cfg.beta1, beta2=cfg.beta2,
                               eps=cfg.eps, weight_decay=cfg.weight_decay, decay_numel=b.shard_decay_numel,
                               step=self.step_count, grad_scale=clip, impl=cfg.optimizer_impl)
            gathers.append(self.gather_params(b))  # async: the next bucket's step overlaps this gather
        for work in gathers:
            if work is not None:
                work.wait()
        self.zero_grad()
        return grad_norm

    def gather_params(self, b):
        """Every rank needs every new param: all-gather in place (this rank's slice is the input)."""
        return self.comm.all_gather(b.flat_param, self.param_shard(b), async_op=True)

    def zero_grad(self):
        self.grad_shard.zero_()
        self.flat_grad.zero_()

    # --- what each rank holds, and checkpoints

    def populations(self):
        """population -> (dtype, bytes this rank holds), counted from the tensors this object owns."""
        shard_bytes = self.master_shard.numel() * 4
        params = sum(self.param_bytes(b) for b in self.buckets)
        full = self.flat_grad  # stage 1 only
        grads = shard_bytes + (full.numel() * full.element_size() if full is not None else 0)
        return {'params': (self.cfg.param_dtype, params),
                'grads': (full.dtype if full is not None else torch.float32, grads),
                'master': (torch.float32, shard_bytes), 'exp_avg': (torch.float32, shard_bytes),
                'exp_avg_sq': (torch.float32, shard_bytes)}

    def param_bytes(self, b):
        return b.flat_param.numel() * b.flat_param.element_size()

    def full_state_dict(self):
        """The model's state_dict in fp32, trainable params gathered from the master shards (exact,
        unlike the bf16 compute params). Every rank must call it; every rank gets the whole dict, in host
        memory: a GPU holds one gathered bucket at a time, so saving adds no full-model copy there."""
        full = {}
        for b in self.buckets:
            flat = torch.empty(b.padded_numel, dtype=torch.float32, device=self.master_shard.device)
            dist.all_gather_into_tensor(flat, self.master_shard[b.shard_slice], group=self.comm.process_group)
            full.update({id(p): view.to('cpu', copy=True) for p, view in b.views(flat)})
        return {name: full[id(t)] if id(t) in full else t.detach().to('cpu', torch.float32, copy=True)
                for name, t in self.model.state_dict(keep_vars=True).items()}

    def state_dict(self):
        return {'step_count': self.step_count, 'master_shard': self.master_shard, 'exp_avg': self.exp_avg,
                'exp_avg_sq': self.exp_avg_sq, 'fingerprint': fingerprint(self.buckets) + [self.stage],
                'world_size': self.comm.world_size, 'rank': self.comm.rank}

    @torch.no_grad()
    def load_state_dict(self, state):
        mine = fingerprint(self.buckets) + [self.stage]
        if state['fingerprint'] != mine or state['world_size'] != self.comm.world_size:
            raise ValueError(f"this optimizer shard was saved by a run with another layout (world_size "
                             f"{state['world_size']}, layout {state['fingerprint']}; now {self.comm.world_size}, {mine}): "
                             "resume with the same model, zero_stage, bucket_mb and number of ranks")
        self.step_count = state['step_count']
        for name in ('master_shard', 'exp_avg', 'exp_avg_sq'):
            getattr(self, name).copy_(state[name])
        for b in self.buckets:  # the compute params follow the masters
            self.param_shard(b).copy_(self.master_shard[b.shard_slice])
            work = self.gather_params(b)
            if work is not None:
                work.wait()

# -----------------------------------------------------------------------------
# Stage 2: ... and shard the grads


class Zero2(Zero1):
    """No full flat_grad: a bucket's grad buffer exists only while its reduce-scatter is in flight; the
    reduced slice is added into the fp32 grad_shard. Since no full grad is kept, every
    micro-step's backward reduce-scatters (the trade: a Ψ per micro-step instead of Ψ per step)."""
    stage = 2

    def init_grads(self):
        self.flat_grad = None  # grads exist only per bucket, per micro-step: see grad_buffer

    def set_grad_sync(self, sync):
        self.sync = True

    def grad_ready(self, b, p):
        pass  # keep p.grad until the whole bucket is ready, then copy it into a fresh buffer

    def grad_buffer(self, b):
        b.flat_grad = torch.zeros(b.padded_numel, dtype=self.cfg.reduce_dtype, device=self.grad_shard.device)
        for p, view in b.views(b.flat_grad):
            if p.grad is not None:  # None: no grad this micro-step (flush); zeros are sent for it
                view.copy_(p.grad)
                p.grad = None
        self.live_grad_buffers += 1
        self.peak_grad_buffers = max(self.peak_grad_buffers, self.live_grad_buffers)
        return b.flat_grad

    def reduced(self, b):
        b.flat_grad = None
        self.live_grad_buffers -= 1

    def zero_grad(self):
        self.grad_shard.zero_()

# -----------------------------------------------------------------------------
# Stage 3: ... and shard the params (the mechanics are in fsdp_lite.py)


class Zero3(Zero2):
    """One bucket per fsdp_lite unit; the unit holds only its shard of the params between uses. The
    optimizer writes the sharded params; the next forward all-gathers them, so the step gathers nothing."""
    stage = 3

    def plan_buckets(self, model, params, units):
        # one bucket per unit, in the order backward finishes them: last block first, the root last
        unit_params = [(u, [p for p in u.parameters() if p.requires_grad]) for u in units]
        in_units = {p for _, ps in unit_params for p in ps}
        unit_params = unit_params[::-1] + [(model, [p for p in params if p not in in_units])]
        self.pairs = [(m, Bucket(ps, self.comm.world_size, self.comm.rank, default_decays)) for m, ps in unit_params if ps]
        return [b for _, b in self.pairs]

    def init_params(self):
        self.units = fsdp_lite.fully_shard(self.pairs, self.model, self.comm, self.cfg)
        for b in self.buckets:
            self.master_shard[b.shard_slice] = b.unit.master_init
            del b.unit.master_init

    def param_shard(self, b):
        return b.unit.sharded_param

    def param_bytes(self, b):
        return b.unit.sharded_param.numel() * b.unit.sharded_param.element_size()

    def launched(self, b):
        b.unit.post_backward()  # the unit's grads are all in its bucket: its params can go

    def _finish_backward(self):
        super()._finish_backward()
        fsdp_lite.finish_backward(self.units)

    def gather_params(self, b):
        return None


def plan_buckets(params, bucket_numel, world_size, rank):
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
    return [Bucket(ps, world_size, rank, default_decays) for ps in buckets]


def build_engine(model, cfg, units=(), process_group=None):
    """units: the submodules that become fsdp_lite units in stage 3 (e.g. the transformer blocks)."""
    if cfg.stage == 0:
        return DataParallel(model, cfg, process_group)
    return (Zero1, Zero2, Zero3)[cfg.stage - 1](model, cfg, units, process_group)


def memory_report(engine, world_size):
    """The startup table: dtype and bytes this rank holds per population, next to the formula. The
    paper's 2Ψ + 2Ψ + 12Ψ assumes bf16 params and grads; the formula column uses this run's dtypes:
    params p·Ψ (p = bytes of param_dtype), grads: stage 1 keeps a full r·Ψ flat_grad (r = reduce_dtype)
    plus the fp32 grad shard 4Ψ/N, stages 2-3 only the shard; master, exp_avg, exp_avg_sq 4Ψ/N each."""
    psi, cfg, N = engine.psi, engine.cfg, world_size
    p, r, stage = cfg.param_dtype.itemsize, cfg.reduce_dtype.itemsize, cfg.stage
    if stage == 0:  # DDP + torch AdamW: fp32 params and grads, fp32 moments, nothing sharded
        formula = {'params': 4 * psi, 'grads': 4 * psi, 'exp_avg': 4 * psi, 'exp_avg_sq': 4 * psi}
    else:
        formula = {'params': p * psi / (N if stage == 3 else 1), 'grads': 4 * psi / N + (r * psi if stage == 1 else 0),
                   'master': 4 * psi / N, 'exp_avg': 4 * psi / N, 'exp_avg_sq': 4 * psi / N}
    lines = [f"model states per rank, Ψ = {psi:,} trainable params, zero_stage={stage}, N={N}:",
             f"  {'population':<11} {'dtype':<9} {'bytes':>10}   {'formula':>10}"]
    total = 0
    for name, (dtype, nbytes) in engine.populations().items():
        total += nbytes
        lines.append(f"  {name:<11} {str(dtype).replace('torch.', ''):<9} {nbytes / 2**20:>8.2f}MB   {formula[name] / 2**20:>8.2f}MB")
    lines.append(f"  {'total':<21} {total / 2**20:>8.2f}MB   {sum(formula.values()) / 2**20:>8.2f}MB"
                 f"   = {total / psi:.2f} bytes/param (DDP with bf16: 16; ZeRO-3 with bf16: 16/N = {16 / N:.2f})")
    return '\n'.join(lines)

"""
fsdp_lite: the parameter half of ZeRO-3, in FSDP2's vocabulary.

Each wrapped module (a transformer block, or several: [Note: blocks per unit]; the root, the model itself, takes
the params no block holds: embeddings, tied lm_head, final norm) becomes a Unit that owns one flat, padded buffer
laid out by a zero.Bucket. Between uses a rank stores only its shard of it, the *sharded param* (shard_numel,), which
zero.py owns and the optimizer writes. Around each use the unit is *unsharded*: all-gathered into the
*unsharded param* (padded_numel,), of which every module parameter is a view. The all-gather input is the
sharded param itself, or, when that is an fp32 master under bf16 or fp16 compute, its rounding, written into this
rank's row of the unsharded param so that the gather runs in place (FSDP2 casts the same way, into a buffer of its
own). Grads and the optimizer are zero.py's business, exactly as in stage 2.

[Note: a gathered unit holds its shard once] When the all-gather input is the sharded param itself (same
dtype: fp32 compute, or a stored bf16 shard), the unsharded param holds this rank's shard, bit for bit, at
this rank's offset: keeping the sharded param beside it too would hold Ψ_unit/N twice. So, given a sharded
param with a storage of its own, a unit frees that storage once its all-gather is done and copies the shard
back out of the unsharded param when it reshards (one shard-sized copy). Nothing reads the sharded param in
between: the optimizer steps once zero.py's step has sharded every unit again. FSDP2 keeps both; on a
2-rank GPT of 51M params (fp32) this is what puts stage 3's peak below stage 2's: at the start of backward
the root unit (the tied embedding, half of Ψ) is gathered.

    forward:   pre-hook: launch this unit's all-gather (if no prefetch did), prefetch the next unit(s), wait
               post-hook: reshard if reshard_after_forward (not the last unit:
               [Note: the last unit stays gathered]); hook the outputs to catch the pre-backward
    backward:  pre-backward: unshard again if resharded, prefetch the previous unit(s)
               post-backward (zero.py, once the unit's grads are all in its bucket): reduce-scatter, reshard
               (the root at the step: [Note: the root stays gathered through a step])

A unit is SHARDED, IN_FLIGHT (its all-gather launched, not waited) or UNSHARDED. With prefetch depth d,
at most d + 1 block units are unsharded or in flight at once (plus the root, which FSDP2 also keeps
unsharded from its forward to the end of backward, and we to the step): Schedule.peak_live counts them.
"""
import functools
from enum import Enum

import torch
import torch.utils.checkpoint
from torch.autograd.graph import register_multi_grad_hook

import kernels
from comm import traced


def point_param_at(p, view):
    """Make param p a view of `view` (a piece of a flat buffer), keeping the Parameter object: optimizers,
    hooks and tied modules hold it. A param on the meta device cannot take a real tensor through .data, so
    its contents are swapped instead (torch.utils.swap_tensors)."""
    if p.is_meta:
        torch.utils.swap_tensors(p, torch.nn.Parameter(view, requires_grad=p.requires_grad))
    else:
        p.data = view


class State(Enum):
    SHARDED = 'sharded'
    IN_FLIGHT = 'in flight'
    UNSHARDED = 'unsharded'


class Schedule:
    """What the units share: the forward execution order (recorded during the first forward rather
    than assumed from registration order) and the count of live unsharded block units."""

    def __init__(self, prefetch):
        self.prefetch = prefetch
        self.order = []  # block units in the order their forward ran
        self.recorded = False
        self.live = 0
        self.peak_live = 0

    def next_in_forward(self, unit):
        if not self.recorded:
            return []
        start = 0 if unit.is_root else self.order.index(unit) + 1
        return self.order[start:start + self.prefetch]

    def is_last(self, unit):
        """[Note: the last unit stays gathered] Backward starts with the block unit forward ran last: resharding it
        after its forward only to gather it again for the loss head's backward sends Ψ_unit and costs a collective
        for nothing, while it is what the root's pre-backward prefetches anyway. So it stays gathered from its
        forward to its backward, as torchtitan does (FSDP2 reshards it unless told not to): one all-gather a
        micro-step less, one unit more gathered during the loss head's forward. The first forward of a run cannot
        know its last block yet: it reshards it."""
        return self.recorded and bool(self.order) and self.order[-1] is unit

    def next_in_backward(self, unit):
        if not self.recorded or self.prefetch == 0:
            return []
        end = len(self.order) if unit.is_root else self.order.index(unit)
        return self.order[max(0, end - self.prefetch):end][::-1]


class Unit:

    def __init__(self, module, bucket, sharded_param, comm, cfg, schedule, is_root):
        """module: the model (the root), or a ModuleList of consecutive blocks ([Note: blocks per unit])."""
        self.module, self.bucket, self.comm, self.schedule = module, bucket, comm, schedule
        # the unit is gathered before its first block runs and may go after its last: the hooks go there
        self.first, self.last = (module[0], module[-1]) if isinstance(module, torch.nn.ModuleList) else (module, module)
        self.sharded_param, self.is_root = sharded_param, is_root  # (shard_numel,), zero.py's
        # the root is needed at both ends of forward and at both ends of backward: never reshard it early
        self.reshard_after_forward = cfg.reshard_after_forward and not is_root
        self.unsharded_param = torch.empty(bucket.padded_numel, dtype=cfg.param_dtype, device=sharded_param.device)
        self.nbytes = self.unsharded_param.untyped_storage().nbytes()
        for p, view in bucket.views(self.unsharded_param):
            point_param_at(p, view)  # the module's params are views into the unsharded buffer from now on
        self.unsharded_param.untyped_storage().resize_(0)  # nothing held until the first forward gathers it
        # [Note: a gathered unit holds its shard once]: the all-gather input is the sharded param itself
        self.lends_shard = sharded_param.dtype == cfg.param_dtype
        self.shard_nbytes = sharded_param.untyped_storage().nbytes()
        assert not self.lends_shard or self.shard_nbytes == sharded_param.numel() * sharded_param.element_size(), \
            "a sharded param gathered as it is must have a storage of its own (zero.py: a tensor per unit)"
        self.state, self.work = State.SHARDED, None
        self.first.register_forward_pre_hook(self._pre_forward)
        self.last.register_forward_hook(self._post_forward)
        # [Note: blocks per unit] a unit's other blocks must run while it is gathered: checked in the first forward
        inner = list(module)[1:] if isinstance(module, torch.nn.ModuleList) else []
        self.checks = [block.register_forward_pre_hook(self._check_gathered) for block in inner]

    # --- the three states

    def unshard(self):
        """Launch the all-gather (wait_for_unshard waits for it)."""
        if self.state is State.SHARDED:
            # [Note: free the storage, not the tensor] autograd saved some params (views of this buffer)
            # for backward; shrinking and regrowing the storage keeps every view valid, and they all see
            # the re-gathered values. Writing through .data keeps the views' version counters unchanged.
            self.unsharded_param.untyped_storage().resize_(self.nbytes)
            self.work = self.comm.all_gather(self.unsharded_param.data, self.all_gather_input(), async_op=True,
                                             name=f'all_gather unit {self.bucket.index}')
            self.state = State.IN_FLIGHT
            if not self.is_root:
                self.schedule.live += 1
                self.schedule.peak_live = max(self.schedule.peak_live, self.schedule.live)

    def all_gather_input(self):
        # [Note: a cast per gather] With bf16 compute and an fp32 master every gather rounds the master shard again:
        # 2a - 1 times a step more than needed with a micro-steps (forward and backward re-gathers), one pass over 6
        # bytes an element of Ψ/N each, in the kernel library (kernels.cast_param with impl='auto'; its torch ops take
        # seven passes and five temporaries, ~56 bytes an element). It rounds straight into this rank's slice of the
        # unsharded param, so the all-gather runs in place, as stages 1/2 gather: no shard-sized temporary and no copy
        # of it into the output. Left out: keeping the bf16 shard that the fused step can write for free (2Ψ/N bytes
        # more, what stage 3 is picked to save). On an H200 the one-pass cast did not close compiled stage 3's gap to
        # stage 2 (README, "Measured: speed"): the collectives' own host time is most of it.
        if self.lends_shard:
            return self.sharded_param
        # through .data, as the gather writes: the params share the buffer's version counter (meta init swaps them in),
        # and a write autograd sees would fail the backward that saved them (the torch ops' path: fp16, no library)
        return kernels.cast_param(self.sharded_param, self.unsharded_param.dtype, impl='auto',
                                  out=self.bucket.shard(self.unsharded_param.data))  # (shard_numel,), the output's row

    def wait_for_unshard(self):
        if self.state is State.IN_FLIGHT:
            with traced(f'wait all_gather unit {self.bucket.index}'):
                self.work.wait()
            self.work, self.state = None, State.UNSHARDED
            if self.lends_shard:
                self.sharded_param.untyped_storage().resize_(0)  # its values are in the unsharded param now

    def reshard(self):
        self.wait_for_unshard()  # never free memory an all-gather is still writing into
        if self.state is State.UNSHARDED:
            if self.lends_shard:
                self.sharded_param.untyped_storage().resize_(self.shard_nbytes)
                self.sharded_param.copy_(self.bucket.shard(self.unsharded_param))
            self.unsharded_param.untyped_storage().resize_(0)
            self.state = State.SHARDED
            self.schedule.live -= not self.is_root

    # --- hooks

    def _pre_forward(self, module, args):
        if not self.is_root and not self.schedule.recorded and self not in self.schedule.order:
            self.schedule.order.append(self)
        self.unshard()  # in flight already if the previous unit prefetched it
        for unit in self.schedule.next_in_forward(self):
            unit.unshard()  # issued before we wait: its all-gather runs while this unit computes
        self.wait_for_unshard()

    def _check_gathered(self, module, args):
        if self.schedule.recorded:  # the first forward ran every unit's blocks in order: no more checks
            for handle in self.checks:
                handle.remove()
            self.checks = []
        elif self.state is not State.UNSHARDED:
            raise RuntimeError("a block ran while its unit was sharded: blocks_per_unit > 1 needs the blocks listed in "
                               "forward order, each run once a forward, one after another")

    def _post_forward(self, module, args, output):
        if self.is_root:
            self.schedule.recorded = True  # the root's forward encloses every block's: order complete
        if not torch.is_grad_enabled():  # eval: no backward will come to reshard it
            self.reshard()
            return output
        if self.reshard_after_forward and not self.schedule.is_last(self):
            self.reshard()
        tensors = [t for t in torch.utils._pytree.tree_leaves(output) if torch.is_tensor(t) and t.requires_grad]
        if tensors:
            register_multi_grad_hook(tensors, self._pre_backward, mode='any')
        return output

    def _pre_backward(self, grad):
        self.unshard()
        for unit in self.schedule.next_in_backward(self):
            unit.unshard()
        self.wait_for_unshard()

    def post_backward(self):
        """Called by zero.py once this unit's grads are all in its bucket and reduce-scatter is launched.

        [Note: the root stays gathered through a step] No param changes between the micro-steps of a step, and the next
        forward starts with the root: resharding it after backward only to gather it again first thing sends Ψ_root a
        micro-step for nothing (GPT-2 124M: 31% of Ψ). So it stays gathered until zero.py's step, which reshards every
        unit before it writes the shards: a step gathers the root once, not once a micro-step. No peak grows: each
        forward gathers the root before anything else and keeps it to the end of backward anyway. (FSDP2 gets the same
        from set_reshard_after_backward(False) on all but the last micro-step.)"""
        if not self.is_root:
            self.reshard()


def group_blocks(blocks, per_unit):
    """[Note: blocks per unit] A unit is stage 3's grain: per micro-step one all-gather before its forward, one before
    its backward (with reshard_after_forward) and one reduce-scatter after it. Each collective costs a fixed host time
    and a link latency whatever its size (on an H200's host ~120-130 us of Python and C++ per NCCL call, for a 14 MB
    block's all-gather as for a 25 MB reduce-scatter), and stage 3 makes ~3 a block where stage 2 makes ~1 a bucket:
    compiled GPT-2 124M ran host-bound there (README, "Measured: speed"), at 1.34x DDP's step, 1.08x with 3 blocks a
    unit (config/zero3.py's setting; one H200). The blocks must be listed in forward order, and only a unit's last block
    may hand its output to anything but the next block (a unit's inner output reaching backward would find the unit
    sharded); the first forward checks the order. blocks_per_unit=k gathers k consecutive blocks as one unit: the same
    bytes in 1/k as many collectives (and casts, hooks and waits), for k blocks' params unsharded at a time instead of
    one ((prefetch + 1) k with prefetch). k=1 is FSDP2's layout when fully_shard is called per block, the oracle's;
    FSDP2 users group blocks by calling it on a group of them, DeepSpeed sizes its prefetch by bytes
    (stage3_prefetch_bucket_size). The math does not change: only the grad norm's sum runs in another order (per bucket,
    then over buckets)."""
    blocks = list(blocks)
    return [torch.nn.ModuleList(blocks[i:i + per_unit]) for i in range(0, len(blocks), per_unit)]


def fully_shard(triples, root, comm, cfg):
    """triples: (module, zero.Bucket, sharded param) per unit; root: the model, whose unit holds the leftover params."""
    schedule = Schedule(cfg.prefetch)
    return [Unit(m, b, s, comm, cfg, schedule, is_root=m is root) for m, b, s in triples]


def describe(units, cfg):
    """train.py's startup line for stage 3: its units and the collectives a micro-step issues."""
    sizes = [len(u.module) for u in units if not u.is_root][::-1]  # zero.py lists them as backward finishes them
    n = len(sizes)  # forward gathers every block unit, backward all but the last (kept); the root once a step
    gathers = n + max(n - 1, 0) * cfg.reshard_after_forward
    if len(set(sizes)) == 1:
        blocks = f"of {sizes[0]} block{'s' * (sizes[0] > 1)}"
    else:
        blocks = f"({' + '.join(map(str, sizes))} blocks)"
    return (f"stage 3: {n} unit{'s' * (n != 1)} {blocks} + the root (blocks_per_unit={cfg.blocks_per_unit}), prefetch "
            f"{cfg.prefetch}: {gathers} all-gather{'s' * (gathers != 1)} and {len(units)} reduce-scatters a micro-step, "
            "+ the root's all-gather once a step")


def finish_backward(units):
    """End of a micro-step's backward: a unit whose grads never came is done with as if they had (post_backward)."""
    for unit in units:
        unit.post_backward()
        unit.schedule.recorded = True


def checkpoint_activations(modules):
    """[Note: activation checkpointing] activation_checkpointing=True: each module (a transformer block) keeps only its
    input for backward and runs its forward again when backward reaches it (torch.utils.checkpoint, non-reentrant):
    what a block saves falls from ~16 values per token and channel to 1 (memory.saved_bytes), for one more forward.
    Not sharding, but it must get along with it: the module's forward is replaced, so its hooks run once, around the
    checkpointed call, and not during the recomputation. A stage-3 unit's pre-backward hook (on its outputs' grads)
    fires before backward reaches the unit's own nodes, whose saved tensors trigger the recomputation: the unit is
    gathered again before the recomputed forward reads its params; nothing reshards it before its post-backward, and
    no second pre-backward hook is registered. Stages 0-2 hold every param anyway."""
    for module in modules:
        module.forward = functools.partial(torch.utils.checkpoint.checkpoint, module.forward, use_reentrant=False)

"""
fsdp_lite: the parameter half of ZeRO-3, in FSDP2's vocabulary.

Each wrapped module (a transformer block; the root, the model itself, takes the params no block holds:
embeddings, tied lm_head, final norm) becomes a Unit that owns one flat, padded buffer laid out by a
zero.Bucket. Between uses a rank stores only its shard of it, the *sharded param* (shard_numel,). Around
each use the unit is *unsharded*: all-gathered into the *unsharded param* (padded_numel,), of which
every module parameter is a view. Grads and the optimizer are zero.py's business, exactly as in stage 2.

    forward:   pre-hook: unshard (wait for the prefetched all-gather), prefetch the next unit(s)
               post-hook: reshard if reshard_after_forward; hook the outputs to catch the pre-backward
    backward:  pre-backward: unshard again if resharded, prefetch the previous unit(s)
               post-backward (zero.py, once the unit's grads are all in its bucket): reduce-scatter, reshard

A unit is SHARDED, IN_FLIGHT (its all-gather launched, not waited) or UNSHARDED. With prefetch depth d,
at most d + 1 block units are unsharded or in flight at once (plus the root, which FSDP2 also keeps
unsharded from its forward to the end of backward): Schedule.peak_live counts them.
"""
from enum import Enum

import torch
from torch.autograd.graph import register_multi_grad_hook


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

    def next_in_backward(self, unit):
        if not self.recorded or self.prefetch == 0:
            return []
        end = len(self.order) if unit.is_root else self.order.index(unit)
        return self.order[max(0, end - self.prefetch):end][::-1]


class Unit:

    def __init__(self, module, bucket, comm, cfg, schedule, is_root):
        self.module, self.bucket, self.comm, self.schedule = module, bucket, comm, schedule
        self.is_root = is_root
        # the root is needed at both ends of forward and at both ends of backward: never reshard it early
        self.reshard_after_forward = cfg.reshard_after_forward and not is_root
        flat32 = bucket.pack(torch.float32)
        comm.broadcast(flat32)  # every rank starts from rank 0's values, like DDP
        # copy=True: with fp32 compute, .to() would return flat32 itself, and freeing the unsharded
        # storage would free the shard with it
        self.sharded_param = bucket.shard(flat32).to(cfg.param_dtype, copy=True)  # (shard_numel,)
        self.master_init = bucket.shard(flat32).clone()  # exact fp32: zero.py's master shard starts here
        self.unsharded_param = flat32.to(cfg.param_dtype, copy=True)  # (padded_numel,)
        self.nbytes = self.unsharded_param.untyped_storage().nbytes()
        for p, view in bucket.views(self.unsharded_param):
            p.data = view  # the module's params are views into the unsharded buffer from now on
        self.state, self.work = State.UNSHARDED, None
        schedule.live += not is_root
        self.reshard()
        bucket.unit = self
        module.register_forward_pre_hook(self._pre_forward)
        module.register_forward_hook(self._post_forward)

    # --- the three states

    def unshard(self, async_op=False):
        if self.state is State.SHARDED:
            # [Note: free the storage, not the tensor] autograd saved some params (views of this buffer)
            # for backward; shrinking and regrowing the storage keeps every view valid, and they all see
            # the re-gathered values. Writing through .data keeps the views' version counters unchanged.
            self.unsharded_param.untyped_storage().resize_(self.nbytes)
            self.work = self.comm.all_gather(self.unsharded_param.data, self.sharded_param, async_op=True)
            self.state = State.IN_FLIGHT
            if not self.is_root:
                self.schedule.live += 1
                self.schedule.peak_live = max(self.schedule.peak_live, self.schedule.live)
        if not async_op:
            self.wait_for_unshard()

    def wait_for_unshard(self):
        if self.state is State.IN_FLIGHT:
            self.work.wait()
            self.work, self.state = None, State.UNSHARDED

    def reshard(self):
        self.wait_for_unshard()  # never free memory an all-gather is still writing into
        if self.state is State.UNSHARDED:
            self.unsharded_param.untyped_storage().resize_(0)
            self.state = State.SHARDED
            self.schedule.live -= not self.is_root

    # --- hooks

    def _pre_forward(self, module, args):
        if not self.is_root and not self.schedule.recorded and self not in self.schedule.order:
            self.schedule.order.append(self)
        self.unshard()
        for unit in self.schedule.next_in_forward(self):
            unit.unshard(async_op=True)  # its all-gather runs while this unit computes

    def _post_forward(self, module, args, output):
        if self.is_root:
            self.schedule.recorded = True  # the root's forward encloses every block's: order complete
        if not torch.is_grad_enabled():  # eval: no backward will come to reshard it
            self.reshard()
            return output
        if self.reshard_after_forward:
            self.reshard()
        tensors = [t for t in torch.utils._pytree.tree_leaves(output) if torch.is_tensor(t) and t.requires_grad]
        if tensors:
            register_multi_grad_hook(tensors, self._pre_backward, mode='any')
        return output

    def _pre_backward(self, grad):
        self.unshard()
        for unit in self.schedule.next_in_backward(self):
            unit.unshard(async_op=True)

    def post_backward(self):
        """Called by zero.py once this unit's grads are all in its bucket and reduce-scatter is launched."""
        self.reshard()


def fully_shard(pairs, root, comm, cfg):
    """pairs: (module, zero.Bucket) per unit; root: the model, whose unit holds the leftover params."""
    schedule = Schedule(cfg.prefetch)
    return [Unit(m, b, comm, cfg, schedule, is_root=m is root) for m, b in pairs]


def finish_backward(units):
    """End of backward: whatever is still unsharded (the root; a unit whose grads never came) is freed."""
    for unit in units:
        unit.reshard()
        unit.schedule.recorded = True

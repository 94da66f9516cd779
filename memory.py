"""
The memory arithmetic of ZeRO: what each rank holds, counted from tensors while training and estimated
before you rent the GPUs ("use the lowest stage that fits"): the paper's model states and nanozero's as
configured, the activations and transient buffers of a micro-step ([Note: the peak]), zero_stage='auto''s
choice, and the startup table. Its command line is estimate.py's (`python zero.py estimate`).

Units: GB = 1e9 bytes, as in the ZeRO paper and seed tables; the startup table prints MB = 1e6 bytes.
The estimate for "nanozero as configured" is the same function (model_states) whose figures the startup
table prints next to the bytes counted from the tensors, so the two cannot disagree unnoticed.
"""
import dataclasses
import math
import os
import sys

import torch

import fsdp_lite
import model

# -----------------------------------------------------------------------------
# model states: the paper's model, and nanozero as configured


def paper_states(stage, psi, world, k=12):
    """The ZeRO paper's per-rank model states in bytes: 2Ψ bf16 params + 2Ψ bf16 grads + KΨ optimizer state
    (K = 12: fp32 master, exp_avg, exp_avg_sq), stage s shards the last s of the three over `world` ranks."""
    n = world
    return {'params': 2 * psi / (n if stage >= 3 else 1), 'grads': 2 * psi / (n if stage >= 2 else 1),
            'optimizer': k * psi / (n if stage >= 1 else 1)}


def model_states(stage, psi, world, cfg):
    """nanozero as configured (a zero.ZeroConfig): population -> (dtype or None, bytes per rank during a step).
    counted_states(engine) counts the same from an engine's tensors (padding aside: shards are padded up to a
    multiple of 8 elements per rank and bucket, or 256 with 8-bit state)."""
    if stage == 0:  # torch DDP + AdamW: fp32 params (autocast computes in param_dtype), fp32 grads and moments
        return {k: (torch.float32, 4 * psi) for k in ('params', 'grads', 'exp_avg', 'exp_avg_sq')}
    shard, precision, dtype = psi / world, cfg.precision, cfg.param_dtype
    master = precision.master_dtype(dtype)  # None: the params hold it; float32; int16 remainder
    # stage 3 stores the compute params only where they are (part of) the master: [Note: who holds the master]
    params = dtype.itemsize * (psi if stage < 3 else shard if master != torch.float32 else 0)
    per_element = precision.bytes_per_element(dtype)
    out = {'params': (dtype if params else None, params),
           'grads': ((cfg.reduce_dtype, torch.float32)[stage > 1], 4 * shard + (cfg.reduce_dtype.itemsize * psi if stage == 1 else 0)),
           'master': (master, per_element['master'] * shard)}
    for name in ('exp_avg', 'exp_avg_sq'):
        out[name] = (precision.state_torch_dtype, per_element[name] * shard)
    return out


def communication(stage, psi, accum, cfg):
    """Elements each rank sends per step (the paper's convention: an all-reduce of n elements is 2n, a
    reduce-scatter or all-gather n), and bytes at the configured dtypes. accum: micro-steps per rank.
    Stage 3 counts the backward re-gather of every unit; the root unit and the last block unit are kept from forward
    to backward, and the root through the step's micro-steps, so the real figure is lower by their share (train.py's
    log shows what is sent)."""
    if stage == 0:
        return {'all_reduce': (2 * psi, 2 * psi * 4)}  # DDP's grads are fp32 (the params are)
    rs = psi * (accum if stage >= 2 else 1)  # stages 2/3 keep no full grad: a reduce-scatter per micro-step
    ag = psi * (2 * accum if stage == 3 else 1)  # stage 3: forward and backward, every micro-step
    return {'reduce_scatter': (rs, rs * cfg.reduce_dtype.itemsize), 'all_gather': (ag, ag * cfg.param_dtype.itemsize)}

# -----------------------------------------------------------------------------
# activations and transients, for "which stage fits"


def saved_bytes(n_layer, n_embd, vocab_size, tokens, compute_bytes, checkpointing=False):
    """[Note: activation estimate] What autograd saves for backward in one micro-batch of `tokens` = B·T tokens,
    with SDPA attention (no T x T scores kept), no dropout, and model.py's chunked loss head (eager or compiled: the
    same tensors). Per block, values per token per channel:
    ln_1 in 1, c_attn in 1, q k v 3 (views of c_attn's output), attention out 1 (SDPA writes it in (B, T, nh, hs)
    layout, so the transpose().contiguous() before c_proj is a no-op and c_proj saves that same storage),
    ln_2 in 1, c_fc in 1, GELU in 4, c_proj in 4: 16, of which the two layer-norm inputs are fp32 under autocast
    on CUDA (layer_norm autocasts to fp32 there), the other 14 in the compute dtype. Then the head: ln_f's input and
    the grad of ln_f's output (the head computes it in forward: [Note: chunked loss head] in model.py), both fp32
    under CUDA autocast, and the fp32 grad of the tied lm_head weight, vocab x channels, whatever the batch:
        tokens * (n_layer * n_embd * (14a + 2*4) + 2 * 4 * n_embd) + 4 * vocab_size * n_embd bytes, a = compute bytes.
    No vocab-sized tensor per token is kept (a plain head keeps B·T x vocab fp32 log-probs: 4 * vocab_size a token).
    With activation checkpointing (fsdp_lite [Note: activation checkpointing]) a block saves only its input, 1 value
    per token per channel (a bytes: the residual stream is in the compute dtype at stages 1-3), in place of 14a + 8.
    Left out, < 1% at any real width: layer-norm means and rstds, attention logsumexps, the token ids.
    On a CPU autocast runs layer_norm in the compute dtype, so there this is 4 - a bytes per layer-norm per channel
    per token high. test_memory.py checks it against the bytes autograd really saves (within 2% on its tiny models)."""
    a = compute_bytes
    return tokens * (n_layer * n_embd * (a if checkpointing else 14 * a + 2 * 4) + 2 * 4 * n_embd) + 4 * vocab_size * n_embd


@dataclasses.dataclass
class Activations:
    """One micro-batch's activation bytes, in the pieces that [Note: the peak] adds up moment by moment."""
    blocks: int  # saved by every block from its forward to its backward (their inputs alone with checkpointing)
    others: int  # the part of `blocks` that the other blocks hold while one block runs its backward
    block: int  # the most the block under backward holds of its saved tensors (recomputed ones too with checkpointing)
    head: int  # saved by the loss head: ln_f's input, the grads of x (fp32) and of the tied weight (fp32, vocab x C)
    forward: int  # the head's transients in forward: logits chunks, or a chunk beside the weight grad's matmul output
    backward: int  # the head's backward: the grads of x and of the weight scaled by the incoming grad (fp32)
    checkpointing: bool = False
    residual32: int = 0  # stage 0's fp32 params: each checkpointed block saves an fp32 input, not an a-byte one

    def peak(self):
        """The model's own activation peak, no ZeRO buffers: the head's forward or backward, or a block's backward."""
        return self.blocks + max(self.head + max(self.forward, self.backward), self.block - (self.blocks - self.others))


def activations(n_layer, n_embd, vocab_size, tokens, compute_bytes, checkpointing=False):
    """The pieces of [Note: the peak] from saved_bytes ([Note: activation estimate]) and model.py's chunked loss head.
    In the head's forward the previous chunk's logits (fp32, and its g in the compute dtype a < 4) are still bound while
    the next chunk's fp32 logits and logsumexp's temporary of their size are made (the last chunk may be short); or one
    chunk beside g.t() @ xi, vocab x C in a bytes. A block's backward adds ~8 values per token and channel of grads of
    its activations (the MLP's hidden ones, 4C wide) to its saved tensors."""
    a, C, V = compute_bytes, n_embd, vocab_size
    saved = saved_bytes(n_layer, C, V, tokens, a, checkpointing)
    head = saved_bytes(0, C, V, tokens, a)  # tokens * 2 * 4 * C + 4 * V * C
    per_block = tokens * C * (a if checkpointing else 14 * a + 2 * 4)
    rows = min(tokens, model.loss_chunk_rows(V))
    last = tokens - (math.ceil(tokens / rows) - 1) * rows  # rows of the last chunk
    low = a if a < 4 else 0  # a compute-dtype copy of a chunk, where the compute dtype is not fp32
    chunks = max(2 * 4 * rows, (4 + low) * rows + 2 * 4 * (rows if tokens > 2 * rows else last) if tokens > rows else 0)
    forward = V * max(chunks, rows * (4 + low) + C * a)
    block = per_block + (tokens * C * (14 * a + 2 * 4) if checkpointing else 0) + tokens * C * 8 * a
    return Activations(blocks=saved - head, others=saved - head - per_block, block=block, head=head, forward=forward,
                       backward=tokens * C * 4 + V * C * 4, checkpointing=checkpointing,
                       residual32=n_layer * tokens * C * (4 - a) if checkpointing else 0)


def activation_bytes(n_layer, n_embd, vocab_size, tokens, compute_bytes, checkpointing=False):
    """The model's own activation peak (Activations.peak), for printing: [Note: the peak] adds the ZeRO buffers."""
    return activations(n_layer, n_embd, vocab_size, tokens, compute_bytes, checkpointing).peak()


NO_ACTIVATIONS = Activations(0, 0, 0, 0, 0, 0)


def transient_bytes(stage, cfg, block_numel, root_numel, psi, world, act=NO_ACTIVATIONS):
    """[Note: the peak] Bytes on top of the model states at the worst of four moments of a micro-step (measured with
    the profiler's CPU memory events on GPT-2 1.5B and a 4 x 256 GPT at rank 0 of 64; bench_scale checks the sum):
    (A) the head's forward, last chunks: every block's saved tensors, the head's, its forward transients.
    (B) the head's backward: the same, plus the scaled grads of x and of the weight and, where params are not fp32, the
    weight grad's cast to their dtype. That cast is the tied embedding's grad from here on: autograd holds it until the
    embedding's backward, the last, adds its own (root_numel at most).
    (C) the first block's backward: the other blocks' saved tensors, the pending embedding grad, and the worse of the
    block's own saved tensors and its grads as autograd made them (param_dtype) beside the grad buffer they are copied
    into ([Note: one grad buffer]; a stage 2 bucket holds bucket_mb of grads or one larger param: counted as a whole
    block, an over-count of up to 2/3 of a block's grads).
    (D) the root's backward, activations gone: the embedding's grad beside the pending one (autograd sums them in place),
    then their sum beside the root's grad buffer (stages 2/3; stage 1 adds it into the full flat_grad).
    Stage 3 also holds gathered units, less their own shards where a gathered unit frees them (fsdp_lite [Note: a
    gathered unit holds its shard once]): the root from its forward to the end of backward; in (A) the last block
    unit ([Note: the last unit stays gathered]), in (B) it or the `prefetch` units the root's pre-backward gathers, in
    (C) prefetch + 1 units; every block, without reshard_after_forward. A
    unit is blocks_per_unit blocks (fsdp_lite [Note: blocks per unit]), of block_numel each (GPT's are alike).
    Not modelled: a block's backward temporaries beyond the ~8 values per token and channel Activations.block counts,
    allocator slack. (Stage 3's all-gather input takes no memory of
    its own: the shard is rounded into its row of the unsharded param, fsdp_lite [Note: a cast per gather]; on the
    torch ops' path, fp16 or no kernel library, the rounding makes shard-sized temporaries.)"""
    r, p = cfg.reduce_dtype.itemsize, cfg.param_dtype.itemsize if stage > 0 else 4  # stage 0: DDP's fp32 params
    unit = min(block_numel * cfg.blocks_per_unit, psi - root_numel)  # stage 3's largest unit: k blocks, or all
    bucket = {0: 0, 1: 0, 2: min(psi, max(cfg.bucket_mb * 2**20 // r, block_numel)), 3: unit}[stage]
    share = (1 - 1 / world if cfg.precision.master_dtype(cfg.param_dtype) != torch.float32 else 1) * p * (stage == 3)
    kept = 0 if cfg.reshard_after_forward else psi - root_numel  # blocks gathered from forward to backward
    pending, cast = root_numel * p, root_numel * p if p < 4 else 0
    # the last unit stays gathered into backward (fsdp_lite [Note: the last unit stays gathered]): one at least
    gathered = [max(kept, min(psi - root_numel, n * unit)) for n in (1, max(1, cfg.prefetch), cfg.prefetch + 1)]
    # stage 0 computing in a < 4 bytes (autocast) on fp32 params: the forward's casts of the weights, which autocast
    # keeps to the forward's end and the backward as long as its saved tensors use them (checkpointed: the head's, and
    # the recomputed block's), and with checkpointing each block's fp32 input (the residual stream is fp32 there)
    a, held = cfg.param_dtype.itemsize, [psi, root_numel, block_numel] if act.checkpointing else [psi] * 3
    casts = [n * a + act.residual32 if stage == 0 and a < 4 else 0 for n in held]
    moments = {'A': act.blocks + act.head + act.forward + share * (root_numel + gathered[0]) + casts[0],
               'B': act.blocks + act.head + act.backward + cast + share * (root_numel + gathered[1]) + casts[1],
               'C': act.others + pending + max(act.block, bucket * (p + r)) + share * (root_numel + gathered[2]) + casts[2],
               'D': max(2 * pending, pending + (root_numel * r if stage > 1 else 0)) + share * root_numel}
    return max(moments.values())


def stage_config(cfg, stage):
    """cfg at another stage; stage 0 is torch DDP + AdamW, which knows only the default precision."""
    return dataclasses.replace(cfg, stage=stage, **({'precision': type(cfg.precision)()} if stage == 0 else {}))


def stage_estimates(psi, world, cfg, act, block_numel, root_numel):
    """stage -> bytes per rank: model states + transients + activations. Stage 0 only with the default precision:
    the precision modes are ZeRO's fused step, which torch AdamW cannot honour."""
    out = {}
    for stage in (0, 1, 2, 3) if cfg.precision == type(cfg.precision)() else (1, 2, 3):
        c = stage_config(cfg, stage)
        states = sum(b for _, b in model_states(stage, psi, world, c).values())
        out[stage] = states + transient_bytes(stage, c, block_numel, root_numel, psi, world, act)
    return out


HEADROOM = 0.10  # of the device's memory, for the allocator's fragmentation, the runtime and temporaries


def pick_stage(estimates, limit_bytes):
    """The lowest stage whose estimate fits in (1 - HEADROOM) of the limit, or None; and the one-line reasoning."""
    budget = (1 - HEADROOM) * limit_bytes
    fits = [s for s, need in sorted(estimates.items()) if need <= budget]
    each = ', '.join(f"stage {s} {need / 1e9:.3g}" for s, need in sorted(estimates.items()))
    pick = fits[0] if fits else None
    verdict = f"-> stage {pick}, the lowest that fits" if fits else "-> none fits"
    return pick, (f"zero_stage=auto: per-rank GB (states + transients + activations): {each}; limit "
                  f"{budget / 1e9:.3g} GB = {1 - HEADROOM:.0%} of {limit_bytes / 1e9:.3g} GB {verdict}")


def lowest_stage_that_fits(model, zcfg, world, tokens, limit_bytes, checkpointing):
    """zero_stage='auto': (the lowest stage that fits or None, the one-line reasoning, a hint for when none fits). It
    says when activation checkpointing is what makes the stage fit, or would make one fit."""
    psi, c = sum(p.numel() for p in model.parameters()), model.config

    def pick(ck):
        act = activations(c.n_layer, c.n_embd, c.vocab_size, tokens, zcfg.param_dtype.itemsize, ck)
        return pick_stage(stage_estimates(psi, world, zcfg, act, *unit_sizes(model, model.transformer.h)), limit_bytes)
    (stage, line), (other, _) = pick(checkpointing), pick(not checkpointing)
    if checkpointing and stage is not None and (other is None or other > stage):
        line += f"; activation_checkpointing=True is what makes stage {stage} fit (without it: {'none' if other is None else other})"
    hint = f"activation_checkpointing=True (then stage {other} fits), " if stage is None and other is not None else ''
    return stage, line, hint


def choose_stage(cfg, zcfg, device, world_size, model_args):
    """train.py's zero_stage='auto': (the lowest stage that fits in the least memory of any rank, the reasoning), for
    train.py's config cfg, zcfg its ZeroConfig; ValueError with the fix if none fits."""
    with torch.device('meta'):
        gpt = model.GPT(model.GPTConfig(**model_args))
    stage, line, hint = lowest_stage_that_fits(gpt, zcfg, world_size, cfg['batch_size'] * cfg['block_size'],
                                               device_memory_bytes(device, cfg['memory_gb']), cfg['activation_checkpointing'])
    if stage is None:
        raise ValueError(f"{line}: use {hint}more ranks, a smaller batch_size or block_size"
                         + ", or set memory_gb" * (device.type == 'cpu'))  # a GPU's limit is its free memory
    return stage, line


def device_memory_bytes(device, memory_gb=0.0):
    """What one rank may use: on a GPU what torch.cuda.mem_get_info reports free; on a CPU memory_gb if set,
    else the machine's RAM divided among the ranks on this machine. In a process group, the least of any rank's:
    every rank must pick the same stage (GPUs of one job can have different memory free, and a rank at stage 0 beside
    one at stage 1 would each wait in a collective the other never joins)."""
    if device.type == 'cuda':
        mine = torch.cuda.mem_get_info(device)[0]
    elif memory_gb > 0:
        mine = memory_gb * 1e9
    else:
        mine = os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / int(os.environ.get('LOCAL_WORLD_SIZE', 1))
    if not torch.distributed.is_initialized():
        return mine
    least = torch.tensor([mine], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(least, op=torch.distributed.ReduceOp.MIN)
    return least.item()


def unit_sizes(model, units):
    """(numel of the largest of `units`, the blocks; numel of the root: what no block holds), trainable params only."""
    blocks = [sum(p.numel() for p in u.parameters() if p.requires_grad) for u in units]
    total = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return max(blocks, default=0), total - sum(blocks)

# -----------------------------------------------------------------------------
# the startup table: counted next to estimated


def nbytes(tensor):
    return 0 if tensor is None else tensor.numel() * tensor.element_size()


def counted_states(engine):
    """What an engine (zero.py, stages 0-3) holds, per population: (dtype, or None where not held; bytes during a
    step), counted from its tensors; the grads, which live from a step's first grad to its end, from their sizes."""
    if engine.stage == 0:  # DDP + torch AdamW: fp32 params, grads (in DDP's buckets), exp_avg, exp_avg_sq
        return {k: (torch.float32, 4 * engine.psi) for k in ('params', 'grads', 'exp_avg', 'exp_avg_sq')}
    reduce = engine.cfg.reduce_dtype
    params = (engine.param_shards or []) if engine.stage == 3 else [engine.flat_param]  # stage 3: one per unit, or none
    out = {'params': (params[0].dtype if params else None, sum(map(nbytes, params))),  # (none next to an fp32 master)
           'grads': (reduce if engine.stage == 1 else torch.float32,
                     4 * engine.shard_numel + (reduce.itemsize * engine.flat_numel if engine.stage == 1 else 0)),
           'master': (getattr(engine.master, 'dtype', None), nbytes(engine.master))}
    for k, name in enumerate(('exp_avg', 'exp_avg_sq')):  # 8-bit: the codes and one fp32 absmax per block
        state = getattr(engine, name)
        out[name] = (state.dtype, nbytes(state) + (nbytes(engine.absmax[k]) if engine.absmax else 0))
    return out


def dtype_name(dtype):
    return '-' if dtype is None else 'uint8+absmax' if dtype == torch.uint8 else str(dtype).replace('torch.', '')


def startup_table(engine, world_size):
    """What this rank holds during a step, per population: dtype, bytes counted from its tensors, and the
    estimate from model_states (the estimator's own function); at stage 3, its units (fsdp_lite.describe)."""
    psi, cfg = engine.psi, engine.cfg
    estimate = model_states(engine.stage, psi, world_size, cfg)
    lines = [f"model states per rank, Ψ = {psi:,} trainable params, zero_stage={engine.stage}, N={world_size} "
             f"(MB = 1e6 bytes, held during a step):",
             f"  {'population':<11} {'dtype':<13} {'counted':>9} {'estimate':>9}"]
    counted = counted_states(engine)
    for name, (dtype, nbytes) in counted.items():
        lines.append(f"  {name:<11} {dtype_name(dtype):<13} {nbytes / 1e6:>9.2f} {estimate[name][1] / 1e6:>9.2f}")
    total, total_estimate = sum(b for _, b in counted.values()), sum(b for _, b in estimate.values())
    lines.append(f"  {'total':<25} {total / 1e6:>9.2f} {total_estimate / 1e6:>9.2f}   = {total / psi:.2f} bytes/param "
                 f"(the paper, bf16 + fp32 Adam: DDP 16, ZeRO-3 16/N = {16 / world_size:.2f})")
    if engine.stage == 3:
        lines.append(fsdp_lite.describe(engine.units, cfg))
    return '\n'.join(lines)

if __name__ == '__main__':  # importable only (before: exit 0 and no output); the estimator's command is zero.py's
    print("memory.py is a module, not a command: run python zero.py estimate (--help for its options)", file=sys.stderr)
    sys.exit(2)

"""
Train a GPT with data parallelism: torch DDP (zero_stage=0) or nanozero's ZeRO-1/2/3 (zero.py).

On a laptop CPU, 2 gloo ranks, the embedded Shakespeare default (data is prepared on first use):
$ torchrun --standalone --nproc_per_node=2 train.py config/shakespeare_cpu.py

On one node of 8 GPUs (NCCL):
$ torchrun --standalone --nproc_per_node=8 train.py config/zero3.py

Across 2 nodes, run on each (node_rank 0 and 1; MASTER_ADDR = node 0's address):
$ torchrun --nproc_per_node=8 --nnodes=2 --node_rank=0 --master_addr=$MASTER_ADDR --master_port=29500 train.py config/zero3.py

Any key below can be set in a config file (plain Python assignments) or as --key=value after it.
"""
import ast
import difflib
import math
import os
import sys
import time
from contextlib import nullcontext

import numpy as np
import torch
import torch.distributed as dist

from model import GPT, GPTConfig, peak_flops
from zero import ZeroConfig, build_engine, memory_report

# -----------------------------------------------------------------------------
# default config values: a GPT-2 (124M) on Shakespeare with ZeRO off (torch DDP)
# I/O
out_dir = 'out'
eval_interval = 250
log_interval = 10
eval_iters = 50
eval_only = False  # if True, evaluate once and exit
always_save_checkpoint = False  # if False, save only when the val loss improves
init_from = 'scratch'  # 'scratch' or 'resume' (from out_dir)
# data
dataset = 'shakespeare'  # data/{dataset}/train.bin and val.bin
gradient_accumulation_steps = 8  # micro-steps per iteration, summed over all ranks
batch_size = 8  # micro-batch size per rank
block_size = 256
# model
n_layer = 12
n_head = 12
n_embd = 768
dropout = 0.0
bias = False
# AdamW
learning_rate = 6e-4
max_iters = 2000
weight_decay = 1e-1
beta1 = 0.9
beta2 = 0.95
grad_clip = 1.0  # clip the global grad norm to this; 0 = off
# learning rate schedule: linear warmup, cosine decay to min_lr
decay_lr = True
warmup_iters = 100
lr_decay_iters = 2000
min_lr = 6e-5
# data parallelism
zero_stage = 0  # 0 = torch DDP, 1 = shard optimizer state, 2 = + grads, 3 = + params
backend = ''  # '' = nccl on GPUs, gloo on CPU
bucket_mb = 25.0  # stage 1/2 grad bucket size
reduce_dtype = 'float32'  # grads are reduced in this dtype ('float32' or 'bfloat16')
prefetch = 1  # stage 3: all-gathers in flight ahead of compute (0 = off)
reshard_after_forward = True  # stage 3: free each block's params after its forward (False: 2Ψ traffic, more memory)
optimizer_impl = 'auto'  # fused AdamW kernel: 'auto', 'reference', 'cpu', 'cuda'
# system
device = 'cuda' if torch.cuda.is_available() else 'cpu'
dtype = 'bfloat16' if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else 'float32'
compile = False  # torch.compile the model (stages 0-2)
seed = 1337
# -----------------------------------------------------------------------------
DEFAULTS = {k: v for k, v in globals().items() if not k.startswith('_') and isinstance(v, (int, float, bool, str))}


def parse_config(argv, defaults=DEFAULTS):
    """nanoGPT's configurator as a function: config files are executed, --key=value overrides are
    literal-evaluated and must match the default's type; an unknown key is an error naming the closest."""
    config = dict(defaults)

    def check_key(key, where):
        if key not in defaults:
            close = difflib.get_close_matches(key, defaults, n=3)
            hint = f"; did you mean {' or '.join(close)}?" if close else "; see the defaults at the top of train.py"
            raise ValueError(f"unknown config key '{key}' in {where}{hint}")

    for arg in argv:
        if not arg.startswith('--'):
            namespace = {}
            with open(arg) as f:
                exec(f.read(), namespace)
            for key, value in namespace.items():
                if not key.startswith('_') and not callable(value):
                    check_key(key, arg)
                    config[key] = value
            continue
        key, sep, value = arg[2:].partition('=')
        if not sep:
            raise ValueError(f"expected --key=value, got '{arg}'")
        check_key(key, arg)
        try:
            value = ast.literal_eval(value)
        except (SyntaxError, ValueError):
            pass  # a bare string, e.g. --dataset=shakespeare
        expected = type(defaults[key])
        if expected is float and type(value) is int:
            value = float(value)
        if type(value) is not expected:
            raise TypeError(f"--{key}={value!r} is a {type(value).__name__}, but {key} takes a {expected.__name__} "
                            f"(default {defaults[key]!r})")
        config[key] = value
    return config

# -----------------------------------------------------------------------------
# data, learning rate, one training step, evaluation


def load_split(data_dir, split):
    return np.memmap(os.path.join(data_dir, f'{split}.bin'), dtype=np.uint16, mode='r')


def get_batch(data, batch_size, block_size, generator, device):
    """batch_size random windows of block_size + 1 tokens: inputs x and next-token targets y, (B, T)."""
    ix = torch.randint(len(data) - block_size, (batch_size,), generator=generator)
    x = torch.stack([torch.from_numpy(data[i:i + block_size].astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + block_size].astype(np.int64)) for i in ix])
    if device.type == 'cuda':
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)


def get_lr(it, cfg):
    """Linear warmup for warmup_iters, cosine decay to min_lr at lr_decay_iters, min_lr after."""
    if not cfg['decay_lr']:
        return cfg['learning_rate']
    if it < cfg['warmup_iters']:
        return cfg['learning_rate'] * (it + 1) / (cfg['warmup_iters'] + 1)
    if it > cfg['lr_decay_iters']:
        return cfg['min_lr']
    ratio = (it - cfg['warmup_iters']) / (cfg['lr_decay_iters'] - cfg['warmup_iters'])
    coeff = 0.5 * (1.0 + math.cos(math.pi * ratio))  # 1 -> 0
    return cfg['min_lr'] + coeff * (cfg['learning_rate'] - cfg['min_lr'])


def train_step(engine, batches, lr, autocast):
    """One optimizer step over this rank's micro-batches [(x, y), ...]. Returns (this rank's mean loss,
    the global grad norm before clipping). The engine decides when grads are communicated."""
    total = 0.0
    for micro, (x, y) in enumerate(batches):
        engine.set_grad_sync(micro == len(batches) - 1)  # before the forward: DDP decides there
        with autocast:
            _, loss = engine.module(x, y)
        engine.backward(loss / len(batches))
        total += loss.detach()
    return total / len(batches), engine.step(lr)


@torch.no_grad()
def evaluate(engine, splits, eval_iters, batch_fn, autocast):
    """Mean loss over eval_iters batches per split, averaged over ranks. Every rank runs the forward
    (stage 3 needs all of them for its all-gathers)."""
    model = engine.module
    model.eval()
    out = {}
    for split in splits:
        losses = []
        for k in range(eval_iters):
            x, y = batch_fn(split)
            with autocast:
                _, loss = model(x, y)
            losses.append(loss.float())  # on the model's device: no host sync per batch, and NCCL can reduce it
        mean = torch.stack(losses).mean().reshape(1)
        if dist.is_initialized():
            dist.all_reduce(mean)
            mean /= dist.get_world_size()
        out[split] = mean.item()
    model.train()
    return out

# -----------------------------------------------------------------------------
# wiring


def setup_distributed(cfg):
    """Under torchrun: one process per rank, its device, its backend. Without torchrun: world size 1
    (a 1-rank gloo/nccl process group, so every stage runs the same code)."""
    if 'RANK' not in os.environ:
        os.environ.update(RANK='0', WORLD_SIZE='1', LOCAL_RANK='0', MASTER_ADDR='127.0.0.1',
                          MASTER_PORT=str(29500 + os.getpid() % 1000))
    local_rank = int(os.environ['LOCAL_RANK'])
    device = torch.device(cfg['device'])
    if device.type == 'cuda':
        device = torch.device('cuda', local_rank)
        torch.cuda.set_device(device)
    backend = cfg['backend'] or ('nccl' if device.type == 'cuda' else 'gloo')
    dist.init_process_group(backend=backend, device_id=device if backend == 'nccl' else None)
    return device, dist.get_rank(), dist.get_world_size()


def check_config(cfg, world_size):
    if cfg['gradient_accumulation_steps'] % world_size:
        raise ValueError(f"gradient_accumulation_steps={cfg['gradient_accumulation_steps']} is the global count of "
                         f"micro-steps and must be divisible by the {world_size} ranks")
    if cfg['dtype'] not in ('float32', 'bfloat16', 'float16'):
        raise ValueError(f"dtype={cfg['dtype']!r}: use 'float32', 'bfloat16' or 'float16'")
    if cfg['dtype'] == 'float16' and cfg['zero_stage'] > 0:
        raise ValueError("dtype='float16' needs loss scaling, which nanozero implements for zero_stage=0 only "
                         "(torch GradScaler); use dtype='bfloat16' with ZeRO")
    if cfg['init_from'] not in ('scratch', 'resume'):
        raise ValueError(f"init_from={cfg['init_from']!r}: use 'scratch' or 'resume'")
    if cfg['compile'] and cfg['zero_stage'] == 3:
        raise ValueError("compile=True with zero_stage=3 is not supported: fsdp_lite's per-block hooks "
                         "unshard params around each block; use compile=False")
    if cfg['reduce_dtype'] not in ('float32', 'bfloat16'):
        raise ValueError(f"reduce_dtype={cfg['reduce_dtype']!r}: use 'float32' or 'bfloat16'")
    return zero_config(cfg)


def zero_config(cfg):
    return ZeroConfig(stage=cfg['zero_stage'], param_dtype=getattr(torch, cfg['dtype']),
                      reduce_dtype=getattr(torch, cfg['reduce_dtype']), bucket_mb=cfg['bucket_mb'],
                      weight_decay=cfg['weight_decay'], beta1=cfg['beta1'], beta2=cfg['beta2'],
                      grad_clip=cfg['grad_clip'], optimizer_impl=cfg['optimizer_impl'], prefetch=cfg['prefetch'],
                      reshard_after_forward=cfg['reshard_after_forward'])


def build(cfg, device, vocab_size, state=None):
    """Model + data-parallel engine, from scratch or from a checkpoint's model."""
    args = dict(n_layer=cfg['n_layer'], n_head=cfg['n_head'], n_embd=cfg['n_embd'], block_size=cfg['block_size'],
                bias=cfg['bias'], vocab_size=vocab_size, dropout=cfg['dropout'])
    if state is not None:
        args.update(state['model_args'])  # the architecture comes from the checkpoint
    torch.manual_seed(cfg['seed'])  # the same init on every rank (rank 0's is broadcast anyway)
    model = GPT(GPTConfig(**args))
    if state is not None:
        missing, unexpected = model.load_state_dict(state['model'], strict=False)
        if missing or unexpected:
            raise ValueError(f"checkpoint does not match the model: missing {missing[:4]}, unexpected {unexpected[:4]}")
    model.to(device)
    engine = build_engine(model, zero_config(cfg), units=list(model.transformer.h))
    if cfg['compile']:
        engine.module = torch.compile(engine.module)
    return args, model, engine


def main(cfg):
    device, rank, world_size = setup_distributed(cfg)
    master_process = rank == 0
    check_config(cfg, world_size)
    accum = cfg['gradient_accumulation_steps'] // world_size
    tokens_per_iter = accum * world_size * cfg['batch_size'] * cfg['block_size']
    data_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'data', cfg['dataset'])
    if not os.path.exists(os.path.join(data_dir, 'val.bin')):
        if cfg['dataset'] != 'shakespeare':
            raise FileNotFoundError(f"{data_dir}/train.bin missing: run python data/shakespeare/prepare.py "
                                    f"--input=YOUR.txt --out_dir={data_dir}")
        if master_process:  # the others wait at the barrier below
            from data.shakespeare.prepare import prepare
            prepare(data_dir)
    dist.barrier()
    data = {split: load_split(data_dir, split) for split in ('train', 'val')}
    generator = torch.Generator().manual_seed(cfg['seed'] + rank)  # each rank draws its own batches

    def batch_fn(split):
        return get_batch(data[split], cfg['batch_size'], cfg['block_size'], generator, device)

    state, iter_num, best_val_loss = None, 0, 1e9
    if cfg['init_from'] == 'resume':
        state = torch.load(os.path.join(cfg['out_dir'], 'ckpt.pt'), map_location=device, weights_only=False)
        iter_num, best_val_loss = state['iter_num'], state['best_val_loss']
        if (state['zero_stage'], state['world_size']) != (cfg['zero_stage'], world_size):
            raise ValueError(f"{cfg['out_dir']}/ckpt.pt was saved with zero_stage={state['zero_stage']} on "
                             f"{state['world_size']} ranks; resume with the same (its optimizer state is sharded that way)")
    model_args, model, engine = build(cfg, device, vocab_size=50304, state=state)
    if state is not None:
        shard_file = os.path.join(cfg['out_dir'], f"optim_rank{rank if cfg['zero_stage'] > 0 else 0}.pt")
        engine.load_state_dict(torch.load(shard_file, map_location=device, weights_only=False))
    autocast = nullcontext() if cfg['dtype'] == 'float32' else torch.autocast(device.type, getattr(torch, cfg['dtype']))
    # every rank builds (or loads) the AdamW kernel now, not while the others wait for it in a collective
    optimizer = 'torch AdamW' if cfg['zero_stage'] == 0 else 'kernels.adamw_step, impl=' + kernels_impl(cfg, device)
    if master_process:
        os.makedirs(cfg['out_dir'], exist_ok=True)
        print(f"world size {world_size} ({dist.get_backend()}), device {device}, dtype {cfg['dtype']}, "
              f"tokens per iteration {tokens_per_iter:,} = {accum} accum * {world_size} ranks * "
              f"{cfg['batch_size']} batch * {cfg['block_size']} tokens")
        print(f"params: {model.get_num_params() / 1e6:.2f}M, optimizer: {optimizer}")
        print(memory_report(engine, world_size))
    peak = peak_flops(device)
    t0 = time.time()
    while True:
        if iter_num % cfg['eval_interval'] == 0 or iter_num >= cfg['max_iters']:
            losses = evaluate(engine, ('train', 'val'), cfg['eval_iters'], batch_fn, autocast)
            if master_process:
                print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
            if losses['val'] < best_val_loss or cfg['always_save_checkpoint']:
                best_val_loss = min(best_val_loss, losses['val'])
                if iter_num > 0:
                    save_checkpoint(cfg, engine, model_args, iter_num, best_val_loss, rank)
        if cfg['eval_only'] or iter_num >= cfg['max_iters']:
            break
        lr = get_lr(iter_num, cfg)
        engine.comm.numel.clear()
        batches = [batch_fn('train') for _ in range(accum)]
        loss, grad_norm = train_step(engine, batches, lr, autocast)
        iter_num += 1
        if iter_num % cfg['log_interval'] == 0 and master_process:
            t1 = time.time()
            dt, t0 = (t1 - t0) / cfg['log_interval'], t1
            sent = ', '.join(f"{k} {v / engine.psi:.2f}Ψ" for k, v in sorted(engine.comm.numel.items())
                             if k != 'all_reduce' or cfg['zero_stage'] == 0)  # not the 1-scalar grad norm
            mfu = model.estimate_mfu(tokens_per_iter / dt / world_size, peak)
            print(f"iter {iter_num}: loss {loss.item():.4f}, time {dt * 1000:.2f}ms, tok/s {tokens_per_iter / dt:,.0f}, "
                  f"lr {lr:.2e}, norm {grad_norm:.3f}" + (f", mfu {mfu * 100:.2f}%" if mfu is not None else '')
                  + f", sent {sent}")
    dist.barrier()  # every rank done (and no async work left) before the process group goes
    dist.destroy_process_group()


def kernels_impl(cfg, device):
    import kernels
    return kernels.resolve_impl(cfg['optimizer_impl'], device)


def save_checkpoint(cfg, engine, model_args, iter_num, best_val_loss, rank):
    """ckpt.pt: the full fp32 model (nanoGPT's layout, what sample.py reads) + where we are; ZeRO stages
    add optim_rank{r}.pt per rank: that rank's master/exp_avg/exp_avg_sq shard."""
    full = engine.full_state_dict()  # a collective in stages 1-3: every rank calls it
    if rank == 0:
        ckpt = {'model': full, 'model_args': model_args, 'iter_num': iter_num, 'best_val_loss': best_val_loss,
                'config': cfg, 'zero_stage': cfg['zero_stage'], 'world_size': dist.get_world_size()}
        print(f"saving checkpoint to {cfg['out_dir']}")
        torch.save(ckpt, os.path.join(cfg['out_dir'], 'ckpt.pt'))
    if cfg['zero_stage'] > 0 or rank == 0:
        torch.save(engine.state_dict(), os.path.join(cfg['out_dir'], f'optim_rank{rank}.pt'))


if __name__ == '__main__':
    try:
        config = parse_config(sys.argv[1:])
        check_config(config, int(os.environ.get('WORLD_SIZE', 1)))
    except (ValueError, TypeError, FileNotFoundError) as e:
        sys.exit(f"config error: {e}")
    main(config)

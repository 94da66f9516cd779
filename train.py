"""
Train a GPT with data parallelism: torch DDP (zero_stage=0) or nanozero's ZeRO-1/2/3 (zero.py).

On a laptop CPU, 2 gloo ranks, character-level Shakespeare (data is prepared on first use):
$ torchrun --standalone --nproc_per_node=2 train.py config/shakespeare_char.py

On one node of 8 GPUs (NCCL):
$ torchrun --standalone --nproc_per_node=8 train.py config/zero3.py

Across 2 nodes, run on each (node_rank 0 and 1; MASTER_ADDR = node 0's address; out_dir on a shared filesystem):
$ torchrun --nproc_per_node=8 --nnodes=2 --node_rank=0 --master_addr=$MASTER_ADDR --master_port=29500 train.py config/zero3.py

Any key below (its default; the top of this file says what each does) can be set in a config file (plain Python
assignments) or as --key=value after it.
"""
import dataclasses
import math
import os
import re
import signal
import sys
import time
from contextlib import nullcontext

import numpy as np
import torch
import torch.distributed as dist

import checkpoint
import resume
import launch
import configurator
import fsdp_lite
import kernels
import memory
from model import GPT, GPTConfig, peak_flops
from zero import ZeroConfig, build_engine

# -----------------------------------------------------------------------------
# default config values: a GPT-2 (124M) on Shakespeare with ZeRO off (torch DDP)
# I/O
out_dir = 'out'
eval_interval = 250
log_interval = 10
eval_iters = 50  # batches per split, shared among the ranks
eval_only = False  # if True, evaluate once and exit
always_save_checkpoint = False  # if False, save only when the val loss improves
keep_last = 2  # checkpoints kept in out_dir (older ones are deleted once a newer one is complete)
init_from = 'scratch'  # 'scratch' or 'resume' (the newest complete checkpoint in out_dir)
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
zero_stage = 0  # 0 = torch DDP, 1 = shard optimizer state, 2 = + grads, 3 = + params; or 'auto': the lowest that fits
memory_gb = 0.0  # zero_stage='auto' on a CPU: memory per rank (0 = the machine's RAM / local ranks)
backend = ''  # '' = nccl on GPUs, gloo on CPU
bucket_mb = 25.0  # stage 1/2 grad bucket size
reduce_dtype = 'float32'  # grads are reduced in this dtype ('float32' or 'bfloat16')
prefetch = 1  # stage 3: all-gathers in flight ahead of compute (0 = off)
reshard_after_forward = True  # stage 3: free each unit's params after its forward (False: 2Ψ traffic, more memory)
blocks_per_unit = 1  # stage 3: blocks gathered together (fewer, larger collectives; more params unsharded at once)
activation_checkpointing = False  # keep only each block's input, recompute its forward in backward (fsdp_lite)
optimizer_impl = 'auto'  # fused AdamW kernel: 'auto', 'reference', 'cpu', 'cuda'
# what ZeRO's optimizer stores (kernels.Precision; stages 1-3)
master_weights = 'fp32'  # 'fp32', 'remainder' (bf16 param + 16 bits: exact, 2 B/param), 'none' (bf16 params only)
state_dtype = 'float32'  # exp_avg and exp_avg_sq: 'float32', 'bfloat16' or 'int8' (blockwise, dynamic map)
stochastic_rounding = False  # with master_weights='none': round each update into the bf16 params stochastically
# system
device = 'cuda' if torch.cuda.is_available() else 'cpu'
dtype = 'bfloat16' if torch.cuda.is_available() and torch.cuda.is_bf16_supported(including_emulation=False) else 'float32'
compile = False  # torch.compile the model (stage 3: each block and the loss head, the gathering hooks left outside)
profile = False  # write a torch.profiler trace of iterations 2-4 to out_dir/trace_rank{r}.json
seed = 1337
# -----------------------------------------------------------------------------
DEFAULTS = {k: v for k, v in globals().items() if not k.startswith('_') and isinstance(v, (int, float, bool, str))}
ALSO = {'zero_stage': ('auto',)}  # values allowed besides the default's type
AT_LEAST_1 = ('batch_size', 'block_size', 'n_layer', 'n_head', 'n_embd', 'gradient_accumulation_steps', 'eval_iters',
              'eval_interval', 'log_interval', 'keep_last')
AT_LEAST_0 = ('max_iters', 'warmup_iters', 'lr_decay_iters', 'learning_rate', 'min_lr', 'weight_decay', 'grad_clip',
              'memory_gb', 'seed')
ROOT = os.path.dirname(os.path.abspath(__file__))
PREPARED_ON_FIRST_USE = ('shakespeare', 'shakespeare_char')  # data/<name>/prepare.py, run by rank 0


def parse_config(argv, defaults=DEFAULTS):
    """The config: DEFAULTS, then config files and --key=value overrides in turn (configurator.py)."""
    return configurator.parse_config(argv, defaults, ALSO)

# -----------------------------------------------------------------------------
# data, learning rate, one training step, evaluation


def data_dir(cfg):
    return os.path.join(ROOT, 'data', cfg['dataset'])


def vocab_size(cfg):
    """The dataset's vocabulary (meta.json) rounded up to a multiple of 64 for faster matmuls: GPT-2's
    50257 -> 50304, Shakespeare's 84 characters -> 128. Without a meta.json: GPT-2's."""
    return math.ceil(checkpoint.dataset_meta(cfg['dataset']).get('vocab_size', 50257) / 64) * 64


def model_args(cfg, vocab):
    return dict(n_layer=cfg['n_layer'], n_head=cfg['n_head'], n_embd=cfg['n_embd'], block_size=cfg['block_size'],
                bias=cfg['bias'], vocab_size=vocab, dropout=cfg['dropout'])


def load_split(path, split):
    return np.memmap(os.path.join(path, f'{split}.bin'), dtype=np.uint16, mode='r')


def windows(data, rows, block_size, device):
    """Inputs x and next-token targets y, (B, T), for the windows starting at `rows`."""
    x = torch.stack([torch.from_numpy(data[i:i + block_size].astype(np.int64)) for i in rows])
    y = torch.stack([torch.from_numpy(data[i + 1:i + 1 + block_size].astype(np.int64)) for i in rows])
    if device.type == 'cuda':
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)


def draw(data, key, count, cfg):
    """`count` micro-batches of batch_size window starts, a function of `key` alone (numpy's seed sequence)."""
    rng = np.random.default_rng(key)
    return rng.integers(len(data) - cfg['block_size'], size=(count, cfg['batch_size']))


def train_batches(data, iteration, cfg, rank, world_size, device):
    """This rank's micro-batches of `iteration`. The global batch (gradient_accumulation_steps micro-batches)
    depends on (seed, iteration) alone; rank r takes its contiguous share. So 1, 2 or 4 ranks train on the
    same global batches, and a resumed run sees exactly those the uninterrupted run would have seen. torch's
    generator is seeded from (seed, iteration, rank) too: dropout's masks are those of the uninterrupted run."""
    torch.manual_seed(int(np.random.SeedSequence([cfg['seed'], 2, iteration, rank]).generate_state(1)[0]))
    every = draw(data, [cfg['seed'], 0, iteration], cfg['gradient_accumulation_steps'], cfg)
    local = len(every) // world_size
    return [windows(data, rows, cfg['block_size'], device) for rows in every[rank * local:(rank + 1) * local]]


def get_lr(it, cfg):
    """Linear warmup for warmup_iters, cosine decay to min_lr at lr_decay_iters, min_lr after."""
    if not cfg['decay_lr']:
        return cfg['learning_rate']
    if it < cfg['warmup_iters']:
        return cfg['learning_rate'] * (it + 1) / (cfg['warmup_iters'] + 1)
    if it >= cfg['lr_decay_iters']:  # (at lr_decay_iters, min_lr either way; with warmup_iters there too, no 0 / 0)
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
def evaluate(engine, eval_sets, autocast, rank, world_size):
    """Mean loss over each split's fixed eval set (the same batches at every eval, whatever the world size),
    shared among the ranks. Every rank runs as many forwards (stage 3 all-gathers in them): a rank with one
    batch fewer repeats its last one with weight 0."""
    model = engine.module
    model.eval()
    out = {}
    for split, batches in eval_sets.items():
        per_rank = math.ceil(len(batches) / world_size)
        total = torch.zeros(2, device=batches[0][0].device)  # (sum of losses, count), on the model's device
        for k in range(rank * per_rank, (rank + 1) * per_rank):
            x, y = batches[min(k, len(batches) - 1)]
            with autocast:
                _, loss = model(x, y)
            total += torch.stack([loss.float(), torch.ones_like(loss.float())]) * (k < len(batches))
        if dist.is_initialized():
            dist.all_reduce(total)
        out[split] = (total[0] / total[1]).item()
    model.train()
    return out

# -----------------------------------------------------------------------------
# wiring


def prepare_data(cfg, rank, device):
    """Shakespeare (GPT-2 tokens or characters) is prepared on first use: by rank 0, then by each other machine's first
    rank where it is still not there (each machine's own data/, not one shared by all); the others wait. One that
    fails (offline, a disk full) stops every rank, not only its own: its machine's first rank says why."""
    for turn in (rank == 0, rank > 0 and os.environ.get('LOCAL_RANK', '0') == '0'):
        why = ''
        if turn and cfg['dataset'] in PREPARED_ON_FIRST_USE and not os.path.exists(os.path.join(data_dir(cfg), 'meta.json')):
            try:  # (meta.json is written last)
                __import__(f"data.{cfg['dataset']}.prepare", fromlist=['prepare']).prepare(data_dir(cfg))
            except Exception as e:
                why = f": {type(e).__name__}: {e}"
        if launch.ranks_where(why, device):  # (and the others' wait)
            raise launch.MachineError(f"preparing {os.path.relpath(data_dir(cfg))} failed{why or ' on another machine'}")


def config_problems(cfg, world_size):
    """What is wrong with the config's values, each with its fix (train.py and `zero.py estimate` refuse the first)."""
    problems = [f"gradient_accumulation_steps={cfg['gradient_accumulation_steps']} is the global count of micro-steps and "
                f"must be divisible by the {world_size} ranks"] if cfg['gradient_accumulation_steps'] % world_size else []
    problems += [f"{k}={cfg[k]}: use at least {n}" for n, keys in ((1, AT_LEAST_1), (0, AT_LEAST_0)) for k in keys if cfg[k] < n]
    problems += [f"{k}={cfg[k]}: use a value in [0, 1)" for k in ('dropout', 'beta1', 'beta2') if not 0 <= cfg[k] < 1]
    if cfg['decay_lr'] and cfg['lr_decay_iters'] < cfg['warmup_iters']:
        problems.append(f"lr_decay_iters={cfg['lr_decay_iters']} < warmup_iters={cfg['warmup_iters']}: the rate would fall "
                        "from its peak to min_lr in one step; use lr_decay_iters >= warmup_iters, or decay_lr=False")
    if cfg['n_embd'] % max(cfg['n_head'], 1):
        problems.append(f"n_embd={cfg['n_embd']} is not a multiple of n_head={cfg['n_head']}: a head takes n_embd / n_head")
    for key, allowed in (('dtype', ('float32', 'bfloat16', 'float16')), ('reduce_dtype', ('float32', 'bfloat16')),
                         ('init_from', ('scratch', 'resume')), ('backend', ('', 'gloo', 'nccl')),
                         ('optimizer_impl', ('auto', 'reference', 'cpu', 'cuda'))):
        if cfg[key] not in allowed:
            problems.append(f"{key}={cfg[key]!r}: use one of {', '.join(map(repr, allowed))}")
    return problems


def check_config(cfg, world_size):
    """Every mistake that can be found before the process group starts, as one ValueError with the fix."""
    problems, device, gpu = config_problems(cfg, world_size), cfg['device'].split(':')[0], torch.cuda.is_available()
    machine = launch.silent_for_problems()  # a machine's own: its environment, a GPU it lacks ("invalid device ordinal")
    if (not re.fullmatch(r'cpu|cuda(:\d+)?', cfg['device']) or (device == 'cuda' and not gpu)
            or (cfg['backend'], device) == ('nccl', 'cpu')):
        problems.append(f"device={cfg['device']!r}{', backend=nccl' * (cfg['backend'] == 'nccl')}: use 'cpu' (gloo), "
                        f"or 'cuda' (nccl) where torch sees a GPU (torch.cuda.is_available() is {gpu} here)")
    elif device == 'cuda':
        machine += launch.gpu_problems(cfg['device'], torch.cuda.device_count())
    if cfg['optimizer_impl'] in ('cpu', 'cuda') and cfg['optimizer_impl'] != device:
        problems.append(f"optimizer_impl={cfg['optimizer_impl']!r} steps shards on the {cfg['optimizer_impl'].upper()}, and "
                        f"device={cfg['device']!r}: use 'auto' (the device's kernel)")
    if problems or machine:
        raise ValueError(problems[0]) if problems else launch.MachineError(machine[0])
    found = all(os.path.exists(os.path.join(data_dir(cfg), f'{s}.bin')) for s in ('train', 'val'))
    if not found and cfg['dataset'] not in PREPARED_ON_FIRST_USE:
        raise launch.MachineError(f"dataset={cfg['dataset']!r}: {os.path.relpath(data_dir(cfg))}/train.bin and val.bin not found; "
                                f"prepare them with python data/shakespeare/prepare.py --input=YOUR.txt --out_dir=data/"
                                f"{cfg['dataset']} (GPT-2 tokens) or data/shakespeare_char/prepare.py (characters)")
    tokens = found and min(os.path.getsize(os.path.join(data_dir(cfg), f'{s}.bin')) // 2 for s in ('train', 'val'))
    if found and tokens <= cfg['block_size']:  # a window and its next token must fit (uint16 tokens)
        raise ValueError(f"block_size={cfg['block_size']}, but a split of {cfg['dataset']} has {tokens} tokens: use less")
    return zero_config(cfg)


def zero_config(cfg):
    same = {f.name: cfg[f.name] for f in dataclasses.fields(ZeroConfig) if f.name in cfg}  # a key per field, as is
    precision = kernels.Precision(cfg['master_weights'], cfg['state_dtype'], cfg['stochastic_rounding'])
    stage = 1 if cfg['zero_stage'] == 'auto' else cfg['zero_stage']  # 'auto', not chosen yet: stage 1's, for the checks
    return ZeroConfig(**{**same, 'stage': stage, 'param_dtype': getattr(torch, cfg['dtype']),
                         'reduce_dtype': getattr(torch, cfg['reduce_dtype']), 'precision': precision})


def build(cfg, device, args):
    """Model + data-parallel engine. Stages 1-3 build the model on the meta device and materialize it bucket
    by bucket (stage 3: unit by unit, straight into this rank's shard): no rank holds the whole model in fp32."""
    zcfg = zero_config(cfg)
    with torch.device('meta' if zcfg.stage > 0 else device):
        model = GPT(GPTConfig(**args), seed=cfg['seed'])
    engine = build_engine(model, zcfg, units=list(model.transformer.h), device=device)
    if cfg['compile']:
        compile_model(model, engine)
    if cfg['activation_checkpointing']:  # around the compiled blocks (stages 1-3), inside the compiled model (0)
        fsdp_lite.checkpoint_activations(model.transformer.h)
    return model, engine


def compile_model(model, engine):
    """torch.compile a DDP-wrapped model whole (torch splits its graph at DDP's buckets: the all-reduces still overlap
    backward); anything else (ZeRO stages 1-3, FSDP2) per unit: each block's forward and the loss head (the root unit's
    own work), the grad and gathering hooks around them, eager. A whole model compiled is one backward node yielding
    every grad at once: stage 2's reduce-scatters would all wait for the end of backward, holding every grad."""
    if isinstance(engine.module, torch.nn.parallel.DistributedDataParallel):
        engine.module = torch.compile(engine.module)
        return
    for block in model.transformer.h:
        block.forward = torch.compile(block.forward)
    model.head = torch.compile(model.head)


def config_error(e, rank, met=True):  # sys.exit's: one line from rank 0 (every rank meets it), from a rank a file was
    # Unreadable to, or from each machine's first rank for a MachineError or an error before the ranks met (met=False)
    says = rank == 0 or isinstance(e, resume.Unreadable) or (isinstance(e, launch.MachineError) or not met) and launch.first_on_machine()
    return f"{f'rank {rank}: ' * (rank > 0)}config error: {e}" if says else 1


def catch_ctrl_c():
    """[Note: a Ctrl-C is never lost] SIGINT's KeyboardInterrupt is raised wherever Python runs next, and C code that
    calls Python may drop it there (a suite run saw a run train on for a minute after SIGINT, stderr empty). So the
    handler also records it, in the list returned, and the loop raises it at the next iteration."""
    seen = []

    def on_sigint(signum, frame):
        seen.append(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_sigint)
    return seen


def main(cfg):
    device, rank, world_size = launch.start_process_group(cfg['device'], cfg['backend'])
    job = dict(cfg, device=device.type, code=configurator.code(), torch=torch.__version__)  # each machine is launched
    if differ := configurator.differences(launch.gather_objects(job), per_node=('out_dir', 'memory_gb')):  # on its own
        sys.exit(config_error(ValueError(differ), rank))
    master_process = rank == 0
    log = print if master_process else (lambda *a, **k: None)
    try:  # (in __main__ too, unless the data was prepared just now: its vocab was unknown there)
        prepare_data(cfg, rank, device)
        args = model_args(cfg, vocab_size(cfg))
        if not cfg['eval_only']:  # before any rank looks for a checkpoint there
            resume.check_shared(cfg['out_dir'], rank, world_size, device)
        found = resume.find_resume(cfg, args)  # None, or (path, manifest, damaged): errors before any training step
    except ValueError as e:
        sys.exit(config_error(e, rank))
    if master_process and not cfg['eval_only']:  # out_dir is this job's: its torchrun restarts resume
        resume.mark_job(cfg['out_dir'])
    if cfg['zero_stage'] == 'auto':  # the lowest stage that fits in the least memory of any rank (memory.py)
        try:
            cfg['zero_stage'], line = memory.choose_stage(cfg, zero_config(cfg), device, world_size, args)
        except ValueError as e:  # none fits, on every rank at once: one line, as a config error
            sys.exit(f"config error: {e}" if master_process else 1)
        log(line)
    elif cfg['memory_gb']:
        log(f"warning: memory_gb={cfg['memory_gb']} set, but only zero_stage='auto' reads it")
    accum = cfg['gradient_accumulation_steps'] // world_size
    tokens_per_iter = accum * world_size * cfg['batch_size'] * cfg['block_size']
    data = {split: load_split(data_dir(cfg), split) for split in ('train', 'val')}
    eval_sets = {s: [windows(data[s], rows, cfg['block_size'], device) for rows in draw(data[s], [cfg['seed'], 1 + i], cfg['eval_iters'], cfg)]
                 for i, s in enumerate(('train', 'val'))}
    if cfg['zero_stage'] > 0:  # every rank builds (or loads) the AdamW kernel now, not while the others wait in a collective
        kernels.announce_build(cfg['optimizer_impl'], device, log)
        impl = kernels.resolve_impl(cfg['optimizer_impl'], device)
    model, engine = build(cfg, device, args)
    try:  # damaged, with nothing whole to fall back on (a CRC-32 is checked here): every rank stops, rank 0 says so
        iter_num, best_val_loss = checkpoint.load(engine, *found, log=log, cfg=cfg) if found else (0, 1e9)
    except (resume.Damaged, resume.Unreadable) as e:  # every rank alike (verify's MAX), or the rank a read failed on
        sys.exit(config_error(e, rank))
    autocast = nullcontext() if cfg['dtype'] == 'float32' else torch.autocast(device.type, getattr(torch, cfg['dtype']))
    optimizer = 'torch AdamW' if cfg['zero_stage'] == 0 else f'kernels.adamw_step, impl={impl}, {engine.cfg.precision}'
    log(f"world size {world_size} ({dist.get_backend()}), device {device}, dtype {cfg['dtype']}, "
        f"tokens per iteration {tokens_per_iter:,} = {accum} accum * {world_size} ranks * "
        f"{cfg['batch_size']} batch * {cfg['block_size']} tokens")
    log(f"params: {model.get_num_params() / 1e6:.2f}M, optimizer: {optimizer}")
    log(memory.startup_table(engine, world_size))
    if cfg['eval_only'] and not found:  # init_from='scratch' (a resume with nothing to load stops in find_resume)
        log("note: eval_only=True, init_from='scratch': evaluating a freshly initialized model (init_from='resume' "
            "evaluates out_dir's newest checkpoint)")
    for warning in engine.cfg.warnings():
        log(f"warning: {warning}")
    if cfg['compile']:
        log("compiling with torch.compile: the first iterations include the compilation")
    profiler = launch.start_profiler(cfg['out_dir'], rank, device) if cfg['profile'] else None
    peak = peak_flops(device)
    t0, skipped = time.time(), 0  # skipped: steps in a row with a non-finite grad norm
    interrupted = catch_ctrl_c()
    while True:
        if interrupted:  # a Ctrl-C whose KeyboardInterrupt something swallowed: [Note: a Ctrl-C is never lost]
            raise KeyboardInterrupt
        if iter_num % cfg['eval_interval'] == 0 or iter_num >= cfg['max_iters'] or cfg['eval_only']:
            losses = evaluate(engine, eval_sets, autocast, rank, world_size)
            log(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
            if losses['val'] < best_val_loss or cfg['always_save_checkpoint']:
                best_val_loss = min(best_val_loss, losses['val'])
                if iter_num > 0 and not cfg['eval_only']:  # (eval_only holds no claim on out_dir: it writes nothing)
                    checkpoint.save(engine, cfg, args, iter_num, best_val_loss, log=log)
        if cfg['eval_only'] or iter_num >= cfg['max_iters']:
            break
        lr = get_lr(iter_num, cfg)
        engine.comm.numel.clear()
        batches = train_batches(data['train'], iter_num, cfg, rank, world_size, device)
        loss, grad_norm = train_step(engine, batches, lr, autocast)
        iter_num += 1
        skipped = 0 if math.isfinite(grad_norm) else skipped + 1  # the same norm on every rank: all stop together
        checkpoint.fault_point('step', iter_num)
        if profiler:
            profiler = launch.profiler_step(profiler, cfg['out_dir'], log)
        if iter_num % cfg['log_interval'] == 0:
            dist.all_reduce(loss)  # every rank: the mean over all ranks' micro-batches, whatever the world size
            loss /= world_size
        if iter_num % cfg['log_interval'] == 0 and master_process:
            t1 = time.time()
            dt, t0 = (t1 - t0) / cfg['log_interval'], t1
            sent = ', '.join(f"{k} {v / engine.psi:.2f}Ψ" for k, v in sorted(engine.comm.numel.items())
                             if k != 'all_reduce' or cfg['zero_stage'] == 0)  # not the 1-scalar grad norm
            mfu = model.estimate_mfu(tokens_per_iter / dt / world_size, peak)
            print(f"iter {iter_num}: loss {loss.item():.4f}, time {dt * 1000:.2f}ms, tok/s {tokens_per_iter / dt:,.0f}, "
                  f"lr {lr:.2e}, norm {grad_norm:.3f}" + (f", mfu {mfu * 100:.2f}%" if mfu is not None else '')
                  + (f", loss scale {engine.scaler.get_scale():g}" if cfg['dtype'] == 'float16' else '')
                  + f", sent {sent}")
        if device.type == 'cuda' and iter_num in (1, cfg['max_iters']):
            log(f"cuda max_memory_allocated after iteration {iter_num}: {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB")
        if skipped == 40:  # fp16's scale now 2^-24, none would help. After the log line; every rank at once: exit 1
            launch.end_process_group(device)  # (every rank is here: the group ended, not left to NCCL's warning at exit)
            sys.exit(f"training stopped: iterations {iter_num - skipped + 1}-{iter_num}: {skipped} steps in a row skipped, "
                     f"their grads not finite{' whatever the loss scale' if cfg['dtype'] == 'float16' else ''}: look for "
                     "NaN or inf in the data, the loss or the params, or lower learning_rate" if master_process else 1)
    if profiler:  # a run of fewer than 4 iterations
        profiler.stop()
    launch.end_process_group(device)  # every rank done; [Note: the end of a run]


if __name__ == '__main__':
    if {'-h', '--help'} & set(sys.argv[1:]):  # how to run (the keys and their defaults: the top of this file)
        sys.exit(print(__doc__.strip(), *(f'  --{k}={v!r}' for k, v in DEFAULTS.items()), sep='\n'))
    launch.tell_on_a_crash()  # from here on, an exception no rank catches stops the other machines' ranks too
    try:
        config = parse_config(sys.argv[1:])
        check_config(config, launch.launched_world_size())
        lock = resume.claim(config['out_dir']) if os.environ.get('RANK', '0') == '0' and not config['eval_only'] else None
        if os.environ.get('RANK', '0') == '0' and os.path.exists(os.path.join(data_dir(config), 'meta.json')):
            resume.find_resume(config, model_args(config, vocab_size(config)))  # one line; the others: after check_shared
    except ValueError as e:  # one line, once a machine (torchrun starts its ranks with the same mistake), exit code 1
        launch.Stops().tell(f'config error: {e}', before_meeting=True)  # the other machines' ranks stop with it
        sys.exit(config_error(e, int(os.environ.get('RANK', 0)), met=False))
    try:
        main(config)
    except KeyboardInterrupt:  # Ctrl-C: one line from rank 0, not a traceback from wherever it landed; 130 as a shell's
        if os.environ.get('RANK', '0') == '0':
            saved = resume.latest(config['out_dir'])
            print("interrupted: " + (f"{saved} is whole (a save is a rename): continue the run with --init_from=resume"
                                     if saved else "no checkpoint saved yet"), file=sys.stderr)
        sys.exit(130)
    except checkpoint.NotSaved as e:  # a disk full, on any rank: every rank stops here; rank 0 says so, the failed rank why
        launch.end_process_group(torch.device(config['device']))  # every rank is here: ended, not left to NCCL's warning
        rank, saved = int(os.environ.get('RANK', 0)), resume.latest(config['out_dir'])
        then = (f"{saved} is the newest whole checkpoint: continue with --init_from=resume once there is room" if saved
                else "no checkpoint was saved: a new run starts over")
        sys.exit(f"{f'rank {rank}: ' * (rank > 0)}checkpoint error: {e}; {then}" if rank == 0 or e.own else 1)

"""
Does what the optimizer *stores* decide whether a run converges? The storage-precision patterns of the seeds,
trained one after another on the same small GPT (character-level Shakespeare), same seeds, same data order, bf16
compute, ZeRO-2 on 1 rank (sharding changes nothing here: every pattern is the fused step's, kernels.py).

    python study_precision.py             # the study: 8 patterns x 2 seeds x 3000 iterations, ~25 min on 2 cores
    python study_precision.py --quick     # a smoke run of every pattern (what the tests run), into a temporary folder

Writes assets/precision.md (the table) and assets/precision.png (val loss curves; needs matplotlib, an optional
dependency of this script only); --quick writes them to a new temporary folder unless --out names one, and says where.
"""
import argparse
import os
import tempfile
import time

import torch
import torch.distributed as dist

import launch
import memory
import train

PATTERNS = {  # name -> the train.py keys that make it
    'fp32 master + fp32 state (baseline)': {},
    'remainder master + fp32 state': dict(master_weights='remainder'),
    'no master + fp32 state': dict(master_weights='none'),
    'no master + bf16 state (seed 002)': dict(master_weights='none', state_dtype='bfloat16'),
    'no master + int8 state (seed 000, no ZeRO)': dict(master_weights='none', state_dtype='int8'),
    'fp32 master + int8 state (seed 000, ZeRO-3)': dict(state_dtype='int8'),
    'no master + stochastic rounding': dict(master_weights='none', stochastic_rounding=True),
    'fp16 + fp32 master + loss scaling (seed 003)': dict(dtype='float16'),
}
# small enough that fp16, whose matmuls run at ~2.5 GFLOP/s on a CPU without fp16 arithmetic (85x slower than bf16
# with AVX512-BF16, measured here), fits: 8 patterns x 2 seeds x 3000 iterations in ~25 minutes on 2 cores
STUDY = dict(dataset='shakespeare_char', n_layer=2, n_head=4, n_embd=64, block_size=64, batch_size=8,
             gradient_accumulation_steps=1, max_iters=3000, learning_rate=2e-3, min_lr=2e-4, warmup_iters=100,
             lr_decay_iters=3000, beta2=0.99, weight_decay=0.1, grad_clip=1.0, eval_iters=10, dropout=0.0,
             device='cpu', dtype='bfloat16', zero_stage=2, bucket_mb=4.0)
QUICK = dict(STUDY, n_layer=1, n_embd=32, n_head=2, max_iters=20, lr_decay_iters=20, warmup_iters=2, eval_iters=2)


def run(cfg, every):
    """Train one pattern; returns (val loss curve [(iteration, loss)], model-state bytes/param, tokens/s)."""
    device = torch.device('cpu')
    args = train.model_args(cfg, train.vocab_size(cfg))
    model, engine = train.build(cfg, device, args)
    data = {s: train.load_split(train.data_dir(cfg), s) for s in ('train', 'val')}
    val = {'val': [train.windows(data['val'], rows, cfg['block_size'], device)
                   for rows in train.draw(data['val'], [cfg['seed'], 2], cfg['eval_iters'], cfg)]}
    autocast = torch.autocast('cpu', getattr(torch, cfg['dtype']))
    curve, seconds = [], 0.0
    for it in range(cfg['max_iters'] + 1):
        if it % every == 0 or it == cfg['max_iters']:
            curve.append((it, train.evaluate(engine, val, autocast, 0, 1)['val']))
        if it == cfg['max_iters']:
            break
        batches = train.train_batches(data['train'], it, cfg, 0, 1, device)
        t0 = time.perf_counter()
        train.train_step(engine, batches, train.get_lr(it, cfg), autocast)
        seconds += time.perf_counter() - t0
    states = sum(nbytes for _, nbytes in memory.counted_states(engine).values())
    return curve, states / engine.psi, cfg['max_iters'] * cfg['batch_size'] * cfg['block_size'] / seconds


def table(results, cfg, seeds, wall):
    base = sum(r['final'] for r in results['fp32 master + fp32 state (baseline)']) / len(seeds)
    lines = [f"Final val loss after {cfg['max_iters']} iterations ({cfg['n_layer']} layers x {cfg['n_embd']}, "
             f"{cfg['batch_size']} x {cfg['block_size']} characters per step, bf16 compute, lr {cfg['learning_rate']} -> "
             f"{cfg['min_lr']}, beta2 {cfg['beta2']}), mean ± half the spread over seeds {', '.join(map(str, seeds))}; "
             f"model-state bytes per param counted from the engine's tensors (1 rank, so nothing is sharded: "
             f"params + fp32 grad shard + master + moments); tokens/s of the training steps on this machine "
             f"({os.cpu_count()} cores, torch {torch.__version__}); {wall / 60:.0f} min in all.\n",
             "| pattern | final val loss | vs baseline | bytes/param | tokens/s |", "|---|---:|---:|---:|---:|"]
    for name, runs in results.items():
        finals = [r['final'] for r in runs]
        mean = sum(finals) / len(finals)
        lines.append(f"| {name} | {mean:.4f} ± {(max(finals) - min(finals)) / 2:.4f} | {mean - base:+.4f} | "
                     f"{runs[0]['bytes_per_param']:.2f} | {sum(r['tokens_per_s'] for r in runs) / len(runs):,.0f} |")
    return '\n'.join(lines) + '\n'


def plot(results, path):
    try:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    for name, runs in results.items():
        steps = [it for it, _ in runs[0]['curve']]
        mean = [sum(r['curve'][k][1] for r in runs) / len(runs) for k in range(len(steps))]
        for ax in axes:
            ax.plot(steps, mean, label=name, linestyle='--' if 'remainder' in name else '-')
    axes[0].set_title('val loss (mean over seeds)')
    half = len(steps) // 2
    axes[1].set_xlim(steps[half], steps[-1])
    axes[1].set_ylim(min(min(line.get_ydata()[half:]) for line in axes[1].lines) - 0.02,
                     max(max(line.get_ydata()[half:]) for line in axes[1].lines) + 0.02)
    axes[1].set_title('second half, zoomed')
    for ax in axes:
        ax.set_xlabel('iteration')
        ax.grid(alpha=0.3)
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('--quick', action='store_true', help="tiny model, 20 iterations, one seed: a smoke run")
    parser.add_argument('--seeds', default='1337,1338')
    parser.add_argument('--out', default=None, help="where the table and plot go (default: assets/; --quick: a new "
                                                    "temporary folder, not the study's committed table)")
    args = parser.parse_args()
    if args.out is None:
        args.out = (tempfile.mkdtemp(prefix='precision-quick-') if args.quick
                    else os.path.join(os.path.dirname(os.path.abspath(__file__)), 'assets'))
    study, seeds = (QUICK, [1337]) if args.quick else (STUDY, [int(s) for s in args.seeds.split(',')])
    os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(launch.free_port()))
    dist.init_process_group('gloo', rank=0, world_size=1)
    train.prepare_data({**train.DEFAULTS, **study}, 0, torch.device('cpu'))
    results, t0 = {}, time.time()
    for name, keys in PATTERNS.items():
        for seed in seeds:
            cfg = {**train.DEFAULTS, **study, **keys, 'seed': seed}
            train.check_config(cfg, 1)
            curve, per_param, speed = run(cfg, every=max(1, cfg['max_iters'] // 50))
            results.setdefault(name, []).append(dict(curve=curve, final=curve[-1][1], bytes_per_param=per_param, tokens_per_s=speed))
            print(f"{name}, seed {seed}: val loss {curve[0][1]:.4f} -> {curve[-1][1]:.4f}, {per_param:.2f} B/param, "
                  f"{speed:,.0f} tok/s", flush=True)
    os.makedirs(args.out, exist_ok=True)
    text = table(results, study, seeds, time.time() - t0)
    with open(os.path.join(args.out, 'precision.md'), 'w') as f:
        f.write(text + f"\n$ python study_precision.py{' --quick' if args.quick else ''}\n")
    plot(results, os.path.join(args.out, 'precision.png'))
    print(text)
    print(f"wrote {os.path.join(args.out, 'precision.md')}")
    launch.end_process_group(torch.device('cpu'))  # [Note: the end of a run]


if __name__ == '__main__':
    main()

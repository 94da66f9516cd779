"""
The estimator's command line: what each rank holds at each ZeRO stage (memory.py's arithmetic), before you rent the
GPUs ("use the lowest stage that fits").

    python zero.py estimate --params 70e9 --world 64                        # 1120 / 293.125 / 155.3125 / 17.5 GB
    python zero.py estimate --params 13e9 --world 8                         # 208 / 71.5 / 48.75 / 26 GB
    python zero.py estimate --config config/zero3.py --world 64 --gpu_gb 80 # as configured, and which stage fits

Units: GB = 1e9 bytes, as in the ZeRO paper and seed tables.
"""
import argparse
import math

import torch

from memory import (activations, communication, dtype_name, model_states, paper_states, pick_stage, stage_config,
                    stage_estimates, unit_sizes)


def estimate_table(psi, world, cfg, accum, k=12):
    """Markdown rows: the paper's model, then nanozero as configured, per stage; sizes in GB (1e9 bytes)."""
    rows = [f"Ψ = {psi:,.0f} params, N = {world} ranks, per rank, GB = 1e9 bytes",
            f"\nthe ZeRO paper (2Ψ bf16 params + 2Ψ bf16 grads + {k}Ψ optimizer state):\n",
            "| stage | params | grads | optimizer | total | sent per step |", "|---|---:|---:|---:|---:|---|"]
    sent_psi = {0: 'all-reduce 2Ψ', 1: 'reduce-scatter Ψ + all-gather Ψ = 2Ψ',
                2: f'reduce-scatter {accum}Ψ + all-gather Ψ = {accum + 1}Ψ', 3: f'{3 * accum}Ψ (all-gather {2 * accum}Ψ + reduce-scatter {accum}Ψ)'}
    for stage in range(4):
        s = paper_states(stage, psi, world, k)
        rows.append(f"| {stage} | " + ' | '.join(f"{v / 1e9:.7g}" for v in (*s.values(), sum(s.values())))
                    + f" | {sent_psi[stage]} |")
    rows += [f"\nnanozero as configured (params {dtype_name(cfg.param_dtype)}, reduce {dtype_name(cfg.reduce_dtype)}, "
             f"master_weights={cfg.precision.master_weights}, state_dtype={cfg.precision.state_dtype}; stage 0 is "
             f"torch DDP + AdamW on fp32 params):\n",
             "| stage | params | grads | master | exp_avg | exp_avg_sq | total | sent per step, GB |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    for stage in range(4):
        c = stage_config(cfg, stage)
        s = model_states(stage, psi, world, c)
        cells = [f"{s[name][1] / 1e9:.4g} {dtype_name(s[name][0])}" if name in s else '-'
                 for name in ('params', 'grads', 'master', 'exp_avg', 'exp_avg_sq')]
        sent = ', '.join(f"{kind} {nbytes / 1e9:.4g}" for kind, (_, nbytes) in communication(stage, psi, accum, c).items())
        rows.append(f"| {stage} | " + ' | '.join(cells) + f" | {sum(b for _, b in s.values()) / 1e9:.4g} | {sent} |")
    return '\n'.join(rows)


def main(argv):
    import train
    from model import GPT, GPTConfig
    parser = argparse.ArgumentParser(prog='python zero.py estimate', description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument('command', choices=['estimate'])
    parser.add_argument('--params', type=float, help="Ψ, trainable params, e.g. 70e9 (or give --config)")
    parser.add_argument('--config', help="a train.py config file: Ψ from its GPT, dtypes and batch from its keys")
    parser.add_argument('--set', action='append', default=[], metavar='KEY=VALUE', help="override a config key")
    parser.add_argument('--world', type=int, required=True, help="number of data-parallel ranks N")
    parser.add_argument('--gpu_gb', type=float, help="memory per rank, GB: also print which stage fits")
    parser.add_argument('--k', type=int, default=12, help="the paper's K: optimizer bytes per param")
    args = parser.parse_args(argv)
    if (args.params is None) == (args.config is None):
        parser.error("give exactly one of --params and --config")
    wrong = [f"--{k}={getattr(args, k)}: use a number above 0" for k in ('world', 'params', 'gpu_gb', 'k')
             if getattr(args, k) is not None and not 0 < getattr(args, k) < math.inf]  # (nan and inf too)
    if wrong:
        parser.error(wrong[0])
    try:  # a bad config or --set: one line, as train.py says it
        paper = {} if args.config else {'gradient_accumulation_steps': args.world}  # --params: a micro-step a rank
        cfg = train.parse_config(([args.config] if args.config else []) + [f'--{kv}' for kv in args.set],
                                 defaults={**train.DEFAULTS, 'dtype': 'bfloat16', **paper})  # bf16: the GPU default
        for problem in train.config_problems(cfg, 1)[:1]:  # train.py's value checks (not the device's, nor --world's)
            raise ValueError(problem)
        zcfg = train.zero_config(cfg)  # 'auto': stage 1's
    except ValueError as e:
        parser.error(str(e))
    accum = max(1, cfg['gradient_accumulation_steps'] // args.world)  # micro-steps a rank (1: the paper's)
    psi, act, block, root = args.params, None, 0, 0
    if args.config:
        with torch.device('meta'):
            model = GPT(GPTConfig(**train.model_args(cfg, train.vocab_size(cfg))))
        psi = sum(p.numel() for p in model.parameters() if p.requires_grad)
        block, root = unit_sizes(model, model.transformer.h)
        act = activations(cfg['n_layer'], cfg['n_embd'], model.config.vocab_size, cfg['batch_size'] * cfg['block_size'],
                          zcfg.param_dtype.itemsize, cfg['activation_checkpointing'])
    print(estimate_table(psi, args.world, zcfg, accum, args.k))
    if args.gpu_gb:
        if act is None:
            print("\n(activations and transient buffers need the model's shape: give --config to pick a stage)")
        else:
            stage, line = pick_stage(stage_estimates(psi, args.world, zcfg, act, block, root), args.gpu_gb * 1e9)
            print(f"\nactivations of one micro-batch ({cfg['batch_size']} x {cfg['block_size']} tokens): "
                  f"{act.peak() / 1e9:.3g} GB\n{line}")

"""
Does prefetch hide the network? Rank 0 of 8, 64 and 1024 ranks of GPT-2 1.5B (torch's fake process group), each
collective on a simulated link (comm.py, [Note: simulated link]), compute on a virtual clock --speedup times faster
than this CPU's (bench.py scale --speedup). Stage 2 (two bucket sizes) against stage 3 (prefetch 0/1/2,
reshard_after_forward on/off), over two links:

    python study_link.py --worlds 64 && python study_link.py --worlds 8,1024 --settings 0,3,4 --append

Writes assets/link_study.md, .json and .png. Each setting is one `bench.py scale` subprocess (bench_scale.run_kind),
timing one step (--quick): a warm-up, the step without a link (compute alone), then with each link.
"""
import argparse
import json
import os
import sys
import time

import bench_scale

LINKS = ('ib400', 'eth100')
SETTINGS = [  # (label, --set overrides)
    ('zero2 bucket 25 MB', ['zero_stage=2', 'bucket_mb=25']),
    ('zero2 bucket 500 MB', ['zero_stage=2', 'bucket_mb=500']),
    ('zero3 prefetch 0', ['zero_stage=3', 'prefetch=0']),
    ('zero3 prefetch 1', ['zero_stage=3', 'prefetch=1']),
    ('zero3 prefetch 2', ['zero_stage=3', 'prefetch=2']),
    ('zero3 prefetch 1, no reshard', ['zero_stage=3', 'prefetch=1', 'reshard_after_forward=False']),
]
# GPT-2 1.5B (GPT-2 XL), 64 tokens per rank: 12.6-13.8 s a step on this CPU (fp32, 1 micro-step), so --speedup 40
# (0.32-0.34 s) stands for an H100 at ~40% of its bf16 peak on ~14K tokens per rank:
# 6 x 1.555e9 FLOPs x 14,336 tokens / (0.4 x 989e12 FLOP/s) = 0.34 s a step
MODEL = ['n_layer=48', 'n_head=25', 'n_embd=1600', 'block_size=64', 'batch_size=1']


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument('--worlds', default='8,64,1024')
    parser.add_argument('--settings', default=None, help="comma-separated indices into SETTINGS (default: all)")
    parser.add_argument('--append', action='store_true', help="add to the rows already in OUT.json")
    parser.add_argument('--set', action='append', default=[], help="train.py config overrides, after the study's model")
    parser.add_argument('--speedup', default='40')
    parser.add_argument('--out', default='assets/link_study')
    cli = parser.parse_args()
    speedup = f"{bench_scale.parse_speedup(cli.speedup):.4g}"  # measured once: every setting uses the same factor
    if cli.append and not os.path.exists(cli.out + '.json'):  # before: a traceback after nothing was run
        sys.exit(f"--append: {cli.out}.json is not there yet: run once without --append")
    t0, rows = time.perf_counter(), json.load(open(cli.out + '.json')) if cli.append else []
    chosen = [SETTINGS[int(i)] for i in cli.settings.split(',')] if cli.settings else SETTINGS
    for world in [int(w) for w in cli.worlds.split(',')]:
        for label, overrides in chosen:
            kind = 'zero' + overrides[0][-1]
            args = argparse.Namespace(world=world, config='config/shakespeare_cpu.py', quick=True, build_only=False,
                                      link=list(LINKS), speedup=speedup, set=MODEL + cli.set + overrides[1:])
            t_setting = time.perf_counter()
            r = bench_scale.run_kind(kind, args)
            for x in r.get('links', []):
                rows.append(dict(world=world, setting=label, link=x['name'], step=x['step'], alone=x['alone'],
                                 exposed=x['blocked'], busy=x['busy'], psi=r['psi'], command=' '.join(sys.argv[1:]),
                                 seconds=time.perf_counter() - t_setting))
            print(f"{time.perf_counter() - t0:.0f} s: world {world}, {label}: "
                  + ('; '.join(f"{x['name']} exposed {x['blocked'] / x['step']:.0%}" for x in r.get('links', [])) or r.get('failed')),
                  flush=True)
            write(cli, speedup, rows)  # after each setting: a cut-off run keeps its rows


def write(cli, speedup, rows):
    psi = rows[0]['psi'] if rows else 0
    commands = list(dict.fromkeys(r['command'] for r in rows))  # each invocation that added rows (--append), in order
    seconds = sum({(r['world'], r['setting']): r['seconds'] for r in rows}.values())  # each setting once (2 links a row each)
    lines = ["# Does prefetch hide the network? (" + '; '.join(f"`python study_link.py {c}`" for c in commands) + ")", '',
             f"Rank 0 of N (fake process group), model `{' '.join(MODEL + cli.set)}` (Ψ = {psi / 1e6:.1f}M, fp32 on this CPU), "
             f"1 micro-step per rank; compute on a virtual clock {speedup}x faster than this CPU (--speedup {cli.speedup}), "
             f"links ib400 (50 GB/s, 5 µs/step) and eth100 (12.5 GB/s, 20 µs/step). Times in ms of the projected step; "
             f"exposed = blocked in waits; hidden = 1 - exposed / comm alone. One timed step per setting (--quick); {seconds / 60:.1f} min on 2 cores.", '',
             '| N | setting | link | step ms | compute ms | exposed ms (of step) | comm alone ms | hidden |',
             '|---:|---|---|---:|---:|---:|---:|---:|']
    for r in rows:
        hidden = 1 - r['exposed'] / r['busy'] if r['busy'] else 0.0
        lines.append(f"| {r['world']} | {r['setting']} | {r['link']} | {r['step'] * 1e3:.2f} | {r['alone'] * 1e3:.2f} | "
                     f"{r['exposed'] * 1e3:.2f} ({r['exposed'] / r['step']:.0%}) | {r['busy'] * 1e3:.2f} | {hidden:.0%} |")
    open(cli.out + '.md', 'w').write('\n'.join(lines) + '\n')
    open(cli.out + '.json', 'w').write(json.dumps(rows, indent=1))
    try:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)")
        return
    worlds = sorted({r['world'] for r in rows})
    fig, axes = plt.subplots(1, len(LINKS), figsize=(12, 4.5), sharey=True)
    for ax, link in zip(axes, LINKS):
        for label, _ in SETTINGS:
            ys = [next((r['exposed'] / r['step'] for r in rows if r['world'] == w and r['setting'] == label
                        and r['link'] == link), float('nan')) for w in worlds]
            ax.plot(worlds, ys, marker='o', label=label)
        ax.set_xscale('log', base=2)
        ax.set_xticks(worlds, [str(w) for w in worlds])
        ax.set_title(f"{link}: exposed communication, share of the step")
        ax.set_xlabel('ranks')
        ax.set_ylim(0, 1)
    axes[0].set_ylabel('exposed / step')
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(cli.out + '.png', dpi=110)


if __name__ == '__main__':
    main()

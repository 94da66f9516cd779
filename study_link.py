"""
Does prefetch hide the network? Rank 0 of 8, 64 and 1024 ranks (torch's fake process group), each collective on
a simulated link (comm.py, [Note: simulated link]), compute projected onto an H100 (bench.py scale --speedup h100:
a virtual clock, compute time divided by the H100's bf16 peak over this CPU's matmul FLOP/s). Stage 2 (two bucket
sizes) against stage 3 (prefetch 0/1/2, reshard_after_forward on/off), over two links:

    python study_link.py                    # writes assets/link_study.md and assets/link_study.png
    python study_link.py --set n_layer=48 --set n_head=25 --set n_embd=1600    # GPT-2 1.5B, if you have the hours

Each setting is one `bench.py scale` subprocess (bench_scale.run_kind), timing one step (--quick).
"""
import argparse
import json
import time

import bench_scale

LINKS = ('ib400', 'eth100')
SETTINGS = [  # (label, --set overrides)
    ('zero2 bucket 25 MB', ['zero_stage=2', 'bucket_mb=25']),
    ('zero2 bucket 4 MB', ['zero_stage=2', 'bucket_mb=4']),
    ('zero3 prefetch 0', ['zero_stage=3', 'prefetch=0']),
    ('zero3 prefetch 1', ['zero_stage=3', 'prefetch=1']),
    ('zero3 prefetch 2', ['zero_stage=3', 'prefetch=2']),
    ('zero3 prefetch 1, no reshard', ['zero_stage=3', 'prefetch=1', 'reshard_after_forward=False']),
]
MODEL = ['n_layer=4', 'n_head=4', 'n_embd=256', 'block_size=256', 'batch_size=1']


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument('--worlds', default='8,64,1024')
    parser.add_argument('--settings', default=None, help="comma-separated indices into SETTINGS (default: all)")
    parser.add_argument('--append', action='store_true', help="add to the rows already in OUT.json")
    parser.add_argument('--set', action='append', default=[], help="train.py config overrides, after the study's model")
    parser.add_argument('--speedup', default='h100')
    parser.add_argument('--out', default='assets/link_study')
    cli = parser.parse_args()
    speedup = f"{bench_scale.parse_speedup(cli.speedup):.4g}"  # measured once: every setting uses the same factor
    t0, rows = time.perf_counter(), json.load(open(cli.out + '.json')) if cli.append else []
    chosen = [SETTINGS[int(i)] for i in cli.settings.split(',')] if cli.settings else SETTINGS
    for world in [int(w) for w in cli.worlds.split(',')]:
        for label, overrides in chosen:
            kind = 'zero' + overrides[0][-1]
            args = argparse.Namespace(world=world, config='config/shakespeare_cpu.py', quick=True, link=list(LINKS),
                                      speedup=speedup, set=MODEL + cli.set + overrides[1:])
            r = bench_scale.run_kind(kind, args)
            for x in r.get('links', []):
                rows.append(dict(world=world, setting=label, link=x['name'], step=x['step'], alone=x['alone'],
                                 exposed=x['blocked'], busy=x['busy'], psi=r['psi']))
            print(f"{time.perf_counter() - t0:.0f} s: world {world}, {label}: "
                  + ('; '.join(f"{x['name']} exposed {x['blocked'] / x['step']:.0%}" for x in r.get('links', [])) or r.get('failed')),
                  flush=True)
            write(cli, speedup, rows, time.perf_counter() - t0)  # after each setting: a cut-off run keeps its rows


def write(cli, speedup, rows, seconds):
    psi = rows[0]['psi'] if rows else 0
    lines = [f"# Does prefetch hide the network? (`python study_link.py {' '.join('--set ' + s for s in cli.set)}`)", '',
             f"Rank 0 of N (fake process group), model `{' '.join(MODEL + cli.set)}` (Ψ = {psi / 1e6:.1f}M, fp32 on this CPU), "
             f"1 micro-step per rank; compute projected onto an H100: --speedup {speedup} (989 TFLOP/s / this CPU's "
             f"measured matmul FLOP/s), links ib400 (50 GB/s, 5 µs/step) and eth100 (12.5 GB/s, 20 µs/step). "
             f"Times in ms of the projected step; exposed = blocked in waits; hidden = 1 - exposed / comm alone. "
             f"{seconds / 60:.1f} min on 2 shared cores.", '',
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

"""
train.py itself, timed: each variant of a config runs as its own train.py job (torchrun, a fresh process group),
the variants take turns, and each one's tokens/s, step time, MFU and peak memory are read from what it prints:

    python bench.py train --vary zero_stage=2,3                     # CPU: config/shakespeare_cpu.py, 2 gloo ranks
    python bench.py train --vary zero_stage=2,3 --set compile=True --runs=3
    python bench.py train --config=config/zero3.py --vary zero_stage=2,3 --vary compile=False,True \\
        --set gradient_accumulation_steps=4                         # every GPU of the machine: issue 17's table

--vary KEY=A,B,... (repeatable) makes the variants: every combination, the first one the baseline. Per variant:
tokens/s and step time, the median (p25-p75) over every run's iterations after --warm (compilation and the allocator's
first steps fall in those); their ratio to the baseline, the median over runs of each run's ratio (a round runs every
variant back to back, so a slow spell of a shared machine slows them alike); MFU where train.py knows the GPU's peak;
and peak memory: on CUDA `max_memory_allocated` at the last iteration (train.py's line, rank 0), on a CPU the peak RSS
of the largest process of the job (torchrun's tree, as the kernel reports it to os.wait4).
bench.py zero times the same step in one process, every kind in turn, and counts bytes; this is what a user of
train.py sees, the whole run in its own processes.
"""
import itertools
import os
import re
import shutil
import subprocess
import sys
import tempfile

import torch

import train
from bench_zero import QUARTILES, paired_ratio

ROOT = os.path.dirname(os.path.abspath(__file__))


def variants(vary):
    """['zero_stage=2,3', 'compile=False,True'] -> [['--zero_stage=2', '--compile=False'], ...]: the first, the baseline."""
    axes = []
    for spec in vary:
        key, sep, values = spec.partition('=')
        if not sep or not values:
            raise ValueError(f"--vary {spec}: expected KEY=VALUE,VALUE,... e.g. --vary zero_stage=2,3")
        axes.append([f'--{key}={value}' for value in values.split(',')])
    return [list(combo) for combo in itertools.product(*axes)] or [[]]


def parse_log(log, warm):
    """What train.py printed: per iteration after `warm`, (tok/s, step ms, mfu or None); the device; the peak GiB."""
    iters = []
    for line in log.splitlines():
        m = re.match(r'iter (\d+): .*time ([\d.]+)ms, tok/s ([\d,]+)', line)
        if m and int(m.group(1)) > warm:
            mfu = re.search(r', mfu ([\d.]+)%', line)
            iters.append((float(m.group(3).replace(',', '')), float(m.group(2)), mfu and float(mfu.group(1))))
    device = re.search(r'world size (\d+) \((\w+)\), device (\S+),', log)
    peak = re.findall(r'cuda max_memory_allocated after iteration \d+: ([\d.]+) GiB', log)
    return iters, device and device.group(0)[:-1], float(peak[-1]) if peak else None


def run(cmd):
    """(exit code, stdout + stderr, peak RSS in GiB of the largest process of cmd's tree that was waited for). Linux
    starts a child's high-water mark at its parent's RSS when it forks: bench.py's own ~0.26 GiB is a floor."""
    with tempfile.TemporaryFile('w+') as out:  # a file, not a pipe: os.wait4 reaps the job, nothing reads while it runs
        job = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT, text=True,
                               env={**os.environ, 'PYTHONUNBUFFERED': '1'})  # whole lines: ranks share the file
        _, status, usage = os.wait4(job.pid, 0)  # ru_maxrss: the job's own or its largest child's
        job.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        return job.returncode, out.read(), usage.ru_maxrss / (2**30 if sys.platform == 'darwin' else 2**20)  # macOS: bytes


def run_job(args, variant, nproc, out_dir):
    """One train.py job: (its log, the peak RSS of its largest process, GiB)."""
    cmd = [sys.executable, '-m', 'torch.distributed.run', '--standalone', f'--nproc_per_node={nproc}', 'train.py',
           args.config, *[f'--{kv}' for kv in args.set], *variant, f'--max_iters={args.iters}', '--log_interval=1',
           f'--eval_iters={nproc}', f'--eval_interval={args.iters + 1}', f'--out_dir={out_dir}']  # evals at 0 and the end
    code, log, rss = run(cmd)
    shutil.rmtree(out_dir, ignore_errors=True)  # the final eval's checkpoint: GBs for GPT-2, of no use here
    if code != 0:
        raise RuntimeError(f"train.py {' '.join(variant)} exited with {code}:\n{log[-3000:]}\n$ {' '.join(cmd)}")
    return log, rss


def bench_train(args):
    try:  # a bad key or value: one line now, not a traceback from the first job
        cfg = train.parse_config([args.config] + [f'--{kv}' for kv in args.set])
        if args.nproc is not None and args.nproc < 1:  # before: 0 ran the default, -2 a traceback from torchrun
            raise ValueError(f"--nproc={args.nproc}: use at least 1")
        cuda = cfg['device'].split(':')[0] == 'cuda'  # as check_config reads it: device=tpu is its one line, below
        nproc = args.nproc or (max(1, torch.cuda.device_count()) if cuda else 2)  # no GPU: check_config says so
        combos = variants(args.vary)
        if args.warm >= args.iters or args.runs < 1:
            raise ValueError(f"--warm={args.warm}, --iters={args.iters}, --runs={args.runs}: every job needs a timed "
                             "iteration (warm < iters) and every variant a run (runs >= 1)")
        for variant in combos:
            train.check_config(train.parse_config([args.config] + [f'--{kv}' for kv in args.set] + variant), nproc)
    except ValueError as e:
        sys.exit(f"bench.py train: {e}")
    runs = {i: [] for i in range(len(combos))}  # variant -> [(iterations, peak GiB)], one per run
    device = None
    with tempfile.TemporaryDirectory() as tmp:  # checkpoints of the final eval, thrown away
        for r in range(args.runs):
            for i in [(r + k) % len(combos) for k in range(len(combos))]:  # rotate the order each round
                log, rss = run_job(args, combos[i], nproc, os.path.join(tmp, f'{r}-{i}'))  # a fresh out_dir: no resume
                iters, device, peak = parse_log(log, args.warm)
                if not iters:
                    raise RuntimeError(f"train.py {' '.join(combos[i])}: no iteration after --warm={args.warm}:\n{log[-2000:]}")
                runs[i].append((torch.tensor([it[:2] for it in iters], device='cpu'),  # fp32, as QUARTILES
                                [it[2] for it in iters], peak if cuda else rss))
                print(f"run {r + 1}/{args.runs}: {' '.join(combos[i]) or 'the config'} done", file=sys.stderr, flush=True)
    report(args, combos, runs, device, nproc, cuda)


def report(args, combos, runs, device, nproc, cuda):
    sets = ' '.join(f'--set {kv}' for kv in args.set)
    print(f"\n$ python bench.py train --config={args.config} {sets} {' '.join('--vary ' + v for v in args.vary)} "
          f"--iters={args.iters} --warm={args.warm} --runs={args.runs}")
    print(f"{device}; torchrun --nproc_per_node={nproc}; torch {torch.__version__}; iterations {args.warm + 1}-{args.iters}"
          f" of each run\n")
    memory = 'max_memory_allocated GiB' if cuda else 'peak RSS GiB (largest process)'
    print(f"| variant | tok/s: median (p25-p75) | step ms | vs first | mfu | {memory} | vs first |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    median_tok = {i: torch.stack([r[0][:, 0].median() for r in runs[i]]) for i in runs}  # (runs,) each

    def vs_first(i):
        low, mid, high = paired_ratio(median_tok[i], median_tok[0])
        return f"{mid:.2f}x" + (f" ({low:.2f}-{high:.2f})" if args.runs > 1 else '')

    for i, variant in enumerate(combos):
        every = torch.cat([r[0] for r in runs[i]])  # (iterations, 2): tok/s, ms
        low, mid, high = every[:, 0].quantile(QUARTILES).tolist()
        mfus = [x for r in runs[i] for x in r[1] if x is not None]
        peaks = [r[2] for r in runs[i]]
        print(f"| {' '.join(v[2:] for v in variant) or 'the config'} | {mid:,.0f} ({low:,.0f}-{high:,.0f}) "
              f"| {every[:, 1].median().item():.1f} | {vs_first(i)} "
              f"| {f'{sorted(mfus)[len(mfus) // 2]:.1f}%' if mfus else '–'} "
              f"| {max(peaks):.3f} | {max(peaks) / max(r[2] for r in runs[0]):.3f}x |")


def add_arguments(parser):
    parser.add_argument('--vary', action='append', default=[], metavar='KEY=A,B',
                        help="train: a config key's values to compare, comma-separated (so a value cannot hold a comma); repeatable: "
                        "every combination, the first the baseline")
    parser.add_argument('--runs', type=int, default=1, help="train: jobs of each variant, taking turns")
    parser.add_argument('--iters', type=int, default=30, help="train: iterations of each job (max_iters)")
    parser.add_argument('--warm', type=int, default=10, help="train: the first iterations, not timed (compilation)")
    parser.add_argument('--nproc', type=int, default=None, help="train: ranks per job (default: the GPUs, or 2 on a CPU)")

"""
Kernel variants timed in turns: each argument a folder holding a csrc/ (e.g. `git archive REV csrc | tar x -C DIR`,
or a copy of csrc/ with one change), the first the baseline. Each variant is first checked bit for bit against the
first (the int8 modes, 3 steps, 1M elements on a GPU, normal grads and zero/tiny/huge ones); then every int8 mode and
the fp32-master one are timed at 16M and 256M elements, all variants in turns on the same buffers, and printed as ms
and fraction of the copy bandwidth measured in the same run (bench.copy_bandwidth). `bench.py kernels --modes
--against REV` does the same for one other kernel and every mode; this is for trying several builds in one GPU call.

    DEV=cuda python .ci/kernel_variants.py out-var/base out-var/try1 out-var/try2
"""
import functools, os, sys, time
from concurrent.futures import ThreadPoolExecutor
import torch
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench, kernels
dev = torch.device(os.environ.get('DEV', 'cuda')); impl = dev.type
folders = sys.argv[1:]
names = [f.rstrip('/').split('/')[-1] for f in folders]
kernels.resolve_impl(impl, dev)
t0 = time.time()
with ThreadPoolExecutor(8) as ex:
    libs = dict(zip(names, ex.map(lambda f: bench.library_at(f + '/csrc', impl), folders)))
print(f'built {len(libs)} in {time.time() - t0:.0f} s', flush=True)
hp = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
modes = [m for m in bench.PRECISION_MODES if m[3] == torch.uint8 or m is bench.PRECISION_MODES[0]]

def make(n, mode, seed=0, weird=False):
    name, md, pd, sd, stoch = mode
    g = torch.Generator(device=dev).manual_seed(seed)
    w = torch.randn(n, device=dev, generator=g)
    grad = torch.randn(n, device=dev, generator=g)
    if weird:  # zeros, tiny and huge grads: sqrt's and the divide's slow paths, zero blocks
        grad[: n // 8] = 0; grad[n // 8: n // 4] *= 1e-30; grad[n // 4: n // 4 + 1000] *= 1e30
    master = None if md is None else (w.clone() if md == torch.float32 else torch.zeros(n, device=dev, dtype=md))
    param = None if pd is None else w.to(pd)
    state = [torch.zeros(n, device=dev, dtype=sd) for _ in range(2)]
    am = [torch.zeros(n // 256, device=dev) for _ in range(2)] if sd == torch.uint8 else None
    return dict(master=master, param=param, grad=grad, state=state, am=am, stoch=stoch)

def run(b, step):
    kernels.adamw_step(b['master'], b['grad'], *b['state'], b['param'], torch.zeros(1, device=dev), decay_numel=b['grad'].numel() * 3 // 4,
                       step=step, absmax=b['am'], impl=impl, rounding_seed=1234 if b['stoch'] else None, **hp)

def flat(b):
    ts = [b['master'], b['param'], *b['state'], *(b['am'] or [])]
    return [t.view(torch.uint8) if t.dtype != torch.uint8 else t for t in ts if t is not None]

ok = {}
for name in names:
    good = True
    for mode in modes[1:]:
        for weird in (False, True):
            outs = []
            for lib in (libs[names[0]], libs[name]):
                b = make((1 << (20 if impl == 'cuda' else 16)) + 256 * 3, mode, weird=weird)
                for s in range(1, 4):
                    bench.with_library(impl, lib, functools.partial(run, b, s))
                outs.append(flat(b))
            good &= all(torch.equal(x, y) for x, y in zip(*outs))
    ok[name] = good
print('bit for bit vs', names[0], ok, flush=True)
for n in ((1 << 24, 1 << 28) if impl == 'cuda' else (1 << 20,)):
    fns = {}
    for mode in modes:
        b = make(n, mode)
        for name in names:
            fns[mode[0], name] = functools.partial(bench.with_library, impl, libs[name], functools.partial(run, b, 10))
    ms = bench.time_ms(fns, dev, repeats=max(10, min(60, 2**26 // n)))
    copy = bench.copy_bandwidth(dev, 1 << 26)
    print(f'n {n:,} copy {copy:.0f} GB/s; ms and of-copy per variant')
    print(f"{'mode':<32}" + ''.join(f'{nm:>14}' for nm in names))
    for mode in modes:
        moved = bench.bytes_moved(mode[1], mode[2], mode[3], torch.float32)
        print(f'{mode[0]:<32}' + ''.join(f"{ms[mode[0], nm]:>8.3f} {moved * n / ms[mode[0], nm] / 1e6 / copy:>5.2f}" for nm in names), flush=True)
    del fns, b
    torch.cuda.empty_cache()

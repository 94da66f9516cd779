"""
Kernel variants timed in turns: each argument a folder holding a csrc/ (e.g. `git archive REV csrc | tar x -C DIR`,
or a copy of csrc/ with one change), the first the baseline. Each variant is first checked bit for bit against the
first (the int8 modes, 3 steps, 1M elements on a GPU, normal grads and zero/tiny/huge ones); then every int8 mode and
the fp32-master one are timed at 16M and 256M elements, all variants in turns on the same buffers, and printed as ms
and fraction of the copy bandwidth measured in the same run (bench.copy_bandwidth). `bench.py kernels --modes
--against REV` does the same for one other kernel and every mode; this is for trying several builds in one GPU call.

    DEV=cuda python .ci/kernel_variants.py out-var/base out-var/try1 out-var/try2
"""
import functools
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import bench  # noqa: E402
import kernels  # noqa: E402

HP = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1)
MODES = [m for m in bench.PRECISION_MODES if m[3] == torch.uint8 or m is bench.PRECISION_MODES[0]]  # int8 + fp32


def make(n, mode, device, weird=False):
    """One shard's tensors in `mode`; weird: zero, tiny and huge grads (sqrt's and the divide's slow paths, and
    all-zero blocks)."""
    _, master_dtype, param_dtype, state_dtype, stochastic = mode
    g = torch.Generator(device=device).manual_seed(0)
    w = torch.randn(n, device=device, generator=g)
    grad = torch.randn(n, device=device, generator=g)
    if weird:
        grad[:n // 8] = 0
        grad[n // 8:n // 4] *= 1e-30
        grad[n // 4:n // 4 + 1000] *= 1e30
    master = None if master_dtype is None else (
        w.clone() if master_dtype == torch.float32 else torch.zeros(n, device=device, dtype=master_dtype))
    return dict(master=master, param=None if param_dtype is None else w.to(param_dtype), grad=grad,
                state=[torch.zeros(n, device=device, dtype=state_dtype) for _ in range(2)],
                absmax=[torch.zeros(n // 256, device=device) for _ in range(2)] if state_dtype == torch.uint8 else None,
                stochastic=stochastic)


def run(b, step, impl):
    kernels.adamw_step(b['master'], b['grad'], *b['state'], b['param'], torch.zeros(1, device=b['grad'].device),
                       decay_numel=b['grad'].numel() * 3 // 4, step=step, absmax=b['absmax'], impl=impl,
                       rounding_seed=1234 if b['stochastic'] else None, **HP)


def as_bytes(b):
    tensors = [b['master'], b['param'], *b['state'], *(b['absmax'] or [])]
    return [t.view(torch.uint8) for t in tensors if t is not None]


def main(folders, device):
    impl, names = device.type, [f.rstrip('/').split('/')[-1] for f in folders]
    kernels.resolve_impl(impl, device)
    t0 = time.time()
    with ThreadPoolExecutor(8) as pool:
        libs = dict(zip(names, pool.map(lambda f: bench.library_at(f + '/csrc', impl), folders)))
    print(f'built {len(libs)} in {time.time() - t0:.0f} s', flush=True)
    same = {}
    for name in names:  # each variant against the first, bit for bit: 3 steps of every int8 mode
        same[name] = True
        for mode in MODES[1:]:
            for weird in (False, True):
                outs = []
                for lib in (libs[names[0]], libs[name]):
                    b = make((1 << (20 if impl == 'cuda' else 16)) + 256 * 3, mode, device, weird)
                    for step in (1, 2, 3):
                        bench.with_library(impl, lib, functools.partial(run, b, step, impl))
                    outs.append(as_bytes(b))
                same[name] &= all(torch.equal(x, y) for x, y in zip(*outs))
    print('bit for bit vs', names[0], same, flush=True)
    for n in ((1 << 24, 1 << 28) if impl == 'cuda' else (1 << 20,)):
        fns = {}
        for mode in MODES:
            b = make(n, mode, device)
            for name in names:
                fns[mode[0], name] = functools.partial(bench.with_library, impl, libs[name],
                                                       functools.partial(run, b, 10, impl))
        ms = bench.time_ms(fns, device, repeats=max(10, min(60, 2**26 // n)))
        copy = bench.copy_bandwidth(device, 1 << 26)
        print(f'n {n:,} copy {copy:.0f} GB/s; ms and of-copy per variant')
        print(f"{'mode':<32}" + ''.join(f'{name:>14}' for name in names))
        for mode in MODES:
            moved = bench.bytes_moved(mode[1], mode[2], mode[3], torch.float32) * n
            print(f'{mode[0]:<32}' + ''.join(f"{ms[mode[0], name]:>8.3f} {moved / ms[mode[0], name] / 1e6 / copy:>5.2f}"
                                             for name in names), flush=True)
        del fns, b
        if impl == 'cuda':
            torch.cuda.empty_cache()


if __name__ == '__main__':
    main(sys.argv[1:], torch.device(os.environ.get('DEV', 'cuda')))

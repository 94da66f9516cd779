"""
Tests for kernels.py: the reference is torch.optim.AdamW (and, for 8-bit state, close to torchao's AdamW8bit), and
each kernel is the reference in every storage-precision mode.

    python -m pytest -q test_kernels.py

The first run builds the CPU library and the host-emulated CUDA library (~3 s each, cached in ~/.cache/nanozero/ or
$NANOZERO_CACHE); later runs only load them. The torchao test needs `pip install --no-deps torchao==0.18.0`.
"""
import contextlib
import ctypes
import functools
import hashlib
import itertools
import os
import re
import shutil
import subprocess
import sys
import warnings
from unittest import mock

import pytest
import torch

import kernels
import library

HP = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8)
# Kernel vs reference, fp32 outputs: rtol 1e-6 is ~8 ulps. The kernels round every op correctly; the reference
# does not quite: torch's CPU sqrt is an ulp off for ~15% of inputs. That moves the master by about an ulp per step.
# atol only matters where master * decay - update cancels to ~0: the operands are then as small as one update,
# <= lr / (1 - beta1) = 1e-2 (as |exp_avg| <~ sqrt(exp_avg_sq)), whose ulp is ~1e-9: 1e-8 is ~8 of those ulps.
TOL = dict(rtol=1e-6, atol=1e-8)

# 'cuda-emulated' is the CUDA source compiled for the host (below): it runs wherever g++ does, GPU or not.
# The real 'cuda' cases exist only where a GPU is.
KERNELS = ["cpu", "cuda-emulated"] + (["cuda"] if torch.cuda.is_available() else [])
ALL_IMPLS = ["reference"] + KERNELS

# the storage-precision modes: weights -> (master dtype, param dtype, stochastic rounding); moments; grads
WEIGHTS = {"fp32": (torch.float32, None, False), "fp32+fp32param": (torch.float32, torch.float32, False),
           "fp32+bf16param": (torch.float32, torch.bfloat16, False), "fp32+fp16param": (torch.float32, torch.float16, False),
           "remainder": (torch.int16, torch.bfloat16, False), "none": (None, torch.bfloat16, False),
           "none-stochastic": (None, torch.bfloat16, True)}
STATES = {"fp32": torch.float32, "bf16": torch.bfloat16, "uint8": torch.uint8}
GRADS = {"fp32grad": torch.float32, "bf16grad": torch.bfloat16}


def device_of(impl):
    return torch.device("cuda" if impl == "cuda" else "cpu")


def bits(t):
    """A tensor's bit patterns as integers, so == compares bits (NaN == NaN, -0 != +0)."""
    return t.cpu().view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.itemsize])


def same_bits(a, b):
    return torch.equal(bits(a), bits(b))


def from_bits(values):
    """fp32 tensor with the given 32-bit patterns (Python ints)."""
    return kernels._from_unsigned(torch.tensor(values, dtype=torch.int64) & 0xFFFFFFFF, torch.float32)


class Shard:
    """One shard's optimizer tensors in one storage mode, made from the same fp32 weights and moments whatever the mode."""

    def __init__(self, n, weights="fp32+bf16param", state="fp32", seed=0):
        master_dtype, param_dtype, stochastic = WEIGHTS[weights]
        gen = torch.Generator().manual_seed(seed)
        w = torch.randn(n, generator=gen)
        m = 0.1 * torch.randn(n, generator=gen)
        v = m.square() + 0.01 * torch.rand(n, generator=gen)  # >= m^2, as Adam's moments are
        if master_dtype == torch.int16:
            self.param, self.master = kernels.split_master(w)
        elif master_dtype == torch.float32:
            self.master, self.param = w, None if param_dtype is None else kernels.cast_param(w, param_dtype)
        else:
            self.master, self.param = None, w.bfloat16()
        self.absmax = None
        if state == "uint8":
            (self.exp_avg, absmax_m), (self.exp_avg_sq, absmax_v) = kernels.quantize(m, True), kernels.quantize(v, False)
            self.absmax = (absmax_m, absmax_v)
        else:
            self.exp_avg, self.exp_avg_sq = m.to(STATES[state]), v.to(STATES[state])
        self.seed = 1234 if stochastic else None

    def to(self, device):
        """A copy on device."""
        other = object.__new__(Shard)
        for name, value in vars(self).items():
            move = lambda t: t.to(device, copy=True)
            setattr(other, name, None if value is None else tuple(map(move, value)) if isinstance(value, tuple)
                    else move(value) if isinstance(value, torch.Tensor) else value)
        return other

    def tensors(self):
        return [t for t in (self.master, self.exp_avg, self.exp_avg_sq, self.param, *(self.absmax or ())) if t is not None]

    def weights(self):
        """The fp32 weights, whatever the mode stores."""
        if self.master is None:
            return self.param.float()
        return kernels.join_master(self.param, self.master) if self.master.dtype == torch.int16 else self.master

    def step(self, impl, grad, **kw):
        """One adamw_step of impl; returns found_inf."""
        found_inf = torch.zeros(1, device=grad.device)
        adamw(impl, self.master, grad, self.exp_avg, self.exp_avg_sq, self.param, found_inf, absmax=self.absmax,
              rounding_seed=self.seed, **{**HP, **kw})
        return found_inf.item()


def adamw(impl, *tensors, **hp):
    """kernels.adamw_step(*tensors, impl=impl, **hp), or the same call into the host-emulated CUDA kernel."""
    if impl != "cuda-emulated":
        return kernels.adamw_step(*tensors, impl=impl, **hp)
    with cuda_library_on_host():
        kernels.adamw_step(*tensors, impl="cpu", **hp)


def spiky_grad(n, gen):
    """Normal grads plus one large one per 256-element block, at a different place in each (block 0: its last element),
    so the absmax of the 8-bit moments sits at every kind of position, not where the random data happens to put it."""
    grad = torch.randn(n, generator=gen)
    block = torch.arange(n // 256)
    grad[block * 256 + (255 - 61 * block) % 256] = 30.0 * (1 - 2 * (block % 2))  # 255, 194, 133, 72, 11, 206, ...
    return grad


def step_both(impl, shard, ref, grad, **kw):
    """One step of impl on shard and of the reference on ref (on the CPU, so the reference is always torch's CPU ops)."""
    assert shard.step(impl, grad.to(device_of(impl)), **kw) == 0.0
    assert ref.step("reference", grad.cpu(), **kw) == 0.0

# ----------------------------------------------------------------------------
# the reference is torch's AdamW


HUGE_PAGES_PROBE = """
import sys
import torch
for name in sys.argv[1:]:
    __import__(name)
x = torch.empty(2 ** 24)  # 64 MB, touched
x.fill_(1.0)
print(sum(int(line.split()[1]) for line in open('/proc/self/smaps') if line.startswith('AnonHugePages')))
"""


@pytest.mark.skipif(not os.path.exists('/proc/self/smaps'), reason="reads Linux's /proc/self/smaps")
def test_importing_kernels_gives_cpu_tensors_huge_pages_before_anything_allocates():
    """[Note: huge pages on CPU]: train.py and the benches import kernels before their first CPU tensor, and kernels
    turns on torch's huge-page allocations before its own tables. Checked by the kB of huge pages a touched 64 MB
    tensor gets: with the import, without it, and with the user's own THP_MEM_ALLOC_ENABLE=0. Where the kernel's
    transparent huge pages are off ('never'), no process gets any, and the import must still set the variable."""
    def huge_kb(*modules, **env):
        out = subprocess.run([sys.executable, '-c', HUGE_PAGES_PROBE, *modules], capture_output=True, text=True,
                             check=True, cwd=os.path.dirname(os.path.abspath(__file__)), env={**os.environ, **env})
        return int(out.stdout.split()[-1])
    plain_env = {k: v for k, v in os.environ.items() if k != 'THP_MEM_ALLOC_ENABLE'}
    with mock.patch.dict(os.environ, plain_env, clear=True):
        assert os.environ.get('THP_MEM_ALLOC_ENABLE') is None
        imported, plain, refused = huge_kb('kernels'), huge_kb(), huge_kb('train', THP_MEM_ALLOC_ENABLE='0')
    mode = open('/sys/kernel/mm/transparent_hugepage/enabled').read() if os.path.exists(
        '/sys/kernel/mm/transparent_hugepage/enabled') else '[never]'
    if '[never]' in mode:  # no huge pages to be had: the import can only ask
        assert imported == plain == refused == 0 and os.environ.get('THP_MEM_ALLOC_ENABLE') == '1'
        return
    assert imported >= 32 * 1024, f"{imported} kB of huge pages for a 64 MB tensor after importing kernels"
    if '[madvise]' in mode:  # only those who ask get them ('always': everyone)
        assert plain == 0 and refused == 0, (plain, refused)


MMAP_PROBE = """
import ctypes, sys
import torch
for name in sys.argv[1:]:
    __import__(name)
class Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ('arena', 'ordblks', 'smblks', 'hblks', 'hblkhd', 'usmblks',
                                                   'fsmblks', 'uordblks', 'fordblks', 'keepcost')]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Mallinfo2
x = torch.ones(6 * 2 ** 20)  # 24 MB: mapped, and freed (glibc's threshold would follow it up to 24 MB)
del x
before = libc.mallinfo2().hblkhd  # bytes in buffers with a mapping of their own
y = torch.ones(5 * 2 ** 20)  # 20 MB
libc.malloc.restype = ctypes.c_void_p
assert libc.mallinfo2().fordblks < 15 * 2 ** 20  # no free chunk can hold the next buffer: it comes from the heap's top
libc.free(ctypes.c_void_p(libc.malloc(15 * 2 ** 20)))
print(libc.mallinfo2().hblkhd - before, libc.mallinfo2().keepcost)  # keepcost: the heap's free top, kept (not trimmed)
"""


@pytest.mark.skipif(not hasattr(ctypes.CDLL(None), 'mallinfo2') or 'LD_PRELOAD' in os.environ,
                    reason="glibc's allocator (mallinfo2, glibc >= 2.33), not one preloaded in its place")
def test_importing_kernels_keeps_buffers_of_16_mib_and_more_out_of_glibcs_heap():
    """[Note: the host allocator's mmap threshold]: after a 24 MB buffer is freed, a 20 MB one still gets a mapping of
    its own (returned to the OS when freed) once kernels is imported, and 15 MiB freed at the heap's top stay in the
    process (the trim threshold); without the import glibc's moving threshold puts the 20 MB in the heap, and a user's
    own threshold (64 MiB here, by MALLOC_MMAP_THRESHOLD_ or GLIBC_TUNABLES) wins over ours."""
    def mapped(*modules, **env):
        out = subprocess.run([sys.executable, '-c', MMAP_PROBE, *modules], capture_output=True, text=True, check=True,
                             cwd=os.path.dirname(os.path.abspath(__file__)), env={**os.environ, **env})
        mapped, kept = map(int, out.stdout.split()[-2:])
        kept_tops.append(kept)
        return mapped
    kept_tops = []
    plain_env = {k: v for k, v in os.environ.items() if k not in ('MALLOC_MMAP_THRESHOLD_', 'GLIBC_TUNABLES')}
    with mock.patch.dict(os.environ, plain_env, clear=True):
        imported, plain = mapped('kernels'), mapped()
        users = mapped('train', MALLOC_MMAP_THRESHOLD_=str(64 * 2 ** 20))
        tunable = mapped('train', GLIBC_TUNABLES=f'glibc.malloc.mmap_threshold={64 * 2 ** 20}')
    assert imported >= 20 * 2 ** 20 > max(plain, users, tunable), (imported, plain, users, tunable)
    assert kept_tops[0] >= 15 * 2 ** 20, kept_tops  # ours: the trim threshold at 32 MiB too, a freed 15 MiB kept


def test_reference_matches_torch_adamw_exactly_over_steps():
    torch.manual_seed(0)
    weight = torch.nn.Parameter(torch.randn(8, 5))  # >= 2-D: decayed
    bias = torch.nn.Parameter(torch.randn(7))       # 1-D: not decayed
    opt = torch.optim.AdamW([{"params": [weight], "weight_decay": 0.1}, {"params": [bias], "weight_decay": 0.0}],
                            lr=HP["lr"], betas=(HP["beta1"], HP["beta2"]), eps=HP["eps"])
    # the ZeRO layout: [decayed | not decayed] in one flat shard
    master = torch.cat([weight.detach().flatten(), bias.detach()])  # (47,)
    exp_avg, exp_avg_sq, param = torch.zeros(47), torch.zeros(47), torch.empty(47)
    found_inf = torch.zeros(1)
    for step in range(1, 6):
        grad = torch.randn(47)
        weight.grad, bias.grad = 0.5 * grad[:40].view(8, 5), 0.5 * grad[40:]  # torch gets the unscaled grad
        opt.step()
        kernels.adamw_step_reference(master, grad, exp_avg, exp_avg_sq, param, found_inf, **HP, weight_decay=0.1,
                                     decay_numel=40, step=step, grad_scale=0.5)
        torch.testing.assert_close(master, torch.cat([weight.detach().flatten(), bias.detach()]), rtol=0, atol=0)
        for name, ours in (("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
            theirs = torch.cat([opt.state[weight][name].flatten(), opt.state[bias][name]])
            torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
        torch.testing.assert_close(param, master, rtol=0, atol=0)
    assert found_inf.item() == 0.0

# ----------------------------------------------------------------------------
# the definitions: bf16 roundings, the remainder split, stochastic rounding, the 8-bit code

EDGE_BITS = [0x3F808000, 0xBF808000, 0x3F818000, 0x3F807FFF, 0x3F808001,  # ties (+-), the tie above an odd bf16, near ties
             0x7F7F7FFF, 0x7F7F8000, 0x7F7FFFFF, 0xFF7FFFFF,  # below and at the tie past the largest finite bf16
             0x00000001, 0x00008000, 0x80008000, 0x007FFFFF,  # denormals, incl. ties
             0x00000000, 0x80000000, 0x7F800000, 0xFF800000,  # +-0, +-inf
             0x7FC00000, 0x7F800001, 0x7FFF8000, 0xFFFFFFFF]  # NaNs: quiet, one that could carry into inf, all ones


def test_cast_param_bf16_rounds_ties_away_from_zero_and_keeps_nan():
    x = from_bits(EDGE_BITS)
    out = kernels.cast_param(x, torch.bfloat16)
    expected = [0x3F81, 0xBF81, 0x3F82, 0x3F80, 0x3F81, 0x7F7F, 0x7F80, 0x7F80, 0xFF80, 0x0000, 0x0001, 0x8001,
                0x0080, 0x0000, 0x8000, 0x7F80, 0xFF80]
    assert [b & 0xFFFF for b in bits(out[:17]).tolist()] == expected
    assert out[17:].isnan().all()
    # everywhere else it is the nearest bf16: at most half an ulp away, like nearest-even
    y = torch.randn(100_000) * 10.0 ** torch.randint(-30, 30, (100_000,))
    assert ((kernels.cast_param(y, torch.bfloat16).float() - y).abs() <= y.abs() * 2.0 ** -8).all()


def test_cast_param_fp16_and_fp32_are_torch_casts():
    x = torch.randn(1000)
    assert same_bits(kernels.cast_param(x, torch.float16), x.to(torch.float16))
    out = kernels.cast_param(x, torch.float32)
    assert same_bits(out, x) and out.data_ptr() != x.data_ptr()


def remainder_test_bits():
    """Every 16-bit low half under 300 high halves: +-0, denormals, ones, the largest finite, +-inf, NaNs, random."""
    special = [0x0000, 0x8000, 0x0001, 0x807F, 0x3F80, 0xBF80, 0x3F81, 0x7F7F, 0xFF7F, 0x7F80, 0xFF80, 0x7FC0,
               0x7FFF, 0xFFFF, 0x7F81]
    gen = torch.Generator().manual_seed(0)
    high = torch.tensor(special + torch.randint(0, 1 << 16, (300 - len(special),), generator=gen).tolist())
    return (high[:, None] << 16 | torch.arange(1 << 16)[None, :]).view(-1)  # (300 * 65536,) int64


def test_join_of_split_is_exact_for_every_low_half_of_300_high_halves():
    for chunk in remainder_test_bits().split(1 << 22):
        x = kernels._from_unsigned(chunk, torch.float32)
        param, remainder = kernels.split_master(x)
        joined = kernels.join_master(param, remainder)
        nan = x.isnan()
        assert torch.equal(bits(joined)[~nan], bits(x)[~nan])
        assert joined[nan].isnan().all()  # NaN stays NaN; its payload may not
        assert same_bits(param, kernels.cast_param(x, torch.bfloat16))  # the split writes the fp32-master mode's param


def test_stochastic_rounding_is_unbiased():
    # x a fraction f of the way from a bf16 to the next one up (in magnitude), rounded at 200,000 indices (or under
    # 200,000 seeds): the share rounded up is binomial, std sqrt(f (1 - f) / 200000) <= 0.0011; we allow 5 std
    n = 200_000
    for low_bf16, f in ((0x3F80, 0.3), (0xBF80, 0.3), (0x4049, 0.01), (0x0012, 0.5), (0x7F7E, 0.99)):
        x = from_bits([(low_bf16 << 16) + int(f * 65536)])
        f = int(f * 65536) / 65536  # the exact fraction
        by_index = kernels.round_stochastic(x.expand(n).contiguous(), seed=7, step=3)
        seeds = torch.arange(n)  # index 0 under 200,000 seeds: the hash's definition broadcasts over them
        random = kernels.rounding_hash(seeds, 3, torch.zeros(n, dtype=torch.int64)) & 0xFFFF
        by_seed = kernels._round_bf16(x.expand(n), random)
        assert same_bits(by_seed[7:8], kernels.round_stochastic(x, seed=7, step=3))
        for rounded in (by_index, by_seed):
            share_up = ((bits(rounded).long() & 0xFFFF) == low_bf16 + 1).double().mean().item()
            assert abs(share_up - f) <= 5 * (f * (1 - f) / n) ** 0.5, (hex(low_bf16), f, share_up)


def test_stochastic_rounding_is_reproducible_and_changes_with_step_seed_and_index_offset():
    x = torch.randn(100_000)
    first = kernels.round_stochastic(x, seed=1, step=5, index_offset=2**32 + 3)
    assert same_bits(first, kernels.round_stochastic(x, seed=1, step=5, index_offset=2**32 + 3))
    for other in (dict(seed=1, step=6, index_offset=2**32 + 3), dict(seed=2, step=5, index_offset=2**32 + 3),
                  dict(seed=1, step=5, index_offset=3)):  # 3: the same low half of the index, another high half
        changed = (bits(kernels.round_stochastic(x, **other)) != bits(first)).double().mean().item()
        # a bit flips where the two random numbers straddle the low half: on average 1/3 of elements for uniform lows
        assert 0.3 < changed < 0.37, (other, changed)


def test_stochastic_roundings_random_numbers_are_uncorrelated_across_steps_and_neighbours():
    # [Note: stochastic rounding, reproducibly]: one mix an element. This catches a missing or partial mix (it fails
    # without the mix), not the finer differences between one-mix designs: the 16-bit numbers of 200,000 elements (two
    # windows: index < 2^32 and past it) against the next step's, the next element's and the next seed's; uncorrelated
    # numbers give |r| ~ 1/sqrt(n) = 0.0022, we allow 5 of that
    n = 200_000
    for start in (0, 3 * 2**32 - n // 2):
        index = torch.arange(start, start + n)
        u = lambda seed, step, i=index: (kernels.rounding_hash(seed, step, i) & 0xFFFF).double()
        base = u(11, 40)
        for other in (u(11, 41), u(11, 40, index + 1), u(12, 40), u(11, 40 + 2**16)):
            r = torch.corrcoef(torch.stack([base, other]))[0, 1].item()
            assert abs(r) < 5 / n**0.5, (start, r)
        for bins, k in ((base.long() >> 12, 16), (base.long() & 0xFF, 256)):  # the top 4 bits; the low 8
            counts = torch.bincount(bins, minlength=k).double()  # chi-square, k - 1 dof: under mean + 6 std
            assert ((counts - n / k) ** 2 / (n / k)).sum() < k + 6 * (2 * k) ** 0.5, counts


def test_stochastic_rounding_gives_one_of_the_two_neighbours():
    x = torch.randn(100_000) * 10.0 ** torch.randint(-35, 35, (100_000,))
    truncated = bits(x).long() >> 16
    rounded = bits(kernels.round_stochastic(x, seed=3, step=1)).long() & 0xFFFF
    assert ((rounded == truncated & 0xFFFF) | (rounded == (truncated + 1) & 0xFFFF)).all()


def test_dynamic_maps_are_sorted_distinct_and_hold_zero_and_one():
    for signed, q in ((True, kernels.SIGNED_MAP), (False, kernels.UNSIGNED_MAP)):
        assert q.dtype == torch.float32 and q.shape == (256,)
        assert (q[1:] > q[:-1]).all() and q[-1] == 1.0 and (q == 0).sum() == 1
        assert q.min() == (-q[-2] if signed else 0.0)  # signed: symmetric, but for the +1
    assert kernels.SIGNED_MAP[127] == 0 and 0.0 < kernels.UNSIGNED_MAP[1] < 1e-6  # dense near zero: 10^-6 scale


def test_dynamic_maps_equal_torchaos_bit_for_bit():
    quant_utils = pytest.importorskip("torchao.optim.quant_utils", reason="torchao not installed")
    for signed, ours in ((True, kernels.SIGNED_MAP), (False, kernels.UNSIGNED_MAP)):
        assert same_bits(ours, torch.tensor(quant_utils.create_dynamic_map(signed), dtype=torch.float32))


def test_quantize_error_is_within_half_the_largest_gap_times_absmax():
    # The code is the nearest map value, so |x / absmax - map[code]| <= half the gap around it. Largest gaps: signed
    # 0.9 / 64 (the 64 bins of [0.1, 1]) -> bound 0.00703 * absmax; unsigned 0.9 / 128 -> 0.00352 * absmax. The
    # divide and the dequantizing multiply each round once: 2^-23 of absmax on top.
    gen = torch.Generator().manual_seed(0)
    scale = 10.0 ** torch.randint(-8, 4, (64, 1), generator=gen)  # a different magnitude per block
    for signed, q in ((True, kernels.SIGNED_MAP), (False, kernels.UNSIGNED_MAP)):
        x = (torch.randn(64, 256, generator=gen) * scale).view(-1)
        x = x if signed else x.abs()
        codes, absmax = kernels.quantize(x, signed)
        error = (kernels.dequantize(codes, absmax, signed) - x).view(64, 256).abs()
        half_gap = (q[1:] - q[:-1]).max().item() / 2
        assert half_gap == pytest.approx(0.9 / 64 / 2 if signed else 0.9 / 128 / 2, rel=1e-4)
        assert (error <= (half_gap + 2**-23) * absmax[:, None]).all()
        # nearest, not just close: no other code is closer to x / absmax
        xn = (x.view(64, 256) / absmax[:, None]).view(-1)
        assert ((q[codes.long()] - xn).abs() <= (q[None, :] - xn[:, None]).abs().min(dim=1).values + 1e-7).all()


def test_quantize_keeps_zeros_zero():
    x = torch.randn(1024)
    x[256:512] = 0.0  # an all-zero block
    x[::7] = 0.0      # zeros among non-zeros
    for signed in (True, False):
        y = x if signed else x.abs()
        codes, absmax = kernels.quantize(y, signed)
        assert absmax[1] == 0.0
        assert (kernels.dequantize(codes, absmax, signed)[y == 0] == 0).all()

@pytest.mark.parametrize("impl", ALL_IMPLS)
def test_values_at_and_beside_every_midpoint_get_the_nearest_code_and_ties_the_lower(impl):
    # exp_avg starts at 0 and beta1 = 0.5, so the new exp_avg is exactly grad / 2. Three blocks, each [1, 255 values]:
    # the signed map's midpoints, the fp32 just below each, the fp32 just above. Each block's absmax is then 1, so the
    # scaled values are these exactly: below or at midpoint k must take code k, above it code k + 1.
    device = device_of(impl)
    midpoints = (kernels.SIGNED_MAP[:-1] + kernels.SIGNED_MAP[1:]) / 2
    values = [midpoints, torch.nextafter(midpoints, torch.tensor(-2.0)), torch.nextafter(midpoints, torch.tensor(2.0))]
    grad = (2 * torch.cat([torch.cat([torch.ones(1), v]) for v in values])).to(device)
    exp_avg = torch.full((768,), 127, dtype=torch.uint8, device=device)  # code 127 is the signed map's 0
    exp_avg_sq = torch.zeros(768, dtype=torch.uint8, device=device)
    absmax = (torch.zeros(3, device=device), torch.zeros(3, device=device))
    adamw(impl, torch.zeros(768, device=device), grad, exp_avg, exp_avg_sq, None, torch.zeros(1, device=device),
          lr=1e-3, beta1=0.5, beta2=0.95, eps=1e-8, weight_decay=0.0, decay_numel=0, step=1, absmax=absmax)
    assert absmax[0].tolist() == [1.0, 1.0, 1.0]
    codes = exp_avg.cpu().long().view(3, 256)[:, 1:]
    assert codes[0].tolist() == codes[1].tolist() == list(range(255))  # at (a tie) and below: the lower code
    assert codes[2].tolist() == list(range(1, 256))                     # above: the upper one


@pytest.mark.parametrize("impl", KERNELS)
def test_a_dense_sweep_of_scaled_moments_gets_the_references_codes(impl):
    # The CPU kernel estimates each code from its decade and settles it with one compare ([Note: a code from its
    # decade]; every fp32 in [-1, 1]: `python .ci/cpu_kernel.py check`, ~10 s, not here). Here through a step: every 1021st fp32 in [0, 1], both signs,
    # and 8 ulps either side of every midpoint of both maps. exp_avg = grad / 2 exactly (beta1 = 0.5) and each block
    # leads with grad 2, so the signed map codes these very values; exp_avg_sq = grad^2 (beta2 = 0) feeds the unsigned one.
    device = device_of(impl)
    sweep = kernels._from_unsigned(torch.arange(0, 0x3F800001, 1021), torch.float32)
    near = [kernels._unsigned(kernels._midpoints(q)) + k for q in (kernels.SIGNED_MAP, kernels.UNSIGNED_MAP)
            for k in range(-8, 9)]
    values = torch.cat([sweep, kernels._from_unsigned(torch.cat(near), torch.float32)])
    values = torch.cat([values, -values, torch.tensor([0.0, -0.0, 1.0, -1.0, 1e-45, -1e-45])])
    values = values[values.abs() <= 1]
    blocks = -(-len(values) // 255)
    values = torch.cat([values, torch.zeros(blocks * 255 - len(values))]).view(blocks, 255)
    grad = 2 * torch.cat([torch.ones(blocks, 1), values], dim=1).view(-1)
    out = {}
    for name in (impl, "reference"):
        d = device if name == impl else torch.device("cpu")
        exp_avg, exp_avg_sq = torch.zeros(len(grad), dtype=torch.uint8, device=d), torch.zeros_like(grad, dtype=torch.uint8, device=d)
        absmax = (torch.zeros(blocks, device=d), torch.zeros(blocks, device=d))
        adamw(name, torch.zeros(len(grad), device=d), grad.to(d), exp_avg, exp_avg_sq, None, torch.zeros(1, device=d),
              lr=1e-3, beta1=0.5, beta2=0.0, eps=1e-8, weight_decay=0.0, decay_numel=0, step=1, absmax=absmax)
        out[name] = (exp_avg.cpu(), exp_avg_sq.cpu(), *(a.cpu() for a in absmax))
    assert out["reference"][2].eq(1.0).all()
    for ours, theirs in zip(out[impl], out["reference"]):
        assert same_bits(ours, theirs)


@pytest.mark.parametrize("impl", KERNELS)
def test_blocks_of_any_scale_get_the_references_codes(impl):
    # The CUDA 8-bit kernel divides by a block's scale through its reciprocal where the scale is in [2^-64, 2^64], and
    # by the divide outside ([Note: dividing by the reciprocal, exactly]); the sweep above has scale 1, where both are
    # trivial. Here each block leads with its own absmax, 2^-75 to 2^70 with a random mantissa, so exp_avg's (= grad / 2)
    # blocks take both paths and exp_avg_sq's (= grad^2) reach 2^-148 and inf; the rest are random values and the
    # midpoints, times the scale, so that their quotients fall within an ulp or two of the midpoints. The master
    # (from sqrt(v) / bias_correction2_sqrt, by the reciprocal too; an inf root included) is compared as well.
    device = device_of(impl)
    gen = torch.Generator().manual_seed(5)
    blocks = 480
    lead = torch.rand(blocks, generator=gen).add(1) * 2.0 ** torch.randint(-75, 70, (blocks,), generator=gen)
    random = (torch.rand(blocks, 127, generator=gen) * 2 - 1) ** 5
    midpoints = kernels._midpoints(kernels.SIGNED_MAP)[torch.randint(0, 255, (blocks, 128), generator=gen)]
    values = torch.cat([random, midpoints], dim=1) * lead[:, None]
    grad = 2 * torch.cat([lead[:, None], values.clamp(-lead[:, None], lead[:, None])], dim=1).view(-1)
    out = {}
    for name in (impl, "reference"):
        d = device if name == impl else torch.device("cpu")
        exp_avg, exp_avg_sq = (torch.zeros(len(grad), dtype=torch.uint8, device=d) for _ in range(2))
        absmax = (torch.zeros(blocks, device=d), torch.zeros(blocks, device=d))
        master = torch.zeros(len(grad), device=d)
        adamw(name, master, grad.to(d), exp_avg, exp_avg_sq, None, torch.zeros(1, device=d),
              lr=1e-3, beta1=0.5, beta2=0.0, eps=1e-8, weight_decay=0.0, decay_numel=0, step=1, absmax=absmax)
        out[name] = (exp_avg.cpu(), exp_avg_sq.cpu(), *(a.cpu() for a in absmax), master.cpu())
    scale_m, scale_v = out["reference"][2], out["reference"][3]
    inside = lambda scale: (2.0**-64 <= scale) & (scale <= 2.0**64)
    assert (scale_m < 2.0**-64).any() and (scale_m > 2.0**64).any() and (inside(scale_m) & inside(scale_v)).any()
    assert scale_v.isinf().any() and (scale_v < 2.0**-140).any()
    for ours, theirs in zip(out[impl], out["reference"]):
        assert same_bits(ours, theirs)


DIVIDE_CHECK = r"""
#include <initializer_list>
// every x of a sample, both signs, against x / d: the bits where |x| >= 2^-100 and x / d is not below 2^-126 (NaN:
// any NaN), else a result below 2^-23 ([Note: dividing by the reciprocal, exactly]); returns the mismatches
extern "C" long check(const float* x, long n, float d) {
  const float r = 1.0f / d;
  long bad = 0;
  for (long i = 0; i < n; ++i) {
    for (float y : {x[i], -x[i]}) {
      const float want = y / d, got = divide_by_reciprocal(y, d, r);
      const bool exact = !(fabsf(y) < 0x1p-100f) && !(fabsf(want) < 0x1p-126f);  // a NaN y: exact (any NaN)
      bad += exact ? bits_of(got) != bits_of(want) && !(want != want && got != got) : !(fabsf(got) < 0x1p-23f);
      if (fabsf(y) != INFINITY) {  // the encode's form, without the guard for an infinite x: the same bits
        const float unguarded = divide_by_reciprocal<false>(y, d, r);
        bad += bits_of(unguarded) != bits_of(got) && !(unguarded != unguarded && got != got);
      }
    }
  }
  return bad;
}
"""


def test_dividing_by_the_reciprocal_equals_the_divide():
    # [Note: dividing by the reciprocal, exactly], compiled for the host as in the emulated CUDA library: divisors over
    # the whole domain [2^-64, 2^64] (random mantissas, the ends, 1 and 1 - ulp, where r = 1 / d rounds hardest, and
    # bias_correction2_sqrt's [2^-27, 1]), each against ~1.5 million x: quotients from 2^-80 to 2^92 (random), every
    # 62,464th fp32 in [0, 1] times d, the same less an ulp, and inf, NaN, 0 and the smallest subnormal.
    check = ctypes.CDLL(str(host_library((library.CSRC / "adamw_common.h").read_text() + DIVIDE_CHECK,
                                         "divide_check"))).check
    check.argtypes, check.restype = [ctypes.c_void_p, ctypes.c_long, ctypes.c_float], ctypes.c_long
    gen = torch.Generator().manual_seed(7)
    mantissas = lambda k: torch.rand(k, generator=gen).add(1)
    ds = torch.cat([mantissas(40) * 2.0 ** torch.randint(-64, 64, (40,), generator=gen),
                    mantissas(8) * 2.0 ** torch.randint(-28, 0, (8,), generator=gen),  # bias_correction2_sqrt's range
                    torch.tensor([2.0**-64, 2.0**64, 1.0, 1 - 2**-24, 1 + 2**-23, 1.5 * 2.0**-64, 2.0**64 * (1 - 2**-24)])])
    specials = torch.tensor([float("inf"), float("nan"), 0.0, 1e-45])
    for d in ds.tolist():
        quotients = torch.cat([2.0 ** torch.empty(1_000_000).uniform_(-80, 92, generator=gen),
                               kernels._from_unsigned(torch.arange(0, 0x3F800001, 61 * 1024), torch.float32)])
        x = torch.cat([(quotients * d).nextafter(torch.tensor(0.0)), quotients * d])
        x = torch.cat([x[x.isfinite()], specials])
        assert check(x.numpy().ctypes.data, len(x), d) == 0, d


@pytest.mark.parametrize("impl", KERNELS)
def test_a_nan_moment_is_left_out_of_its_blocks_absmax_and_codes_as_255(impl):
    # As the reference: the block's absmax is over its other values, and a NaN's code is the last (searchsorted).
    ref = Shard(512, "remainder", "uint8")
    shard = ref.to(device_of(impl))
    grad = torch.randn(512, generator=torch.Generator().manual_seed(1))
    grad[300] = float("nan")
    grad[301] = kernels._from_unsigned(torch.tensor([0xFFC00000]), torch.float32)  # a NaN with its sign bit set (the
    # CPU encode reads the sign from the bits: [Note: a code from its decade])
    assert shard.step(impl, grad.to(device_of(impl)), weight_decay=0.1, decay_numel=256, step=2) == 1.0
    assert ref.step("reference", grad, weight_decay=0.1, decay_numel=256, step=2) == 1.0
    assert ref.absmax[0].isfinite().all() and (ref.exp_avg[300:302] == 255).all() and (ref.exp_avg_sq[300:302] == 255).all()
    for ours, theirs in zip((shard.exp_avg, shard.exp_avg_sq, *shard.absmax), (ref.exp_avg, ref.exp_avg_sq, *ref.absmax)):
        assert same_bits(ours, theirs)  # (the NaN element's weights are a NaN, whose remainder bits may differ)


@pytest.mark.parametrize("impl", ALL_IMPLS)
def test_the_first_8bit_step_under_another_default_device_builds_its_tables_where_they_belong(impl):
    # The code tables are built at the first 8-bit step (kernels._code_tables). A default device set around that step
    # (with torch.device(...), torch.set_default_device) must not be where they are built: under 'meta' the step equals
    # a plain one bit for bit (it raised, from .item() on a meta tensor, while the maps followed the default device).
    ref, shard = Shard(512, "fp32+bf16param", "uint8"), Shard(512, "fp32+bf16param", "uint8").to(device_of(impl))
    grad = torch.randn(512, generator=torch.Generator().manual_seed(1))
    ref.step("reference", grad, weight_decay=0.1, decay_numel=300, step=2)
    kernels._code_tables.cache_clear()
    try:
        with torch.device('meta'):
            shard.step(impl, grad.to(device_of(impl)), weight_decay=0.1, decay_numel=300, step=2)
            maps = kernels.dynamic_map(signed=True)
    finally:
        kernels._code_tables.cache_clear()
    assert maps.device.type == 'cpu' and same_bits(maps, kernels.SIGNED_MAP)
    for ours, theirs in zip((shard.exp_avg, shard.exp_avg_sq, *shard.absmax, shard.param),
                            (ref.exp_avg, ref.exp_avg_sq, *ref.absmax, ref.param)):
        assert same_bits(ours.cpu(), theirs)


def test_bucket_entries_give_the_number_of_midpoints_below_for_values_near_every_midpoint():
    # The kernels' lookup ([Note: a code in one load]) written in torch: the bucket of the top 16 bits, + 1 if the low
    # 16 bits (flipped for negatives) reach the bucket's threshold. Against searchsorted, both maps, at every midpoint
    # and up to 20 ulps either side, both signs (the unsigned map sees negatives only as -0), zeros, tiny values, NaN.
    for q in (kernels.SIGNED_MAP, kernels.UNSIGNED_MAP):
        midpoints = kernels._midpoints(q)
        entries = kernels._buckets(midpoints).long()
        u = kernels._unsigned(midpoints)
        near = torch.cat([u + k for k in range(-20, 21)])
        x = torch.cat([kernels._from_unsigned(near, torch.float32), -kernels._from_unsigned(near, torch.float32),
                       torch.tensor([0.0, -0.0, 1.0, -1.0, 1e-30, -1e-30, 1e-45]), torch.rand(100_000) * 2 - 1])
        x = x[x.abs() <= 1]  # xn = x / absmax is never larger
        b = kernels._unsigned(x)
        entry = entries[b >> 16]
        key = (b & 0xFFFF) ^ torch.where(b >> 31 == 1, 0xFFFF, 0)
        assert torch.equal((entry & 255) + (key >= entry >> 8).long(), torch.searchsorted(midpoints, x))
        nan = kernels._unsigned(torch.tensor([float("nan")]))
        assert (entries[nan >> 16] & 255).item() == 255 and (entries[nan >> 16] >> 8).item() == 1 << 16
    # the unsigned map's buckets of negative values (sign bit set, NaNs too) hold no midpoint: the GPU's encode of
    # exp_avg_sq skips the key's flip (code_of<false>), which only matters against a threshold below 2^16
    entries = kernels._buckets(kernels._midpoints(kernels.UNSIGNED_MAP)).long()
    assert (entries[1 << 15:] >> 8).eq(1 << 16).all()


@pytest.mark.parametrize("impl", KERNELS)
def test_uint8_state_in_unaligned_views_matches_the_reference(impl):
    # Codes, grad and param each start 1 element into a bigger buffer: no 8-byte-aligned pointers, so the GPU takes
    # its strided path (lane l holds elements l, l + 32, ...), not the vector one (8 consecutive elements a lane).
    n = 256 * 5
    device = device_of(impl)
    ref = Shard(n, "remainder", "uint8")
    shard = ref.to(device)
    for name in ("exp_avg", "exp_avg_sq", "param"):
        t = getattr(shard, name)
        buffer = torch.full((n + 3,), 7, dtype=t.dtype, device=device)
        buffer[1:n + 1] = t
        setattr(shard, name, buffer[1:n + 1])
    gen = torch.Generator().manual_seed(4)
    for step in (1, 2):
        grad = torch.zeros(n + 1)
        grad[1:] = spiky_grad(n, gen)
        step_both(impl, shard, ref, grad[1:], weight_decay=0.1, decay_numel=600, step=step)
        for out, expected in zip([shard.exp_avg, shard.exp_avg_sq, *shard.absmax], [ref.exp_avg, ref.exp_avg_sq, *ref.absmax]):
            assert same_bits(out, expected)  # the moments exactly, as in every mode; the weights within TOL
        torch.testing.assert_close(shard.weights().cpu(), ref.weights(), **TOL)
    assert shard.exp_avg._base[0].item() == 7 and shard.exp_avg._base[n + 1:].eq(7).all()  # neighbours untouched


# ----------------------------------------------------------------------------
# each kernel is the reference, in every mode


# the emulated CUDA kernel runs at 0.3 s a step for 1M elements (a fiber per thread) and that size adds no path
# that 4097 lacks (vector body, tail, several blocks): it takes the three small sizes
@pytest.mark.parametrize("impl,n", [(impl, n) for impl in KERNELS for n in (1, 7, 4097, 1_000_003)
                                    if impl != "cuda-emulated" or n < 10_000])
@pytest.mark.parametrize("grad_dtype,param_dtype", [
    pytest.param(torch.float32, torch.float32, id="fp32grad-fp32param"),
    pytest.param(torch.float32, torch.bfloat16, id="fp32grad-bf16param"),
    pytest.param(torch.bfloat16, torch.float32, id="bf16grad-fp32param"),
    pytest.param(torch.bfloat16, torch.bfloat16, id="bf16grad-bf16param")])
@pytest.mark.parametrize("weight_decay,decay_split", [
    pytest.param(0.0, 0.0, id="no-decay"), pytest.param(0.1, 0.5, id="half-decayed"),
    pytest.param(0.1, 1.0, id="all-decayed")])
def test_kernel_matches_reference(impl, n, grad_dtype, param_dtype, weight_decay, decay_split):
    weights = "fp32+fp32param" if param_dtype == torch.float32 else "fp32+bf16param"
    ref = Shard(n, weights)
    shard = ref.to(device_of(impl))
    decay_numel = int(n * decay_split)  # 0 (none), the middle, or n (all decayed)
    gen = torch.Generator().manual_seed(1)
    for step in (1, 2, 10):  # bias correction changes with step; the states evolve across steps
        grad = torch.randn(n, generator=gen).to(grad_dtype)
        step_both(impl, shard, ref, grad, weight_decay=weight_decay, decay_numel=decay_numel, step=step, grad_scale=0.37)
        for out, expected in zip(shard.tensors()[:3], ref.tensors()[:3]):  # master, exp_avg, exp_avg_sq
            torch.testing.assert_close(out.cpu(), expected, **TOL)
        assert same_bits(shard.param, kernels.cast_param(shard.master, param_dtype))


def mode_size(state):
    return 256 * 17 if state == "uint8" else 4353  # uint8: 17 blocks; else 4352 in the vector kernel and 1 in the tail


@pytest.mark.parametrize("impl", KERNELS)
@pytest.mark.parametrize("grad", GRADS)
@pytest.mark.parametrize("state", STATES)
@pytest.mark.parametrize("weights", WEIGHTS)
def test_every_mode_matches_the_reference(impl, weights, state, grad):
    # Moments exact (bf16 and uint8 too: the kernels' fp32 m and v are torch's bit for bit, so their roundings and
    # codes are). fp32 weights within TOL; the params exactly the kernel's own fp32 rounded by the mode's rule, and
    # where that fp32 is not visible (no master) within one bf16 ulp of the reference's.
    n = mode_size(state)
    ref = Shard(n, weights, state)
    shard = ref.to(device_of(impl))
    gen = torch.Generator().manual_seed(1)
    for step in (1, 2, 3):
        g = spiky_grad(n, gen).to(GRADS[grad])
        step_both(impl, shard, ref, g, weight_decay=0.1, decay_numel=1001, step=step, grad_scale=0.37, index_offset=77)
        for out, expected in zip([shard.exp_avg, shard.exp_avg_sq, *(shard.absmax or ())],
                                 [ref.exp_avg, ref.exp_avg_sq, *(ref.absmax or ())]):
            assert same_bits(out, expected)
        if shard.master is not None:
            torch.testing.assert_close(shard.weights().cpu(), ref.weights(), **TOL)
            if shard.param is not None:
                assert same_bits(shard.param, kernels.cast_param(shard.weights(), shard.param.dtype))
        else:
            assert ((bits(shard.param).long() - bits(ref.param).long()).abs() <= 1).all()


@pytest.mark.parametrize("state", ["fp32", "uint8"])
@pytest.mark.parametrize("weights", ["fp32+bf16param", "remainder", "none-stochastic"])
def test_the_cpu_kernel_on_three_threads_matches_the_reference(weights, state):
    # Above 65536 elements the CPU kernel runs a thread team: each thread a contiguous chunk (elementwise) or run of
    # blocks (uint8: [Note: encoding a block while decoding the next], each run decoding its own first block). 301
    # blocks on 3 threads (torch's OpenMP setting is the library's: the same libgomp) split 101 / 101 / 99; the decay
    # cut mid-block in the second run, the index's high half changing in the third.
    n = 256 * 301
    ref = Shard(n, weights, state)
    shard = ref.to("cpu")
    gen = torch.Generator().manual_seed(3)
    threads = torch.get_num_threads()
    torch.set_num_threads(3)
    try:
        for step in (1, 2):
            g = spiky_grad(n, gen)
            step_both("cpu", shard, ref, g, weight_decay=0.1, decay_numel=256 * 150 + 77, step=step, grad_scale=0.37,
                      index_offset=2**32 - 256 * 250)
    finally:
        torch.set_num_threads(threads)
    for out, expected in zip([shard.exp_avg, shard.exp_avg_sq, *(shard.absmax or ())],
                             [ref.exp_avg, ref.exp_avg_sq, *(ref.absmax or ())]):
        assert same_bits(out, expected)
    if shard.master is not None:
        torch.testing.assert_close(shard.weights(), ref.weights(), **TOL)
        assert same_bits(shard.param, kernels.cast_param(shard.weights(), shard.param.dtype))
    else:
        assert ((bits(shard.param).long() - bits(ref.param).long()).abs() <= 1).all()


@pytest.mark.parametrize("impl", KERNELS)
@pytest.mark.parametrize("state", ["fp32", "uint8"])
@pytest.mark.parametrize("weights", WEIGHTS)
def test_every_mode_rounds_exactly_like_the_reference(impl, weights, state):
    # A decay-only step: grad 0 and exp_avg 0 make the update 0, so the new fp32 weights are the old ones times
    # (1 - lr * weight_decay), one correctly rounded multiply in torch and in the kernels alike. Everything the modes
    # then round (bf16 RNA/RNE/stochastic, fp16, the remainder split) must equal the reference bit for bit; uint8: in
    # the block path, whose stochastic rounding carries the index in 32-bit lanes (IndexFrom, csrc/adamw_cpu.cpp)
    n = 4353 if state == "fp32" else 256 * 17
    ref = Shard(n, weights, state)
    ref.exp_avg.zero_()
    if ref.absmax is not None:  # uint8: code 0 is -0.993, times absmax 0 -> -0
        ref.absmax[0].zero_()
    shard = ref.to(device_of(impl))
    for step in (1, 2):
        step_both(impl, shard, ref, torch.zeros(n), lr=0.5, weight_decay=0.1, decay_numel=3000, step=step,
                  index_offset=2**32 - 100)  # crosses into the index's high half
        for out, expected in zip(shard.tensors(), ref.tensors()):
            assert same_bits(out, expected)
    assert not same_bits(shard.weights(), Shard(n, weights).weights())  # the decay did change the weights


@pytest.mark.parametrize("impl", KERNELS)
@pytest.mark.parametrize("state", STATES)
def test_remainder_run_equals_fp32_master_run_bit_for_bit(impl, state):
    n = mode_size(state)
    fp32, remainder = Shard(n, "fp32+bf16param", state).to(device_of(impl)), Shard(n, "remainder", state).to(device_of(impl))
    gen = torch.Generator().manual_seed(3)
    for step in range(1, 6):
        grad = spiky_grad(n, gen).to(device_of(impl))
        for shard in (fp32, remainder):
            shard.step(impl, grad, weight_decay=0.1, decay_numel=2000, step=step)
        assert same_bits(remainder.param, fp32.param)
        assert same_bits(remainder.weights(), fp32.master)
        assert all(same_bits(a, b) for a, b in zip(remainder.tensors()[1:3], fp32.tensors()[1:3]))


EDGE_FP16_BITS = [0x477FE000, 0x477FEFFF, 0x477FF000, 0x477FF001, 0xC77FF000,  # 65504, just below/at the tie to inf
                  0x38800000, 0x387FE000, 0x387FF000, 0x33800000, 0x33000000, 0x33000001, 0x33C00000,  # 2^-14, denormal ties
                  0x3F801000, 0x3F803000, 0x3F800FFF, 0x00000001, 0x80000001,  # ties to even, fp32 denormals
                  0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0xFFFFFFFF]


@pytest.mark.parametrize("impl", KERNELS)
def test_kernel_params_are_cast_param_bit_for_bit_and_fp16_is_torchs_cast(impl):
    # lr = 0 and no decay: the master comes out as it went in, and the param is its rounding. fp16: torch's own
    # .to(float16) on edge cases and on 200,000 random bit patterns; bf16: cast_param, on edge cases and the same.
    patterns = torch.randint(0, 2**32, (200_000,), generator=torch.Generator().manual_seed(0), dtype=torch.int64)
    master = from_bits(EDGE_FP16_BITS + EDGE_BITS + patterns.tolist())
    n = master.numel()
    for param_dtype, expected in ((torch.float16, master.to(torch.float16)),
                                  (torch.bfloat16, kernels.cast_param(master, torch.bfloat16))):
        param = torch.empty(n, dtype=param_dtype, device=device_of(impl))
        zeros = torch.zeros(n, device=device_of(impl))
        adamw(impl, master.to(device_of(impl)), zeros, zeros.clone(), zeros.clone(), param,
              torch.zeros(1, device=zeros.device), lr=0.0, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, decay_numel=0, step=1)
        nan = master.isnan()
        assert torch.equal(bits(param)[~nan], bits(expected)[~nan])
        assert param.cpu()[nan].isnan().all()


@pytest.mark.parametrize("impl", KERNELS)
def test_kernel_param_can_be_an_unaligned_view_into_a_bigger_buffer(impl):
    device = device_of(impl)
    n = 1001
    ref = Shard(n)
    shard = ref.to(device)
    buffer = torch.full((n + 3,), 7.0, dtype=torch.bfloat16, device=device)
    shard.param = buffer[1:n + 1]  # starts 2 bytes in: not 8-byte aligned, so the GPU takes the scalar path
    step_both(impl, shard, ref, torch.randn(n), weight_decay=0.1, decay_numel=500, step=3)
    torch.testing.assert_close(shard.master.cpu(), ref.master, **TOL)
    assert same_bits(shard.param, kernels.cast_param(shard.master, torch.bfloat16))
    assert buffer[0].item() == 7.0 and buffer[n + 1:].eq(7.0).all()  # neighbours untouched

@pytest.mark.parametrize("impl", KERNELS)
def test_the_librarys_bf16_cast_is_cast_params_bit_for_bit_on_the_masters_device(impl):
    # a stage-3 gather's cast (kernels.cast_param with impl='auto'): the library's one pass equals the torch ops,
    # NaN payloads included, on edge cases and 200,003 random bit patterns, from an aligned start (the 4-wide CUDA
    # kernel and its tail), an unaligned view (the 1-wide one), 60,000 elements (the CPU's one-thread path) and an
    # empty view; and under another default device the result is still made on the master's
    patterns = torch.randint(0, 2**32, (200_003,), generator=torch.Generator().manual_seed(1), dtype=torch.int64)
    master = from_bits(EDGE_BITS + EDGE_FP16_BITS + patterns.tolist())
    expected = bits(kernels.cast_param(master, torch.bfloat16))  # impl='reference': the torch ops
    master = master.to(device_of(impl))
    for start, stop in ((0, None), (1, None), (7, 60_007), (5, 5)):
        view = master[start:stop]
        with torch.device("meta"), cuda_library_on_host() if impl == "cuda-emulated" else contextlib.nullcontext():
            out = kernels.cast_param(view, torch.bfloat16, impl="cpu" if impl == "cuda-emulated" else impl)
        assert (out.device, out.dtype, out.shape) == (view.device, torch.bfloat16, view.shape)
        assert torch.equal(bits(out), expected[start:stop])
        # into a given tensor (a stage-3 gather writes its row of the unsharded param): the same bits there, nothing
        # written outside it, the same tensor returned
        row = torch.full((3, view.numel()), 7.0, dtype=torch.bfloat16, device=view.device)
        with cuda_library_on_host() if impl == "cuda-emulated" else contextlib.nullcontext():
            got = kernels.cast_param(view, torch.bfloat16, impl="cpu" if impl == "cuda-emulated" else impl, out=row[1])
        assert got.data_ptr() == row[1].data_ptr() and torch.equal(bits(row[1]), expected[start:stop])
        assert row[0].eq(7.0).all() and row[2].eq(7.0).all()
    on = master.device  # cuda:0 where the kernel runs on the GPU (the fourth GPU pass found the test naming cpu there)
    with pytest.raises(ValueError, match=f"out is torch.float32 x 3 on {on}, the cast torch.bfloat16 x 3 on {on}"):
        kernels.cast_param(master[:3], torch.bfloat16, impl=impl.replace("cuda-emulated", "cpu"),
                           out=torch.empty(3, device=master.device))


@pytest.mark.parametrize("impl", [k for k in KERNELS if k != "cuda-emulated"])
def test_cast_param_on_the_librarys_path_takes_a_non_contiguous_master_or_out_as_the_torch_ops_do(impl):
    # the library reads and writes raw pointers, n elements on from each: a strided master (every other element of a
    # row) or a strided out must take the torch ops, and get the bits the reference writes, nothing else touched
    master = torch.randn(6, 64, generator=torch.Generator().manual_seed(3)).to(device_of(impl))
    strided = master[:, ::2]
    expected = bits(kernels.cast_param(strided.contiguous(), torch.bfloat16))
    got = kernels.cast_param(strided, torch.bfloat16, impl=impl)
    assert got.shape == strided.shape and torch.equal(bits(got).reshape(-1), expected.reshape(-1))
    row = torch.full((2, 6, 32), 7.0, dtype=torch.bfloat16, device=master.device)
    out = row[1].t()  # non-contiguous, 192 elements
    contiguous = master[:, :32].t().contiguous()  # (32, 6), as out
    kernels.cast_param(contiguous, torch.bfloat16, impl=impl, out=out)
    assert torch.equal(bits(out), bits(kernels.cast_param(contiguous, torch.bfloat16)))
    assert row[0].eq(7.0).all()


def test_every_openmp_if_on_a_simd_loop_names_the_parallel_construct():
    # OpenMP 5.0: an if clause on `parallel for simd` without a modifier applies to the simd too, so below its
    # threshold the loop ran scalar (GCC 12: the cast of a 65,536-element shard took 42 us, 6 us with `if(parallel:`)
    source = re.sub(r"\\\n", " ", library.CPU_SOURCE)  # a pragma continued over lines is one line
    pragmas = re.findall(r"^[ \t]*#[ \t]*pragma[ \t]+omp\b(.*)$", source, flags=re.MULTILINE)
    combined = [p for p in pragmas if re.search(r"\bparallel\b", p) and re.search(r"\bsimd\b", p)]
    assert any(re.search(r"\bif\s*\(", p) for p in combined), "no `parallel ... simd if(...)` left: look elsewhere"
    for p in combined:  # every if on such a construct says which construct it is for
        assert all(re.match(r"(parallel|simd)\s*:", rest.lstrip()) for rest in re.split(r"\bif\s*\(", p)[1:]), p


# ----------------------------------------------------------------------------
# found_inf


@pytest.mark.parametrize("impl", ALL_IMPLS)
@pytest.mark.parametrize("state", ["fp32", "uint8"])
def test_found_inf_is_set_by_one_inf_or_nan_and_accumulates(impl, state):
    device = device_of(impl)
    n = 4097 if state == "fp32" else 4352
    shard = Shard(n, state=state).to(device)
    found_inf = torch.zeros(1, device=device)

    def step(grad, grad_scale=1.0):
        adamw(impl, shard.master, grad, shard.exp_avg, shard.exp_avg_sq, shard.param, found_inf, absmax=shard.absmax,
              **HP, weight_decay=0.1, decay_numel=100, step=1, grad_scale=grad_scale)
        return found_inf.item()

    clean = torch.randn(n, device=device)
    assert step(clean) == 0.0 and step(clean.bfloat16()) == 0.0  # clean grads leave it at 0
    for bad_index, bad_value in ((4096, float("inf")), (1000, float("nan")), (7, float("-inf")), (3000, float("inf"))):
        bad = clean.clone()
        bad[bad_index] = bad_value  # GPU: 4096 is in the tail launch (fp32) or the last block (uint8)
        found_inf.zero_()
        assert step(bad) == 1.0
        found_inf.zero_()
        assert step(bad.bfloat16()) == 1.0
    assert step(clean) == 1.0  # never reset by a later clean call
    found_inf.zero_()
    huge = clean.clone()
    huge[3] = 1e30
    assert step(huge, grad_scale=1e10) == 1.0  # checks the scaled grad: 1e30 * 1e10 overflows fp32

# ----------------------------------------------------------------------------
# the outside oracle for 8-bit state: torchao's AdamW8bit


def test_uint8_state_agrees_with_torchao_adamw8bit(monkeypatch):
    optim = pytest.importorskip("torchao.optim", reason="torchao not installed (pip install --no-deps torchao==0.18.0)")
    # torchao torch.compiles its step (~30 s on a CPU); with dynamo off it runs the same torch ops eagerly
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    n = 64 * 1024  # >= 4096: both libraries keep smaller tensors in fp32
    gen = torch.Generator().manual_seed(0)
    theirs = torch.nn.Parameter(torch.randn(n, generator=gen))
    opt = optim.AdamW8bit([theirs], lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    master = theirs.detach().clone()
    exp_avg, exp_avg_sq = torch.zeros(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)
    absmax = (torch.zeros(n // 256), torch.zeros(n // 256))  # all zero, as torchao starts
    for step in range(1, 4):
        magnitude = 10.0 ** torch.randint(-3, 1, (n // 256, 1), generator=gen)  # per block: 1e-3 .. 1
        grad = (torch.randn(n // 256, 256, generator=gen) * magnitude).view(-1)
        theirs.grad = grad.clone()
        opt.step()
        kernels.adamw_step(master, grad, exp_avg, exp_avg_sq, None, torch.zeros(1), **HP, weight_decay=0.1,
                           decay_numel=n, step=step, absmax=absmax, impl="cpu")
    state = opt.state[theirs]
    # Measured here (3 steps, 65,536 elements, grads of 4 magnitudes): exp_avg codes differ at 0, 2 and 1 elements
    # after steps 1, 2, 3, each by one code: values within an ulp of a midpoint, where the two fp32 updates differ by
    # an ulp (torchao computes exp_avg_sq by lerp and the bias corrections in fp32, and rounds ties up). exp_avg_sq
    # codes never differ. The absmax agree within 2.4e-7 but in one block, whose largest element had its code differ
    # the step before (3.4e-4). Allowed: 0.1% of codes, by one; 99% of absmax within 5e-7, all within a code's gap.
    for name, codes, scale, signed in (("exp_avg", exp_avg, absmax[0], True), ("exp_avg_sq", exp_avg_sq, absmax[1], False)):
        their = state[name]
        differ = codes.long() - their.codes.long()
        assert (differ != 0).double().mean().item() <= 1e-3 and differ.abs().max().item() <= 1, name
        gap = 0.9 / 64 if signed else 0.9 / 128  # the largest gap between two codes
        assert torch.isclose(scale, their.scale, rtol=5e-7, atol=0).double().mean().item() >= 0.99, name
        torch.testing.assert_close(scale, their.scale, rtol=gap, atol=0)
        ours32, their32 = kernels.dequantize(codes, scale, signed), their.dequantize()
        assert ((ours32 - their32).view(-1, 256).abs() <= 2 * gap * scale[:, None]).all(), name  # a code + the absmax
    # The params, updated from the same fp32 m and v: measured within 7 ulps (bias corrections in fp32 there, double
    # here) or 5.2e-10 where the update cancels the weight to ~0, but for the one element whose exp_avg code differed a
    # step before (3.8e-6). Allowed: 99.9% within those, all within 1e-5 (lr times a code's gap times ~1).
    close = torch.isclose(master, theirs.detach(), rtol=5e-7, atol=1e-9)
    assert close.double().mean().item() >= 0.999
    torch.testing.assert_close(master, theirs.detach(), rtol=0, atol=1e-5)

# ----------------------------------------------------------------------------
# the CUDA kernel, run on the host: where no GPU is, this is how its indexing, vector/tail split, roundings, block
# reduction and found_inf vote get executed at all. The CUDA_SOURCE text is compiled by the host compiler, unchanged
# but for its <<<grid, block>>> launches, with the CUDA built-ins defined below. Each thread of a block is a fiber
# (ucontext, its own stack) and __syncthreads() switches back to a scheduler that runs the block's fibers round-robin,
# so no thread passes a barrier before all of its block have reached it, as on a GPU. What it cannot show: races
# between blocks, misaligned-access faults, launch limits, speed, and the GPU's own arithmetic (the host's fmaf,
# sqrtf and / stand in for the device instructions). Those need the 'cuda' cases on a GPU.

HOST_CUDA_PRELUDE = r"""
#include <ucontext.h>
#include <stdlib.h>
#include <functional>
#include <vector>
#define __global__ static
#define __launch_bounds__(...)
#define __device__
#define __host__
#define __forceinline__ inline
#define __shared__ static  // one block runs at a time, so per-block storage can be static
struct uint2 { unsigned x, y; };
struct alignas(16) uint4 { unsigned x, y, z, w; };
template <class T> static T __ldcs(const T* p) { return *p; }  // a cache hint on a GPU, a plain load here
template <class T> static void __stcs(T* p, T v) { *p = v; }
typedef void* cudaStream_t;
typedef int cudaError_t;
static const cudaError_t cudaSuccess = 0;
static cudaError_t cudaGetLastError() { return cudaSuccess; }
static const char* cudaGetErrorString(cudaError_t) { return "no error"; }
struct dim3 { unsigned x, y = 1, z = 1; dim3(unsigned x = 1) : x(x) {} };
static dim3 threadIdx, blockIdx, blockDim;

static const size_t kStack = 64 * 1024;
static ucontext_t scheduler;
static std::vector<ucontext_t> fibers;
static std::vector<char> stacks;
static std::vector<char> finished;
static unsigned current;
static std::function<void()> thread_body;
static int block_vote;

static void __syncthreads() { swapcontext(&fibers[current], &scheduler); }  // back to the scheduler until all arrive
static int __syncthreads_or(int vote) { block_vote |= vote; __syncthreads(); return block_vote; }  // once per kernel
static void fiber_main() { thread_body(); finished[current] = 1; }  // returning resumes uc_link: the scheduler

// A warp shuffle with every lane of the warp taking part (mask 0xFFFFFFFF, the kernel's only use): each thread posts
// its value, all wait, each reads its partner's (threadIdx ^ lane_mask, in the same warp), all wait again before the
// slots are reused. The barriers are block-wide, more than a warp's own; slots are per thread, so warps that shuffle
// fewer times (idle ones) cannot disturb the others.
static float shuffle_slots[1024];
static float __shfl_xor_sync(unsigned mask, float value, int lane_mask) {
  if (mask != 0xFFFFFFFFu) abort();  // partial warps are not emulated
  shuffle_slots[threadIdx.x] = value;
  __syncthreads();
  const float other = shuffle_slots[threadIdx.x ^ lane_mask];
  __syncthreads();
  return other;
}

// The same for a warp's integer max (REDUX on sm_80+): each posts its value, all wait, each takes its warp's max.
static unsigned reduce_slots[1024];
static unsigned __reduce_max_sync(unsigned mask, unsigned value) {
  if (mask != 0xFFFFFFFFu) abort();
  reduce_slots[threadIdx.x] = value;
  __syncthreads();
  unsigned most = 0;
  for (unsigned t = threadIdx.x & ~31u; t < (threadIdx.x & ~31u) + 32; ++t) most = reduce_slots[t] > most ? reduce_slots[t] : most;
  __syncthreads();
  return most;
}

// byte n of the result: byte (selector >> 4n) & 7 of the 8 bytes y:x (the kernel's only mode)
static unsigned __byte_perm(unsigned x, unsigned y, unsigned selector) {
  const unsigned long long bytes = (unsigned long long)y << 32 | x;
  unsigned out = 0;
  for (int n = 0; n < 4; ++n) out |= (unsigned)(bytes >> 8 * ((selector >> 4 * n) & 7) & 0xFF) << 8 * n;
  return out;
}

// the 8-bit kernel's L2 prefetches ([Note: the 8-bit kernel's memory hints]): each address the last launch asked for
static std::vector<const void*> prefetched;
#define HOST_PREFETCH(p) prefetched.push_back(p)
extern "C" int64_t host_prefetches(const void** out, int64_t capacity) {  // copies them out
  const int64_t n = (int64_t)prefetched.size();
  for (int64_t i = 0; i < n && i < capacity; ++i) out[i] = prefetched[i];
  return n;
}

template <class Kernel, class... Args>
static void host_launch(Kernel kernel, unsigned grid, unsigned block, Args... args) {
  prefetched.clear();  // the last launch's only
  fibers.resize(block); stacks.resize(block * kStack); finished.assign(block, 0);
  thread_body = [&] { kernel(args...); };
  blockDim = dim3(block);
  for (unsigned b = 0; b < grid; ++b) {
    blockIdx = dim3(b); block_vote = 0;
    for (unsigned t = 0; t < block; ++t) {
      getcontext(&fibers[t]);
      fibers[t].uc_stack.ss_sp = &stacks[t * kStack]; fibers[t].uc_stack.ss_size = kStack;
      fibers[t].uc_link = &scheduler;
      makecontext(&fibers[t], fiber_main, 0);
      finished[t] = 0;
    }
    for (bool running = true; running;) {  // a round runs every unfinished thread up to its next barrier
      running = false;
      for (unsigned t = 0; t < block; ++t) {
        if (finished[t]) continue;
        current = t; threadIdx = dim3(t); running = true;
        swapcontext(&scheduler, &fibers[t]);
      }
    }
  }
}
"""


def host_library(source, name):
    """source compiled for the host as the kernels' IEEE arithmetic needs it (no fma contraction), cached like the
    kernels' own libraries: the path of name_<hash>.so."""
    command = [library._compiler("cpu")[0], "-O2", "-march=native", "-ffp-contract=off", "-fno-math-errno",
               "-std=c++17", "-shared", "-fPIC"]
    kernels_own = library.cache_path("cpu")  # its name hashes the CPU's extensions and the compiler's version too:
    digest = hashlib.sha256("\0".join([source, *command, kernels_own.name]).encode()).hexdigest()[:16]  # a shared
    path = kernels_own.parent / f"{name}_{digest}.so"  # cache never hands one CPU's -march=native build to another
    library.compile_library(source, command, path)
    return path


@functools.cache
def cuda_on_host_path():
    launch = re.compile(r"(\w+<[^<>;]*>)<<<(.*?), (\w+), 0, stream>>>\((.*?)\);")
    assert len(launch.findall(library.CUDA_SOURCE)) == 6, "update the launch pattern to the CUDA source"
    return host_library(HOST_CUDA_PRELUDE + launch.sub(r"host_launch(\1, \2, \3, \4);", library.CUDA_SOURCE),
                        "adamw_cuda_on_host")


@contextlib.contextmanager
def cuda_library_on_host():
    """Within: impl='cpu' runs the host-emulated CUDA library."""
    kernels.resolve_impl("cpu")
    cpu = kernels._LIBRARIES["cpu"]
    kernels._LIBRARIES["cpu"] = cuda_library()
    try:
        yield
    finally:
        kernels._LIBRARIES["cpu"] = cpu


@functools.cache
def cuda_library():
    return library.Library(cuda_on_host_path())


@pytest.mark.parametrize("impl", [k for k in KERNELS if k.startswith("cuda")])
@pytest.mark.parametrize("state", STATES)
@pytest.mark.parametrize("weights", WEIGHTS)
def test_cuda_kernel_equals_the_cpu_kernel_bit_for_bit(impl, weights, state):
    # same math, same roundings (explicit fma only, IEEE sqrt and divide, the shared rounding functions): the CUDA
    # source agrees with the CPU loop exactly, on the host and (the claim a first GPU run checks) on a GPU
    n = 4097 * 3 if state != "uint8" else 256 * 96  # 12288 in the vector kernel + 3 in the tail; or 96 blocks:
    # 1.5 CUDA blocks of 64 (csrc/adamw.cu)
    for grad_dtype in (torch.float32, torch.bfloat16):
        cpu = Shard(n, weights, state)
        other = cpu.to(device_of(impl))
        gen = torch.Generator().manual_seed(2)
        for step in (1, 2, 3):
            grad = spiky_grad(n, gen).to(grad_dtype)
            for which, shard in (("cpu", cpu), (impl, other)):
                shard.step(which, grad.to(device_of(which)), weight_decay=0.1, decay_numel=5001, step=step,
                           grad_scale=0.37, index_offset=2**32 - 5000)  # 5001: mid-vector
            for a, b in zip(cpu.tensors(), other.tensors()):
                assert same_bits(a, b)


def test_the_cuda_kernels_absmax_by_shuffles_for_gpus_before_sm80_equals_the_cpu_kernel():
    # csrc/adamw.cu reduces a block's absmax with one REDUX on sm_80+ and with shuffles before: the host emulation takes
    # the REDUX form, so here the source is built with the shuffles instead, and the 8-bit modes compared as above
    reduce = "#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800"
    assert library.CUDA_SOURCE.count(reduce) == 1, "update this test to the kernel's #if"
    launch = re.compile(r"(\w+<[^<>;]*>)<<<(.*?), (\w+), 0, stream>>>\((.*?)\);")
    source = HOST_CUDA_PRELUDE + launch.sub(r"host_launch(\1, \2, \3, \4);", library.CUDA_SOURCE.replace(reduce, "#if 0"))
    shuffles = library.Library(host_library(source, "adamw_cuda_on_host_shuffles"))
    n = 256 * 96
    for weights in ("fp32+bf16param", "remainder"):
        cpu = Shard(n, weights, "uint8")
        other = cpu.to("cpu")
        gen = torch.Generator().manual_seed(2)
        for step in (1, 2):
            grad = spiky_grad(n, gen)
            cpu.step("cpu", grad, weight_decay=0.1, decay_numel=5001, step=step)
            with mock.patch.dict(kernels._LIBRARIES, {"cpu": shuffles}):
                other.step("cpu", grad, weight_decay=0.1, decay_numel=5001, step=step)
        for a, b in zip(cpu.tensors(), other.tensors()):
            assert same_bits(a, b)


@functools.cache
def avx2_cpu_library():
    """csrc/adamw_cpu.cpp built as for a CPU with AVX2 and no AVX-512 (-march=haswell, e.g. most laptops): the branch
    without byte permutes (gathers, the buckets' encode), which a CPU with AVX-512 VBMI never runs."""
    command = [library._compiler("cpu")[0], *library.CPU_FLAGS, "-march=haswell", *library.SHARED_FLAGS["cpu"]]
    digest = hashlib.sha256("\0".join([library.CPU_SOURCE, *command, library.cache_path("cpu").name]).encode()).hexdigest()
    path = library.cache_path("cpu").parent / f"adamw_cpu_haswell_{digest[:16]}.so"
    library.compile_library(library.CPU_SOURCE, command, path)
    return library.Library(path)


def cpu_flags():
    try:
        with open("/proc/cpuinfo") as f:
            return set(next((line for line in f if line.startswith("flags")), "").split())
    except OSError:
        return set()


@pytest.mark.skipif(not {"avx2", "fma"} <= cpu_flags(), reason="-march=haswell code needs an x86 CPU with AVX2 and FMA")
@pytest.mark.parametrize("state", STATES)
@pytest.mark.parametrize("weights", WEIGHTS)
def test_the_cpu_kernel_built_for_avx2_equals_the_native_build_bit_for_bit(weights, state):
    # Same steps as the CUDA comparison above. The AVX2 build once ran the 8-bit block and the fp16 cast as scalar
    # loops (a ?: that g++ made a branch: csrc/adamw_common.h, select); this checks its numbers, not its speed.
    n = 4097 * 3 if state != "uint8" else 256 * 96
    kernels.resolve_impl("cpu")
    native, avx2 = kernels._LIBRARIES["cpu"], avx2_cpu_library()
    # weights at the fp16 cast's edges (its denormals, 65504 / 65520, inf, NaN) and an fp32 denormal, both signs
    edges = torch.tensor([6e-8, 3e-5, 6.1e-5, 65504.0, 65519.0, 65521.0, 7e4, float("inf"), float("nan"), 1e-40, 0.0])
    for grad_dtype in (torch.float32, torch.bfloat16):
        shards = {"native": Shard(n, weights, state)}
        if shards["native"].master is not None and shards["native"].master.dtype == torch.float32:
            shards["native"].master[:2 * len(edges)] = torch.cat([edges, -edges])
        shards["avx2"] = shards["native"].to("cpu")
        gen = torch.Generator().manual_seed(2)
        for step in (1, 2, 3):
            grad = spiky_grad(n, gen).to(grad_dtype)
            for which, lib in (("native", native), ("avx2", avx2)):
                with mock.patch.dict(kernels._LIBRARIES, {"cpu": lib}):
                    shards[which].step("cpu", grad, weight_decay=0.1, decay_numel=5001, step=step, grad_scale=0.37,
                                       index_offset=2**32 - 5000)
            for a, b in zip(shards["native"].tensors(), shards["avx2"].tensors()):
                assert same_bits(a, b)


@pytest.mark.parametrize("weights", ["fp32+bf16param", "remainder", "none-stochastic"])
def test_the_8bit_kernels_l2_prefetches_ask_for_the_blocks_of_the_rounds_to_come_inside_each_stream(weights):
    """The CUDA-only prefetch ([Note: the 8-bit kernel's memory hints]) takes addresses a CPU can check: run on the host,
    the kernel asks, for every stream it reads, for the 8 elements of each lane of each warp's block of rounds 1-7 of
    its CUDA block that exist (n = 96 quantization blocks: 1.5 CUDA blocks of 8 warps x 8 rounds), nothing past a
    stream's end, nothing of round 0 (no round before it to ask during), and nothing of a stream it only writes."""
    n = 256 * 96
    shard = Shard(n, weights, "uint8")
    grad = torch.randn(n)
    hp = dict(weight_decay=0.1, decay_numel=5001)
    shard.step("cuda-emulated", grad, step=1, **hp)
    lib = ctypes.CDLL(str(cuda_on_host_path()))  # the library the step ran: dlopen gives the loaded one
    lib.host_prefetches.restype = ctypes.c_int64
    buf = (ctypes.c_void_p * 100_000)()
    count = lib.host_prefetches(buf, len(buf))
    assert 0 < count <= len(buf)
    reads_param = weights != "fp32+bf16param"  # an fp32 master's param is written, never read: not prefetched
    streams = {name: t for name, t in (("exp_avg", shard.exp_avg), ("exp_avg_sq", shard.exp_avg_sq), ("grad", grad),
                                       ("master", shard.master), ("param", shard.param)) if t is not None}
    asked = {name: [] for name in streams}
    for address in buf[:count]:
        hits = [name for name, t in streams.items()
                if t.data_ptr() <= address < t.data_ptr() + t.numel() * t.element_size()]
        assert len(hits) == 1, f"a prefetch of {address:#x} is in no stream's memory"
        t = streams[hits[0]]
        offset = address - t.data_ptr()
        assert offset % (8 * t.element_size()) == 0  # a lane's first element of 8
        asked[hits[0]].append(offset // t.element_size())
    rounds_to_come = [((cuda_block * 8 + r) * 8 + warp) for cuda_block in (0, 1) for r in range(1, 8) for warp in range(8)]
    expected = sorted(b * 256 + 8 * lane for b in rounds_to_come if b < 96 for lane in range(32))
    for name in streams:
        assert sorted(asked[name]) == (expected if name != "param" or reads_param else []), name


@pytest.mark.parametrize("archs, gpu, built", [("8.0", (9, 0), ["80", "90"]), ("9.0a", (9, 0), ["90a"]),
                                               ("8.0;9.0+PTX", (9, 0), ["80", "90"]), ("", (8, 6), ["86"]),
                                               ("7.5", None, ["75"]), ("8.0", (8, 6), ["80"]),  # 8.0 runs on 8.6
                                               ("8.0+PTX", (9, 0), ["80"]), ("9.0a", (10, 0), ["90a", "100"]),
                                               ("Ampere", (8, 6), ["80", "86"]), ("Turing,Hopper", (9, 0), ["75", "90"]),
                                               ("native", (9, 0), ["90"]), ("Blackwell", (10, 0), ["100", "103", "120", "121"])])
def test_the_cuda_build_always_includes_the_gpu_at_hand(monkeypatch, archs, gpu, built):
    # a TORCH_CUDA_ARCH_LIST set for other GPUs (a container's) must not leave this one without a kernel
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", archs)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpu is not None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: gpu)
    flags = [f for f in library._cuda_arch_flags() if "code=sm_" in f]
    assert [f.rsplit("sm_", 1)[1] for f in flags] == built


@pytest.mark.parametrize("archs", ["sm_90", "9", "Hoper", "9.0;compute_90"])
def test_an_arch_list_nvcc_cannot_take_falls_back_with_one_line_naming_it(monkeypatch, archs):
    # before, "Ampere" (which torch takes) reached int("Ampere"): a ValueError past every fallback, train.py dead at
    # its first step; now a name is expanded and anything else is one RuntimeError line, the reference step's warning
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", archs)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(kernels, "_LIBRARIES", {})
    with pytest.warns(UserWarning, match=r"reference AdamW step: cuda build failed: TORCH_CUDA_ARCH_LIST has '[^']+', not a CUDA arch: "
                                         r"write e\.g\. 9\.0, 9\.0a, 8\.6\+PTX, a name such as Hopper, or native"):
        assert kernels.resolve_impl("auto", torch.device("cuda")) == "reference"
    with pytest.raises(RuntimeError, match="impl=.cuda. is not available: cuda build failed: TORCH_CUDA_ARCH_LIST has"):
        kernels.resolve_impl("cuda", torch.device("cuda"))


def test_a_cuda_build_is_announced_once_and_needs_a_gpu_or_an_arch_list(monkeypatch, tmp_path):
    # train.py's line before a first run builds the CUDA library (kernels.announce_build, impl='auto' on a GPU), and
    # none once it is cached; with no GPU and no TORCH_CUDA_ARCH_LIST there is nothing to build for: one line
    monkeypatch.setenv("NANOZERO_CACHE", str(tmp_path))
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    monkeypatch.setattr(library, "_compiler", lambda impl: (f"/opt/{impl}/bin/cc", "1.0"))  # no toolkit needed
    said = []
    kernels.announce_build("auto", torch.device("cuda", 0), said.append)
    library.cache_path("cuda").touch()
    kernels.announce_build("auto", torch.device("cuda", 0), said.append)
    assert said == [f"building the fused AdamW kernel for cuda (first run only, a few seconds; cached in "
                    f"{library.cache_path('cuda')})"]
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match=r"^no GPU to build for: set TORCH_CUDA_ARCH_LIST, e\.g\. 9\.0$"):
        library._cuda_arch_flags()
    kernels.announce_build("auto", torch.device("cuda", 0), said.append)  # resolve_impl will say why, not this
    assert len(said) == 1


def test_on_cuda_bench_times_each_fn_between_two_events_then_waits_for_the_gpu(monkeypatch):
    # bench.time_ms's CUDA branch, torch.cuda's events stood in for: start recorded, the fn launched, end recorded,
    # the host waits for the GPU, then the time between the events (on a GPU: test_gpu.py's bench kernels cases)
    import bench
    log = []

    class Event:
        count = 0

        def __init__(self, enable_timing=False):
            assert enable_timing
            Event.count += 1
            self.n = Event.count

        def record(self):
            log.append(("record", self.n))

        def elapsed_time(self, end):
            log.append(("elapsed", self.n, end.n))
            return 2.0 + self.n

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: log.append(("sync",)))
    times = bench.time_ms({"f": lambda: log.append(("fn",))}, torch.device("cuda", 0), repeats=3, warmup=1)
    assert log[:6] == [("fn",), ("record", 1), ("fn",), ("record", 2), ("sync",), ("elapsed", 1, 2)]
    assert len(log) == 16 and times == {"f": pytest.approx(5.0)}  # the median of 3, 5, 7


def test_bench_times_fns_in_turns_reversed_every_other_round_the_median_after_warm_up(monkeypatch):
    # bench.time_ms's CPU branch, its clock stood in for: the warm-up runs untimed (a first call 1 s long counts for
    # nothing), then the fns take turns, in an order reversed every other round, and each gets the median of its times
    # (a's one 90 ms call among 1 and 2 ms ones moves nothing; a mean would say 31 ms)
    import types

    import bench
    clock, order = [0.0], []
    durations = {"a": iter([1.0, 1e-3, 2e-3, 90e-3]), "b": iter([1.0, 5e-3, 5e-3, 5e-3])}

    def fn(name):
        order.append(name)
        clock[0] += next(durations[name])
    monkeypatch.setattr(bench, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    times = bench.time_ms({"a": lambda: fn("a"), "b": lambda: fn("b")}, torch.device("cpu"), repeats=3, warmup=1)
    assert order == ["a", "b", "a", "b", "b", "a", "a", "b"]
    assert times == {"a": pytest.approx(2.0), "b": pytest.approx(5.0)}


def test_bench_modes_prints_each_modes_time_over_the_first_modes_and_over_the_other_kernels(monkeypatch, capsys):
    # bench.py kernels --modes --against X, the timings stood in for: each mode takes 2 ms (the first 1 ms) in ours and
    # 4 ms in X's kernel: "ratio" is a mode's time over the first mode's, "vs X" ours over X's (0.50: ours twice as fast)
    import bench
    monkeypatch.setattr(bench, "library_at", lambda rev, impl: object())
    monkeypatch.setattr(bench, "same_bits", lambda impl, lib, device: [m[0] for m in bench.PRECISION_MODES])
    first = bench.PRECISION_MODES[0][0]
    monkeypatch.setattr(bench, "time_ms", lambda fns, device, repeats=10, warmup=3: {
        key: 1.0 if key in ("copy", first) else 2.0 if isinstance(key, str) else 2.0 if key[0] == first else 4.0
        for key in fns})
    bench.bench_modes(torch.device("cpu"), [4096], torch.float32, against="X")
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.strip().startswith("4,096")]
    assert [(row[-5], row[-4], row[-2], row[-1]) for row in rows] == [
        ("1.00", "1.00", "2.00", "0.50")] + [("2.00", "2.00", "4.00", "0.50")] * (len(bench.PRECISION_MODES) - 1), rows


NO_NVCC = pytest.mark.skipif(shutil.which("nvcc") is None and not os.path.exists("/usr/local/cuda/bin/nvcc"),
                             reason="no nvcc: cannot compile the CUDA source")


@pytest.fixture(scope="module")
def sm90_build(tmp_path_factory):
    """The real CUDA build for sm_90 (library.compile_library), once for the two tests below (~9 s): nvcc, the plain
    source and the library's flags, without torch's CUDA or a GPU, ptxas telling what it allocated (-v changes no
    byte of the binary). The library's path and nvcc's stderr."""
    with mock.patch.dict(os.environ, {"TORCH_CUDA_ARCH_LIST": "9.0"}):
        command = [*library._command("cuda"), "-Xptxas", "-v"]
    path, runs, run = tmp_path_factory.mktemp("sm90") / "adamw.so", [], subprocess.run
    with mock.patch.object(subprocess, "run", lambda *a, **k: runs.append(run(*a, **k)) or runs[-1]):
        library.compile_library(library.CUDA_SOURCE, command, path)
    return path, runs[0].stderr


@NO_NVCC
def test_cuda_library_builds_for_sm90_with_nvcc_alone(sm90_build):
    path, _ = sm90_build
    symbols = subprocess.run(["nm", "-D", "--defined-only", str(path)], capture_output=True, text=True).stdout
    assert {"adamw_step", "adamw_args_size", "adamw_error_string"} <= set(re.findall(r" T (\w+)", symbols))
    needed = subprocess.run(["readelf", "-d", str(path)], capture_output=True, text=True).stdout
    assert "libcudart.so" in needed  # the shared cudart: the one torch has loaded
    cudart = os.path.join(os.path.dirname(os.path.dirname(library._compiler("cuda")[0])), "lib64", "libcudart.so")
    if os.path.exists(cudart):  # then it loads, and its struct has Python's layout
        ctypes.CDLL(cudart, mode=ctypes.RTLD_GLOBAL)
        assert library.Library(path).lib.adamw_args_size() == ctypes.sizeof(library.AdamWArgs)


@NO_NVCC
def test_the_8bit_cuda_kernel_fits_4_blocks_an_sm_without_spills(sm90_build):
    # [Note: registers for occupancy] (csrc/adamw.cu): ptxas's own count for sm_90, every instance of the 8-bit kernel
    _, stderr = sm90_build
    # ptxas: "Compiling entry function '<name>' for 'sm_90'", then "... N bytes spill stores ..." and "Used N registers"
    entries = re.split(r"Compiling entry function '", stderr)[1:]
    # on a GPU other than sm_90 the build adds its own arch (library._cuda_arch_flags): count sm_90's entries only
    block = [e for e in entries if e.startswith("_Z18adamw_block_kernel") and re.match(r"[^']*' for 'sm_90'", e)]
    assert len(block) == 28, len(block)  # 2 grad types x 7 weight policies x 2 layouts (vector, strided)
    for e in block:
        registers = int(re.search(r"Used (\d+) registers", e).group(1))
        spills = [int(x) for x in re.findall(r"(\d+) bytes spill (?:stores|loads)", e)]
        assert registers <= 65536 // (4 * 256) and spills == [0, 0], (e.split("'")[0], registers, spills)


# ----------------------------------------------------------------------------
# building: once per process, cached on disk, and a failed build falls back to the reference


def test_build_is_attempted_once_per_process(monkeypatch):
    calls = []
    monkeypatch.setattr(kernels, "_LIBRARIES", {})
    monkeypatch.setattr(library, "build", lambda impl: calls.append(impl) or object())
    for _ in range(3):
        assert kernels.resolve_impl("auto") == "cpu"
        assert kernels.resolve_impl("cpu") == "cpu"
    assert calls == ["cpu"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="asks for the CUDA kernel where no GPU is")
def test_asking_for_the_cuda_kernel_without_a_gpu_or_for_a_kernel_of_another_device_is_one_line(monkeypatch):
    # impl='cuda' forced on a machine without a GPU says why (it would fall back under 'auto'); a kernel of one
    # device given another device's tensors is refused before any pointer is taken (the CPU stands in for the GPU:
    # impl='cpu' with 'meta' tensors, which only the reference could run)
    monkeypatch.setattr(kernels, "_LIBRARIES", {})
    with pytest.raises(RuntimeError, match=r"impl='cuda' is not available: .*no CUDA device"):
        kernels.resolve_impl("cuda", torch.device("cuda"))
    assert kernels.resolve_impl("auto", torch.device("meta")) == "reference"
    shard = Shard(512)
    meta = [None if t is None else torch.empty_like(t, device="meta")
            for t in (shard.master, shard.exp_avg, shard.exp_avg_sq, shard.param)]
    with pytest.raises(ValueError, match=r"impl='cpu' cannot run on meta tensors"):
        kernels.adamw_step(meta[0], torch.ones(512, device="meta"), meta[1], meta[2], meta[3],
                           torch.zeros(1, device="meta"), decay_numel=5, **HP, weight_decay=0.1, step=1, impl="cpu")


def test_failed_build_falls_back_to_reference_with_one_warning_and_forcing_raises(monkeypatch):
    def fail(impl):
        raise RuntimeError(f"{impl} build failed: simulated: no C++ compiler")
    monkeypatch.setattr(kernels, "_LIBRARIES", {})
    monkeypatch.setattr(library, "build", fail)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert kernels.resolve_impl("auto", torch.device("cpu")) == "reference"
        assert kernels.resolve_impl("auto", torch.device("cpu")) == "reference"
        Shard(10).step("auto", torch.ones(10), weight_decay=0.1, decay_numel=5, step=1)  # through the reference
    assert len(caught) == 1 and "simulated: no C++ compiler" in str(caught[0].message)
    with pytest.raises(RuntimeError, match="simulated"):
        kernels.resolve_impl("cpu")
    assert kernels.resolve_impl("reference") == "reference"


def test_build_failures_say_why_in_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv("NANOZERO_CACHE", str(tmp_path))
    monkeypatch.setenv("CXX", "no-such-compiler")
    with pytest.raises(RuntimeError, match=r"^cpu build failed: no C\+\+ compiler \(no-such-compiler\) on PATH$"):
        library.build("cpu")
    monkeypatch.delenv("CXX")
    with pytest.raises(RuntimeError, match=r"error.*undeclared|error.*not declared"):
        library.compile_library(library.CPU_SOURCE + "int broken() { return undeclared; }",
                                library._command("cpu"), tmp_path / "broken.so")
    assert list(tmp_path.iterdir()) == [tmp_path / "broken.lock"]  # no half-written library left behind


def test_cache_path_depends_on_source_flags_and_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("NANOZERO_CACHE", str(tmp_path))
    path = library.cache_path("cpu")
    assert path.parent == tmp_path and path.name.startswith("adamw_cpu_") and not path.exists()
    monkeypatch.setattr(library, "CPU_FLAGS", library.CPU_FLAGS + ["-DOTHER"])
    assert library.cache_path("cpu") != path
    other_flags = library.cache_path("cpu")
    monkeypatch.setattr(library, "CPU_SOURCE", library.CPU_SOURCE + "\n")
    assert library.cache_path("cpu") not in (path, other_flags)
    other_source = library.cache_path("cpu")
    run = library._run  # another CPU: one more ISA extension among -march=native's macros
    monkeypatch.setattr(library, "_run", lambda *c: run(*c) + ("\n#define __AVX512FP16__ 1" if "-dM" in c else ""))
    assert library.cache_path("cpu") not in (path, other_flags, other_source)


def test_cache_path_changes_with_the_compilers_version(monkeypatch, tmp_path):
    # the same source and flags from another compiler (g++ 12 -> 13, or nvcc 12 -> 13, whose library links another
    # libcudart) is another binary: it must not load the one the old compiler left in the cache (the compilers are
    # stood in for: only their --version line changes)
    monkeypatch.setenv("NANOZERO_CACHE", str(tmp_path))
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    cxx = library._compiler("cpu")[0]
    paths = {}
    for version in ("12.2.0", "13.1.0"):
        monkeypatch.setattr(library, "_compiler", lambda impl: (cxx if impl == "cpu" else "/opt/cuda/bin/nvcc", version))
        paths[version] = library.cache_path("cpu"), library.cache_path("cuda")
    assert all(a != b for a, b in zip(paths["12.2.0"], paths["13.1.0"])), paths


def test_a_cache_dir_that_cannot_be_made_falls_back_to_the_reference_with_one_warning(monkeypatch, tmp_path):
    # NANOZERO_CACHE under a file (or a read-only home): creating the cache raises an OSError, which the build turns
    # into its one-line RuntimeError, so 'auto' falls back with one warning and the run trains, where it would have died
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("NANOZERO_CACHE", str(tmp_path / "file" / "cache"))
    with pytest.raises(RuntimeError, match=r"^cpu build failed: .*file"):
        library.build("cpu")
    monkeypatch.setattr(kernels, "_LIBRARIES", {})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert kernels.resolve_impl("auto", torch.device("cpu")) == "reference"
    assert len(caught) == 1 and "cpu build failed" in str(caught[0].message)


def test_a_build_leaves_out_the_flags_nvcc_takes_from_the_environment(monkeypatch, tmp_path):
    # NVCC_APPEND_FLAGS=--use_fast_math (another project's) built approximate square roots into a library cached under
    # the IEEE build's name; the compiler, stood in for, writes what it saw of those variables
    monkeypatch.setenv("NVCC_APPEND_FLAGS", "--use_fast_math")
    monkeypatch.setenv("NVCC_PREPEND_FLAGS", "-O0")
    saw = "import os, sys; open(sys.argv[2], 'w').write(repr([os.environ.get(k) for k in sorted(os.environ) if 'NVCC_' in k]))"
    library.compile_library("", [sys.executable, "-c", saw], tmp_path / "lib.so")
    assert (tmp_path / "lib.so").read_text() == "[]"


def test_the_cuda_library_is_built_only_with_an_nvcc_of_torchs_cuda_major(monkeypatch):
    # torch cu12x with nvcc 13 (or the reverse): the library would load libcudart.so.13 beside torch's .so.12 and fail
    # at the first step, if its driver cannot run it; now the build fails, and the step falls back, saying why
    monkeypatch.setattr(library.torch.version, "cuda", "12.8")
    monkeypatch.setattr(library, "_compiler", lambda impl: ("/opt/nvcc", "Cuda compilation tools, release 13.0, V13.0.88"))
    with pytest.raises(RuntimeError, match=r"cuda build failed: nvcc is CUDA 13 and torch runs CUDA 12\.8: put CUDA 12's"):
        library.build("cuda")
    library.same_cuda_as_torch("Cuda compilation tools, release 12.4, V12.4.131")  # another minor: the same cudart
    monkeypatch.setattr(library.torch.version, "cuda", None)  # a CPU build of torch: nothing to compare
    library.same_cuda_as_torch("Cuda compilation tools, release 13.0, V13.0.88")


def test_a_built_library_is_loaded_without_taking_the_lock(monkeypatch, tmp_path):
    # a read-only or shared cache: nothing to write when the library is there (the lock file cannot be opened here)
    monkeypatch.setenv("NANOZERO_CACHE", str(tmp_path))
    path = library.cache_path("cpu")
    library.compile_library(library.CPU_SOURCE, library._command("cpu"), path)
    path.with_suffix(".lock").unlink()
    path.with_suffix(".lock").mkdir()  # open(..., "w") on it raises IsADirectoryError
    library.compile_library(library.CPU_SOURCE, library._command("cpu"), path)
    assert library.Library(path).lib.adamw_args_size() == ctypes.sizeof(library.AdamWArgs)


def test_concurrent_processes_build_once_and_later_ones_only_load(tmp_path):
    # two processes start on an empty cache: one builds while the other waits on the lock; both load the same file
    code = "import kernels, time; t = time.time(); kernels.resolve_impl('cpu'); print(time.time() - t)"
    env = {**os.environ, "NANOZERO_CACHE": str(tmp_path)}
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    times = [float(p.communicate(timeout=300)[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    lock, built = sorted(tmp_path.iterdir())  # one library, its lock file, no temporary directory left behind
    assert built.suffix == ".so" and lock.suffix == ".lock"
    mtime = built.stat().st_mtime_ns
    later = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert later.returncode == 0 and built.stat().st_mtime_ns == mtime
    assert float(later.stdout) < min(times) / 3  # loading only: no compiler run


def test_a_struct_layout_mismatch_is_a_clear_error(monkeypatch):
    kernels.resolve_impl("cpu")
    path = library.cache_path("cpu")

    class Bigger(library.AdamWArgs):
        _fields_ = [("extra", ctypes.c_int64)]
    monkeypatch.setattr(library, "AdamWArgs", Bigger)
    with pytest.raises(RuntimeError, match="the two must list the same fields"):
        library.Library(path)


def logged_device(log):
    """A stand-in for torch.cuda.device (a context manager): ("enter", device) and ("exit",) into log around its block."""
    @contextlib.contextmanager
    def device(gpu):
        log.append(("enter", gpu))
        yield
        log.append(("exit",))
    return device


def test_on_cuda_a_library_call_runs_on_its_gpus_current_stream_and_a_cuda_error_is_named(monkeypatch):
    # Library.call's CUDA branch, torch.cuda's device and stream stood in for: inside the tensors' GPU as current
    # device, the entry point gets that GPU's current stream as its last argument; a non-zero cudaError_t is a
    # RuntimeError naming the entry point and the library's own error string. On a GPU: test_gpu.py's
    # test_the_kernel_runs_on_the_current_stream.
    log, codes = [], [700, 0]
    lib = mock.Mock(spec=["adamw_step", "adamw_error_string"])
    lib.adamw_step.side_effect = lambda *args: log.append(("step", *args)) or codes.pop(0)
    lib.adamw_error_string.side_effect = lambda code: log.append(("error_string", code)) or b"an illegal memory access"
    built = object.__new__(library.Library)  # no build: call() needs only .lib
    built.lib = lib

    monkeypatch.setattr(torch.cuda, "device", logged_device(log))
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda device=None: log.append(("stream",)) or mock.Mock(cuda_stream=0x1234))
    with pytest.raises(RuntimeError, match=r"^nanozero adamw_step launch failed: an illegal memory access$"):
        built.call("adamw_step", torch.device("cuda", 1), "args")
    built.call("adamw_step", torch.device("cuda", 1), "args")  # cudaSuccess: returns
    call = [("enter", torch.device("cuda", 1)), ("stream",), ("step", "args", 0x1234), ("exit",)]
    assert [entry[:2] + (entry[2].value,) if entry[0] == "step" else entry for entry in log] == (
        call + [("error_string", 700)] + call)


def test_kernel_rejects_bad_shapes_dtypes_and_arguments():
    shard = Shard(512, "fp32+bf16param")
    kw = dict(**HP, weight_decay=0.1, step=1, impl="cpu")

    def call(grad=torch.ones(512), master=shard.master, param=shard.param, exp_avg=shard.exp_avg, absmax=None,
             decay_numel=5, **extra):
        kernels.adamw_step(master, grad, exp_avg, shard.exp_avg_sq, param, torch.zeros(1), decay_numel=decay_numel,
                           absmax=absmax, **kw, **extra)

    with pytest.raises(ValueError, match="decay_numel"):
        call(decay_numel=513)
    with pytest.raises(ValueError, match="master must be contiguous with 511 elements"):
        call(grad=torch.ones(511))
    with pytest.raises(ValueError, match="grad must be contiguous.*non-contiguous"):
        call(grad=torch.ones(1024)[::2])
    with pytest.raises(TypeError, match="grad must be float32 or bfloat16"):
        call(grad=torch.ones(512, dtype=torch.float16))
    with pytest.raises(TypeError, match="exp_avg and exp_avg_sq must both be"):
        call(exp_avg=shard.exp_avg.bfloat16())
    with pytest.raises(TypeError, match=r"\(master, param\) dtypes"):
        call(master=shard.master.to(torch.int16), param=shard.param.float())
    with pytest.raises(ValueError, match="rounding_seed"):
        call(rounding_seed=3)
    with pytest.raises(ValueError, match="absmax is only for uint8"):
        call(absmax=(torch.zeros(2), torch.zeros(2)))
    for bad in (dict(beta2=1.0), dict(beta1=-0.1), dict(beta2=float("nan")), dict(step=0)):
        with pytest.raises(ValueError, match="needs 0 <= beta1, beta2 < 1 and a 1-based step"):
            kernels.adamw_step(shard.master, torch.ones(512), shard.exp_avg, shard.exp_avg_sq, shard.param,
                               torch.zeros(1), decay_numel=5, **{**kw, **bad})
    # cast_param's kernel path (a stage-3 gather's cast) too: before, a bf16 master was read as fp32, past its end,
    # an fp64 one cast to garbage, and impl='cpu' on tensors elsewhere segfaulted
    for master in (torch.ones(4, dtype=torch.bfloat16), torch.ones(4, dtype=torch.float64)):
        with pytest.raises(TypeError, match=f"the master is {master.dtype}: pass the fp32 master"):
            kernels.cast_param(master, torch.bfloat16, impl="auto")
    with pytest.raises(ValueError, match="impl='cpu' cannot run on meta tensors"):
        kernels.cast_param(torch.ones(100_000, device="meta"), torch.bfloat16, impl="cpu")
    uint8 = Shard(512, "fp32+bf16param", "uint8")
    with pytest.raises(ValueError, match="uint8 state needs n a multiple of 256"):
        kernels.adamw_step(uint8.master[:500], torch.ones(500), uint8.exp_avg[:500], uint8.exp_avg_sq[:500],
                           uint8.param[:500], torch.zeros(1), decay_numel=5, absmax=uint8.absmax, **kw)
    for absmax in ((uint8.absmax[0], None), (None, uint8.absmax[1])):  # either missing: a null pointer otherwise
        with pytest.raises(ValueError, match="uint8 state needs"):
            kernels.adamw_step(uint8.master, torch.ones(512), uint8.exp_avg, uint8.exp_avg_sq, uint8.param,
                               torch.zeros(1), decay_numel=5, absmax=absmax, **kw)

# ----------------------------------------------------------------------------
# Precision: the per-mode description zero.py sizes its layout and tables with


def test_8bit_moments_start_as_the_codes_of_zero_without_quantizing_a_shard_of_zeros():
    # Precision.zero_moments at engine build: before, n fp32 zeros went through quantize (its temporaries and
    # searchsorted's int64 codes), ~17 bytes an element at once for a state that keeps 2.03, before the first step
    n, precision = 1 << 16, kernels.Precision(state_dtype="int8")
    profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
    with profiler:
        m, v, absmax = precision.zero_moments(n, torch.device("cpu"))
    sizes = [e.nbytes() for e in sorted(profiler.profiler.kineto_results.events(), key=lambda e: e.start_ns())
             if e.name() == "[memory]"]
    held = 2 * n + 2 * 4 * n // 256  # the codes and the absmaxes
    assert max(itertools.accumulate(sizes)) <= held + 16 * 1024, (max(itertools.accumulate(sizes)), held)
    for codes, signed, scale in ((m, True, absmax[0]), (v, False, absmax[1])):
        expected_codes, expected_absmax = kernels.quantize(torch.zeros(n), signed)
        assert torch.equal(codes, expected_codes) and torch.equal(scale, expected_absmax)
        assert (codes.dtype, scale.dtype) == (torch.uint8, torch.float32)
    with pytest.raises(ValueError, match="1000 is not a multiple of 256"):  # as quantize refuses one (a view error)
        precision.zero_moments(1000, torch.device("cpu"))


def test_precision_check_names_the_problem_and_the_fix():
    bf16, fp32 = torch.bfloat16, torch.float32
    for precision, param_dtype, match in (
            (kernels.Precision(master_weights="remainder"), fp32, "needs|use param_dtype bfloat16"),
            (kernels.Precision(master_weights="none"), torch.float16, "use param_dtype bfloat16"),
            (kernels.Precision(stochastic_rounding=True), bf16, "needs master_weights='none'"),
            (kernels.Precision(master_weights="fp16"), bf16, "use 'fp32', 'remainder' or 'none'"),
            (kernels.Precision(state_dtype="int4"), bf16, "use 'float32', 'bfloat16' or 'int8'")):
        with pytest.raises(ValueError, match=match):
            precision.check(param_dtype)
    kernels.Precision(master_weights="none", state_dtype="int8", stochastic_rounding=True).check(bf16)


def test_precision_describes_dtypes_bytes_and_the_risky_combinations():
    bf16, fp32 = torch.bfloat16, torch.float32
    default, remainder8 = kernels.Precision(), kernels.Precision("remainder", "int8")
    assert default.master_dtype(bf16) == fp32 and default.master_dtype(fp32) is None
    assert remainder8.master_dtype(bf16) == torch.int16 and kernels.Precision("none").master_dtype(bf16) is None
    assert remainder8.state_torch_dtype == torch.uint8 and remainder8.align == 256 and default.align == 1
    assert default.bytes_per_element(bf16) == {"master": 4, "exp_avg": 4, "exp_avg_sq": 4}
    assert default.bytes_per_element(fp32)["master"] == 0  # the fp32 params are the master
    assert remainder8.bytes_per_element(bf16) == {"master": 2, "exp_avg": 1 + 4 / 256, "exp_avg_sq": 1 + 4 / 256}
    assert default.warning() is None and kernels.Precision("none").warning() is None
    assert "no fp32 copy of the weights" in kernels.Precision("none", "int8").warning()
    assert "with bfloat16 state" in kernels.Precision("none", "bfloat16").warning()

# ----------------------------------------------------------------------------
# bench.py kernels


@pytest.mark.parametrize("grad_dtype", ["float32", "bfloat16"])
def test_bench_kernels_prints_a_row_per_size(grad_dtype):
    out = subprocess.run([sys.executable, "bench.py", "kernels", "--device", "cpu", "--sizes", "1000,4K",
                          "--grad_dtype", grad_dtype], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line.split() for line in out.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert [row[0] for row in rows] == ["1,000", "4,096"] and all(len(row) == 9 for row in rows)


def test_bench_kernels_ratios_are_our_time_over_torchs(monkeypatch, capsys):
    # bench.py kernels, the timings stood in for: ours 1 ms, torch's fused step + cast 2 ms, foreach 4 ms: ratios 0.50
    # and 0.25 (below 1: ours faster, the goal <= 0.9), the bytes moved at 1 ms against a 1 ms copy of the copy's bytes
    import argparse

    import bench
    monkeypatch.setattr(bench, "time_ms", lambda fns, device, repeats=10, warmup=3: {
        key: {"ours": 1.0, "fused": 2.0, "foreach": 4.0, "copy": 1.0}[key] for key in fns})
    bench.bench_kernels(argparse.Namespace(device="cpu", sizes="1000", modes=False, grad_dtype="float32", against=None))
    [row] = [line.split() for line in capsys.readouterr().out.splitlines() if line.strip().startswith("1,000")]
    assert row[2:] == ["1.00", "0.0", f"{30 * 1000 / (8 * 2**26):.2f}", "2.00", "0.50", "4.00", "0.25"], row


@pytest.mark.parametrize("args, line", [
    (["kernels", "--device", "cpu", "--sizes", "4K,0"], "bench.py kernels: --sizes: '0' is not a shard size: give "
                                                        "elements, e.g. 1000, 4K, 16M"),  # was a ZeroDivisionError
    (["scale", "--world", "-4"], "bench.py scale: --world -4: give the number of ranks to be rank 0 of, at least 1"),
    (["scale", "--kinds", "zero3,zero4"], "bench.py scale: unknown kinds ['zero4']: choose from zero1,zero2,zero3,fsdp2"),
    (["scale", "--world", "8", "--set", "n_layerz=2"], "bench.py scale: unknown config key 'n_layerz' in --n_layerz=2; "
                                                       "did you mean n_layer?"),
    (["kernels", "--device", "cpu", "--modes", "--sizes", "100"],  # was 0 elements after rounding, a ZeroDivisionError
     "bench.py kernels: --sizes 100: --modes needs sizes of at least 256 (one 8-bit block)"),
    (["zero", "--set", "device=tpu"], "bench.py zero: device='tpu': use 'cpu' (gloo), or 'cuda' (nccl) where torch sees "
                                      f"a GPU (torch.cuda.is_available() is {torch.cuda.is_available()} here)"),
    (["link"], "bench.py link: needs at least 2 ranks: torchrun --standalone --nproc_per_node=2 bench.py link")])
def test_bench_py_says_what_it_cannot_run_in_one_line(args, line):
    # before: a traceback each (--world -4: four, then a table of kinds that did not run, and exit code 0; zero's
    # device=tpu: torch.device's, as the process group started; link alone: torch's env:// error, with no fix)
    out = subprocess.run([sys.executable, "bench.py", *args], capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")})  # not under torchrun
    assert out.returncode == 2 and out.stderr == line + "\n", out.stderr[-2000:]


def test_bench_kernels_on_cuda_without_a_gpu_says_use_cpu(monkeypatch):
    # before: torch's AssertionError "Torch not compiled with CUDA enabled", from the first CUDA tensor
    import argparse

    import bench
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"^--device cuda: torch sees no GPU here, use --device cpu$"):
        bench.bench_kernels(argparse.Namespace(device="cuda", sizes="1K", modes=False, grad_dtype="float32", against=None))


def test_the_references_code_maps_are_copied_to_a_device_once():
    # kernels._maps_on: on a GPU each copy from pageable host memory is a host sync (test_gpu.py counts none)
    kernels._maps_on.cache_clear()
    x = torch.randn(256 * 4)
    for _ in range(3):
        codes, absmax = kernels.quantize(x, signed=True)
        kernels.dequantize(codes, absmax, signed=True)
        kernels.quantize(x.abs(), signed=False)
    assert kernels._maps_on.cache_info().misses == 2  # one per map (signed, unsigned) and device
    assert torch.equal(kernels._maps_on(torch.device("cpu"), True)[0], kernels.SIGNED_MAP)


def bench_modes_rows(device, size, label, timeout, *more):
    """`bench.py kernels --modes` run on one size: its table rows, checked to be one per mode, in order."""
    import bench
    out = subprocess.run([sys.executable, "bench.py", "kernels", "--device", device, "--sizes", size, "--modes", *more],
                         capture_output=True, text=True, timeout=timeout, cwd=os.path.dirname(os.path.abspath(__file__)))
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line for line in out.stdout.splitlines() if line.strip().startswith(label)]
    assert [row[12:43].strip() for row in rows] == [mode[0] for mode in bench.PRECISION_MODES]
    return rows


def test_bench_kernels_modes_prints_a_row_per_mode():
    rows = bench_modes_rows("cpu", "4K", "4,096", timeout=300)
    assert float(rows[0].split()[-2]) == 1.0  # ratio: the first mode against itself
    of_copy = [float(row.split()[-1]) for row in rows]  # the fraction of the copy bandwidth of each mode's bytes
    assert all(0.0 < f < 100.0 for f in of_copy), of_copy


@pytest.mark.skipif(not {"avx2", "fma"} <= cpu_flags(), reason="-march=haswell code needs an x86 CPU with AVX2 and FMA")
def test_bench_kernels_against_a_commit_before_the_rotated_bucket_tables_gets_the_tables_in_order(monkeypatch, tmp_path):
    # --against 18550ab (before 6b343c3 stored the 8-bit bucket tables rotated): its code_of reads them in order. Here
    # today's csrc/ with code_of's index as it was then, a folder for --against. Built for AVX2 (the buckets' encode; a
    # CPU with VBMI never reads them), it gets every int8 code right only if with_library hands it the tables in order,
    # as a GPU's build would need too (a review found every int8 mode failing there).
    import bench
    index = "(buckets + 32768)[(int32_t)b >> 16]"
    common = (library.CSRC / "adamw_common.h").read_text()
    assert common.count(index) == 1, "update this test to code_of's index"
    (tmp_path / "adamw_cpu.cpp").write_text((library.CSRC / "adamw_cpu.cpp").read_text())
    (tmp_path / "adamw_common.h").write_text(common.replace(index, "(buckets + 32768)[(int32_t)(b ^ 0x80000000u) >> 16]"))
    monkeypatch.setattr(library, "CPU_FLAGS", [*library.CPU_FLAGS, "-march=haswell"])
    old = bench.library_at(str(tmp_path), "cpu")
    assert old.buckets_in_order and not bench.library_at("HEAD", "cpu").buckets_in_order
    assert bench.same_bits("cpu", old, torch.device("cpu")) == [m[0] for m in bench.PRECISION_MODES]
    assert kernels._code_tables.__module__ == "kernels"  # today's tables are back after the swap


def test_bench_kernels_modes_against_a_commit_runs_that_commits_kernel_in_turns():
    # --against REV: csrc/ at REV, built and loaded beside today's library; each mode's "vs REV" column. HEAD's csrc/
    # is today's in a clean clone (the same cached library); the swap is checked in process: the library at REV
    # runs inside with_library, and today's is back after it, an exception or not.
    import bench
    rows = bench_modes_rows("cpu", "4K", "4,096", 300, "--against", "HEAD")
    assert all(0.0 < float(row.split()[-1]) < 100.0 for row in rows)  # vs HEAD: a time ratio
    ours, theirs = kernels._LIBRARIES[kernels.resolve_impl("cpu")], bench.library_at("HEAD", "cpu")
    seen = []
    bench.with_library("cpu", theirs, lambda: seen.append(kernels._LIBRARIES["cpu"]))
    with pytest.raises(ZeroDivisionError):
        bench.with_library("cpu", theirs, lambda: 1 / 0)
    assert seen == [theirs] and kernels._LIBRARIES["cpu"] is ours
    a, b = Shard(512, "fp32+bf16param", "uint8"), Shard(512, "fp32+bf16param", "uint8")
    grad = spiky_grad(512, torch.Generator().manual_seed(3))
    a.step("cpu", grad, weight_decay=0.1, decay_numel=300, step=1)
    bench.with_library("cpu", theirs, lambda: b.step("cpu", grad, weight_decay=0.1, decay_numel=300, step=1))
    assert all(same_bits(x, y) for x, y in zip(a.tensors(), b.tensors()))
    with pytest.raises(SystemExit, match="--against no-such-rev: git cannot show csrc/"):
        bench.library_at("no-such-rev", "cpu")
    assert bench.library_at(str(library.CSRC), "cpu").lib._name == str(library.cache_path("cpu"))  # a folder: csrc/


def test_bench_modes_against_several_kernels_checks_each_bit_for_bit_first(tmp_path):
    # --against A,B: a pair of columns per kernel, after bench.same_bits names the modes each leaves bit for bit as
    # ours does. A kernel whose stochastic rounding key skips one mix must differ in exactly the two stochastic modes.
    import bench
    other = tmp_path / "csrc"
    shutil.copytree(library.CSRC, other)
    common = (other / "adamw_common.h").read_text()
    assert "return lowbias32(lowbias32(seed) ^ step);" in common
    (other / "adamw_common.h").write_text(common.replace("lowbias32(lowbias32(seed) ^ step)", "lowbias32(seed ^ step)"))
    out = subprocess.run([sys.executable, "bench.py", "kernels", "--device", "cpu", "--sizes", "4K", "--modes",
                          "--against", f"HEAD,{other}"], capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.abspath(__file__)))
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    assert "HEAD: the same bits as ours after 3 steps in every mode" in lines
    stochastic = [m[0] for m in bench.PRECISION_MODES if m[4]]
    n = len(bench.PRECISION_MODES)
    differ = f"{n - 2} of {n} modes, not in: {', '.join(stochastic)}"
    assert f"{other}: the same bits as ours after 3 steps in {differ}" in lines
    header = next(line for line in lines if line.split()[:2] == ["n", "mode"])
    assert "vs HEAD" in header and header.rstrip().endswith(f"vs {other}")  # a pair of columns per kernel
    rows = [line for line in lines if line.strip().startswith("4,096")]
    assert len(rows) == n
    assert all(0.0 < float(row.split()[i]) < 100.0 for row in rows for i in (-1, -3))  # vs HEAD and vs the other

"""
Tests for kernels.py: the reference is torch.optim.AdamW, and each kernel is the reference.

    python -m pytest -q test_kernels.py

The first run builds the CPU extension (~25 s on 2 cores); later runs load it from the torch extensions dir.
"""
import functools
import os
import re
import shutil
import subprocess
import sys
import warnings

import pytest
import torch

import kernels

HP = dict(lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8)
# Kernel vs reference, fp32 outputs: rtol 1e-6 is ~8 ulps. The kernels round every op correctly; the reference
# does not quite: torch's CPU sqrt (MKL) is an ulp off for ~15% of inputs, and on CUDA torch divides by a
# Python scalar as a multiply by its reciprocal. That moves the master by about an ulp per step.
# atol only matters where master * decay - update cancels to ~0: the operands are then as small as one update,
# <= lr / (1 - beta1) = 1e-2 (as |exp_avg| <~ sqrt(exp_avg_sq)), whose ulp is ~1e-9: 1e-8 is ~8 of those ulps.
TOL = dict(rtol=1e-6, atol=1e-8)

# 'cuda-emulated' is the CUDA source compiled for the host (below): it runs wherever the CUDA headers exist,
# GPU or not. The real 'cuda' cases exist only where a GPU is.
CUDA_INCLUDE = os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "include")
HAVE_CUDA_HEADERS = os.path.exists(os.path.join(CUDA_INCLUDE, "cuda_bf16.h"))
KERNELS = ["cpu"] + (["cuda-emulated"] if HAVE_CUDA_HEADERS else []) + (["cuda"] if torch.cuda.is_available() else [])
ALL_IMPLS = ["reference"] + KERNELS


def device_of(impl):
    return torch.device("cuda" if impl == "cuda" else "cpu")


def adamw(impl, *tensors, **hp):
    """kernels.adamw_step(*tensors, impl=impl, **hp), or the same call into the host-emulated CUDA kernel."""
    if impl != "cuda-emulated":
        return kernels.adamw_step(*tensors, impl=impl, **hp)
    hp = {"grad_scale": 1.0, **hp}  # the binding takes the hyperparameters positionally, in this order
    names = ("decay_numel", "step", "lr", "beta1", "beta2", "eps", "weight_decay", "grad_scale")
    cuda_on_host().adamw_step(*tensors, *(hp[name] for name in names))


def make_shard(n, grad_dtype, param_dtype, device, seed=0):
    """Random, never all-zero optimizer state for an n-element shard: (master, exp_avg, exp_avg_sq, param)."""
    gen = torch.Generator().manual_seed(seed)
    master = torch.randn(n, generator=gen)
    exp_avg = 0.1 * torch.randn(n, generator=gen)
    exp_avg_sq = exp_avg.square() + 0.01 * torch.rand(n, generator=gen)  # >= exp_avg^2, as Adam's moments are
    state = [t.to(device) for t in (master, exp_avg, exp_avg_sq)]
    return state + [torch.empty(n, dtype=param_dtype, device=device)]


def step_both(impl, state, ref_state, grad, **kw):
    """One step of impl on state and of the reference on ref_state, each with its own found_inf."""
    for which, (master, exp_avg, exp_avg_sq, param) in ((impl, state), ("reference", ref_state)):
        found_inf = torch.zeros(1, device=master.device)
        adamw(which, master, grad, exp_avg, exp_avg_sq, param, found_inf, **HP, **kw)
        assert found_inf.item() == 0.0

# ----------------------------------------------------------------------------
# the reference is torch's AdamW


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
# each kernel is the reference


@pytest.mark.parametrize("impl", KERNELS)
@pytest.mark.parametrize("n", [1, 7, 4097, 1_000_003])
@pytest.mark.parametrize("grad_dtype,param_dtype", [
    pytest.param(torch.float32, torch.float32, id="fp32grad-fp32param"),
    pytest.param(torch.float32, torch.bfloat16, id="fp32grad-bf16param"),
    pytest.param(torch.bfloat16, torch.float32, id="bf16grad-fp32param"),
    pytest.param(torch.bfloat16, torch.bfloat16, id="bf16grad-bf16param")])
@pytest.mark.parametrize("weight_decay,decay_split", [
    pytest.param(0.0, 0.0, id="no-decay"), pytest.param(0.1, 0.5, id="half-decayed"), pytest.param(0.1, 1.0, id="all-decayed")])
def test_kernel_matches_reference(impl, n, grad_dtype, param_dtype, weight_decay, decay_split):
    device = device_of(impl)
    state = make_shard(n, grad_dtype, param_dtype, device)
    ref_state = [t.clone() for t in state]
    decay_numel = int(n * decay_split)  # 0 (none), the middle, or n (all decayed)
    gen = torch.Generator().manual_seed(1)
    for step in (1, 2, 10):  # bias correction changes with step; the states evolve across steps
        grad = torch.randn(n, generator=gen).to(device=device, dtype=grad_dtype)
        step_both(impl, state, ref_state, grad, weight_decay=weight_decay, decay_numel=decay_numel, step=step,
                  grad_scale=0.37)
        for out, ref in zip(state[:3], ref_state[:3]):  # master, exp_avg, exp_avg_sq
            torch.testing.assert_close(out, ref, **TOL)
        master, param = state[0], state[3]
        if param_dtype == torch.float32:
            torch.testing.assert_close(param, master, rtol=0, atol=0)
        else:  # round-to-nearest-even of the kernel's own fp32 result, exactly as torch rounds it
            assert torch.equal(param.view(torch.int16), master.to(torch.bfloat16).view(torch.int16))


@pytest.mark.parametrize("impl", KERNELS)
def test_kernel_param_can_be_an_unaligned_view_into_a_bigger_buffer(impl):
    device = device_of(impl)
    n = 1001
    master, exp_avg, exp_avg_sq, _ = make_shard(n, torch.float32, torch.bfloat16, device)
    ref_state = [master.clone(), exp_avg.clone(), exp_avg_sq.clone(), torch.empty(n, dtype=torch.bfloat16, device=device)]
    buffer = torch.full((n + 3,), 7.0, dtype=torch.bfloat16, device=device)
    param = buffer[1:n + 1]  # starts 2 bytes in: not 8-byte aligned, so the GPU takes the scalar path
    grad = torch.randn(n, device=device)
    step_both(impl, [master, exp_avg, exp_avg_sq, param], ref_state, grad, weight_decay=0.1, decay_numel=500, step=3)
    torch.testing.assert_close(master, ref_state[0], **TOL)
    assert torch.equal(param, master.to(torch.bfloat16))
    assert buffer[0].item() == 7.0 and buffer[n + 1:].eq(7.0).all()  # neighbours untouched


@pytest.mark.parametrize("impl", KERNELS)
def test_kernel_bf16_param_rounds_to_nearest_even_and_keeps_nan(impl):
    device = device_of(impl)
    bits = torch.tensor([0x3F808000, 0x3F818000, 0x3F808001, 0x3F807FFF,  # ties to even, above and below a tie
                         0x7F7FFFFF, 0xFF7FFFFF, 0x00000001, 0x80000000,  # rounds to +-inf, a denormal, -0
                         0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001,  # +-inf, quiet NaN, NaN that could carry into inf
                         0xFFFFFFFF], dtype=torch.int64).to(torch.int32)
    master = bits.view(torch.float32).to(device)
    n = master.numel()
    param = torch.empty(n, dtype=torch.bfloat16, device=device)
    zeros = torch.zeros(n, device=device)
    # lr = 0 and no decay: master comes out as it went in, and param is its rounding
    adamw(impl, master.clone(), zeros, zeros.clone(), zeros.clone(), param, torch.zeros(1, device=device),
          lr=0.0, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, decay_numel=0, step=1)
    expected = master.to(torch.bfloat16)
    is_nan = master.isnan()
    assert torch.equal(param[~is_nan].view(torch.int16), expected[~is_nan].view(torch.int16))
    assert param[is_nan].isnan().all()

# ----------------------------------------------------------------------------
# found_inf


@pytest.mark.parametrize("impl", ALL_IMPLS)
def test_found_inf_is_set_by_one_inf_or_nan_and_accumulates(impl):
    device = device_of(impl)
    n = 4097
    master, exp_avg, exp_avg_sq, param = make_shard(n, torch.float32, torch.bfloat16, device)
    found_inf = torch.zeros(1, device=device)

    def step(grad, grad_scale=1.0):
        adamw(impl, master, grad, exp_avg, exp_avg_sq, param, found_inf, **HP, weight_decay=0.1,
              decay_numel=100, step=1, grad_scale=grad_scale)
        return found_inf.item()

    clean = torch.randn(n, device=device)
    assert step(clean) == 0.0 and step(clean.bfloat16()) == 0.0  # clean grads leave it at 0
    for bad_index, bad_value in ((4096, float("inf")), (1000, float("nan")), (7, float("-inf")), (3000, float("inf"))):
        bad = clean.clone()
        bad[bad_index] = bad_value  # GPU: 4096 is in the tail launch; 7 and 1000 in block 0, 3000 in block 2
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
# the CUDA source compiles on its own


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH: cannot compile-check the CUDA source")
def test_cuda_source_compiles_with_nvcc_without_torch(tmp_path):
    source = tmp_path / "adamw.cu"
    source.write_text(kernels.CUDA_SOURCE)
    result = subprocess.run(["nvcc", "-c", "-arch=sm_90", *kernels.CUDA_FLAGS, "-o", str(tmp_path / "adamw.o"), str(source)],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "adamw.o").stat().st_size > 0


@pytest.mark.skipif(torch.version.cuda is None or shutil.which("nvcc") is None,
                    reason="needs a CUDA build of torch and nvcc (a GPU is not needed)")
def test_cuda_extension_builds_and_loads(monkeypatch):
    # the real build: load_inline, torch's CUDA headers, the binding and glue; without a GPU, for sm_90
    if not torch.cuda.is_available():
        monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")
    assert callable(kernels._build("cuda").adamw_step)

# ----------------------------------------------------------------------------
# the CUDA kernel, run on the host: where no GPU is, this is how its indexing, vector/tail split, bf16 rounding
# and found_inf vote get executed at all. The CUDA_SOURCE text is compiled by the host compiler, unchanged but
# for its two <<<grid, block>>> launches, with the CUDA built-ins defined below. What it cannot show: races,
# misaligned-access faults, launch limits, speed, and the GPU's own arithmetic (here the host's fmaf, sqrtf and
# cuda_bf16.h's host conversions stand in for the device instructions). Those need the 'cuda' cases on a GPU.

HOST_CUDA_PRELUDE = r"""
#include <torch/extension.h>
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cmath>
using std::isfinite;
#undef __global__
#undef __device__
#undef __forceinline__
#define __global__ static
#define __device__
#define __forceinline__ inline
#define threadIdx host_threadIdx
#define blockIdx host_blockIdx
#define blockDim host_blockDim
#define cudaGetLastError() cudaSuccess
static dim3 host_threadIdx, host_blockIdx, host_blockDim;
static int host_block_vote;
// A block's threads run one after another, the highest index first, so thread 0 runs last and its
// __syncthreads_or sees every thread's vote: exact for a kernel in which only thread 0 acts on the result.
static int __syncthreads_or(int vote) { return host_block_vote |= vote; }
template <typename Kernel, typename... Args>
static void host_launch(Kernel kernel, unsigned grid, unsigned block, Args... args) {
  host_blockDim = dim3(block);
  for (unsigned b = 0; b < grid; ++b) {
    host_blockIdx = dim3(b); host_block_vote = 0;
    for (int t = (int)block - 1; t >= 0; --t) { host_threadIdx = dim3(t); kernel(args...); }
  }
}
"""


@functools.cache
def cuda_on_host():
    from torch.utils import cpp_extension
    launch = re.compile(r"(adamw_kernel<[^;]*?>)<<<(.*?), (\w+), 0, stream>>>\((.*?)\);")
    assert len(launch.findall(kernels.CUDA_SOURCE)) == 2, "update the launch pattern to the CUDA source"
    source = launch.sub(r"host_launch(\1, \2, \3, \4);", kernels.CUDA_SOURCE)
    glue = "void adamw_launch(const AdamWArgs& a) { TORCH_CHECK(adamw_cuda(a, nullptr) == cudaSuccess); }\n"
    return cpp_extension.load_inline(
        name="nanozero_adamw_cuda_on_host", cpp_sources=[HOST_CUDA_PRELUDE + source + kernels.BINDING + glue],
        functions=["adamw_step"], extra_cflags=["-O2", "-ffp-contract=off", "-I" + CUDA_INCLUDE], verbose=False)


@pytest.mark.parametrize("impl", [k for k in KERNELS if k.startswith("cuda")])
def test_cuda_kernel_equals_the_cpu_kernel_bit_for_bit(impl):
    # same math, same roundings (explicit fma only, IEEE sqrt and divide, round-to-nearest-even bf16): the CUDA
    # source agrees with the CPU loop exactly, on the host and (the claim a first GPU run checks) on a GPU
    n = 4097 * 3  # 12288 in the vector kernel, 3 in the tail
    for grad_dtype, param_dtype in ((torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)):
        state = make_shard(n, grad_dtype, param_dtype, "cpu")
        other = [t.to(device_of(impl)) for t in state]
        gen = torch.Generator().manual_seed(2)
        for step in (1, 2, 3):
            grad = torch.randn(n, generator=gen).to(grad_dtype)
            for which, tensors, g in (("cpu", state, grad), (impl, other, grad.to(device_of(impl)))):
                master, exp_avg, exp_avg_sq, param = tensors
                adamw(which, master, g, exp_avg, exp_avg_sq, param, torch.zeros(1, device=g.device), **HP,
                      weight_decay=0.1, decay_numel=5001, step=step, grad_scale=0.37)  # 5001: mid-vector
            for a, b in zip(state, other):
                assert torch.equal(a, b.cpu())

# ----------------------------------------------------------------------------
# building: once per process, and a failed build falls back to the reference


def test_build_is_attempted_once_per_process(monkeypatch):
    calls = []
    monkeypatch.setattr(kernels, "_EXTENSIONS", {})
    monkeypatch.setattr(kernels, "_build", lambda impl: calls.append(impl) or object())
    for _ in range(3):
        assert kernels.resolve_impl("auto") == "cpu"
        assert kernels.resolve_impl("cpu") == "cpu"
    assert calls == ["cpu"]


def test_failed_build_falls_back_to_reference_with_one_warning_and_forcing_raises(monkeypatch):
    def fail(impl):
        raise RuntimeError(f"{impl} build failed: simulated: no C++ compiler")
    monkeypatch.setattr(kernels, "_EXTENSIONS", {})
    monkeypatch.setattr(kernels, "_build", fail)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert kernels.resolve_impl("auto", torch.device("cpu")) == "reference"
        assert kernels.resolve_impl("auto", torch.device("cpu")) == "reference"
        # adamw_step still works, through the reference
        master, exp_avg, exp_avg_sq, param = make_shard(10, torch.float32, torch.float32, "cpu")
        kernels.adamw_step(master, torch.ones(10), exp_avg, exp_avg_sq, param, torch.zeros(1), **HP,
                           weight_decay=0.1, decay_numel=5, step=1)
    assert len(caught) == 1 and "simulated: no C++ compiler" in str(caught[0].message)
    with pytest.raises(RuntimeError, match="simulated"):
        kernels.resolve_impl("cpu")
    assert kernels.resolve_impl("reference") == "reference"


def test_kernel_rejects_bad_shapes_and_decay_numel():
    master, exp_avg, exp_avg_sq, param = make_shard(10, torch.float32, torch.float32, "cpu")
    kw = dict(**HP, weight_decay=0.1, step=1, impl="cpu")
    with pytest.raises(ValueError, match="decay_numel"):
        kernels.adamw_step(master, torch.ones(10), exp_avg, exp_avg_sq, param, torch.zeros(1), decay_numel=11, **kw)
    with pytest.raises(RuntimeError, match="numel"):
        kernels.adamw_step(master, torch.ones(9), exp_avg, exp_avg_sq, param, torch.zeros(1), decay_numel=5, **kw)
    with pytest.raises(RuntimeError, match="contiguous"):
        kernels.adamw_step(master, torch.ones(20)[::2], exp_avg, exp_avg_sq, param, torch.zeros(1), decay_numel=5, **kw)


@pytest.mark.parametrize("grad_dtype", ["float32", "bfloat16"])
def test_bench_kernels_prints_a_row_per_size(grad_dtype):
    out = subprocess.run([sys.executable, "bench.py", "kernels", "--device", "cpu", "--sizes", "1000,4K",
                          "--grad_dtype", grad_dtype], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [line.split() for line in out.stdout.splitlines() if line.strip()[:1].isdigit()]
    assert [row[0] for row in rows] == ["1,000", "4,096"] and all(len(row) == 9 for row in rows)

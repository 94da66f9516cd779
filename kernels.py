"""
One fused AdamW step over a rank's flat ZeRO shard, three ways:

    reference   plain PyTorch, in the op order of torch.optim.AdamW: the definition the kernels are tested against
    cpu         a C++/OpenMP loop, built just-in-time with torch.utils.cpp_extension.load_inline
    cuda        a CUDA kernel, same math, launched on the current stream

One pass over memory reads master, grad, exp_avg, exp_avg_sq (fp32 master/m/v, fp32 or bf16 grad) and writes
master, exp_avg, exp_avg_sq and the compute-dtype param shard (bf16 rounded to nearest-even, or fp32):
per element 8 + 8 + 8 (master, m, v read+write) + 4 (fp32 grad) + 2 (bf16 param) = 30 bytes, where
torch's fused AdamW followed by `param.copy_(master)` moves 28 + 6 = 34.

    python -m pytest -q test_kernels.py
    python bench.py kernels --sizes 1M,16M
"""
import os
import shutil
import warnings

import torch

# ----------------------------------------------------------------------------
# reference: the definition

def adamw_step_reference(master, grad, exp_avg, exp_avg_sq, param, found_inf, *,
                         lr, beta1, beta2, eps, weight_decay, decay_numel, step, grad_scale=1.0):
    """torch.optim.AdamW's single-tensor step on a flat shard, plus the grad scale, found_inf and the param cast."""
    g = grad.float() * grad_scale  # unscale (loss scale, clip coefficient) before anything reads the grad
    torch.maximum(found_inf, (~g.isfinite()).any().float(), out=found_inf)  # no host sync
    master[:decay_numel].mul_(1 - lr * weight_decay)  # decoupled weight decay, decayed params only
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bias_correction1 = 1 - beta1 ** step
    bias_correction2 = 1 - beta2 ** step
    denom = (exp_avg_sq.sqrt() / bias_correction2 ** 0.5).add_(eps)
    master.addcdiv_(exp_avg, denom, value=-lr / bias_correction1)
    param.copy_(master)  # fp32 -> bf16 rounds to nearest-even

# ----------------------------------------------------------------------------
# kernel sources: one argument struct, the CPU loop, the CUDA kernels, the torch binding

# [Note: weight decay as one index]
# A per-element decay mask would cost a byte per element of reading. The ZeRO layout sorts params so that
# in each flat bucket all decayed params (the >= 2-D weights) come first, so a shard is
# [decayed | not decayed] and one integer says where the split is: elements i < decay_numel are decayed.
# E.g. a shard of 10 elements holding the last 6 of a weight and a 4-element bias: decay_numel = 6.
# The cheaper equivalent of the mask: the CPU runs two loops, the GPU does one compare per element.

ARGS_STRUCT = r"""
#include <stdint.h>
// One step over a flat shard of n elements. The binding fills this from tensors and Python floats.
struct AdamWArgs {
  float* master; float* exp_avg; float* exp_avg_sq;  // fp32 (n,), read and written
  const void* grad;     // fp32 or bf16 (n,), read
  void* param;          // fp32 or bf16 (n,), written; may alias master when both are fp32
  float* found_inf;     // (1,): set to 1.0 if any scaled grad is inf/nan, never reset
  int64_t n, decay_numel;  // elements [0, decay_numel) get weight decay
  int grad_bf16, param_bf16;
  // the step's constants, computed in double and rounded to float as torch's AdamW does
  float grad_scale, one_minus_beta1, beta2, one_minus_beta2, eps;
  float decay;                  // 1 - lr * weight_decay
  float step_size;              // lr / (1 - beta1^step)
  float bias_correction2_sqrt;  // sqrt(1 - beta2^step)
};
"""

CPU_SOURCE = r"""
#include <cmath>
#include <cstring>
#include <algorithm>
#include <omp.h>

// bf16 is the top half of an fp32: widening is a shift, narrowing rounds off the low 16 bits.
static inline float load(const float* x, int64_t i) { return x[i]; }
static inline float load(const uint16_t* x, int64_t i) {
  uint32_t bits = (uint32_t)x[i] << 16;
  float f; std::memcpy(&f, &bits, 4); return f;
}
static inline void store(float* x, int64_t i, float f) { x[i] = f; }
static inline void store(uint16_t* x, int64_t i, float f) {
  uint32_t bits; std::memcpy(&bits, &f, 4);
  // round to nearest, ties to even: add 0x7FFF plus the lowest kept bit, then truncate.
  // 0x3F808000 (a tie) -> 0x3F80, 0x3F818000 (a tie) -> 0x3F82, 0x3F808001 -> 0x3F81
  uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  // the add could carry a NaN's payload into inf: keep NaN a (quiet) NaN instead
  bool is_nan = (bits & 0x7FFFFFFFu) > 0x7F800000u;
  x[i] = (uint16_t)(is_nan ? ((bits >> 16) | 0x40u) : rounded);
}

// Elements [begin, end) with one decay factor; returns 1 if any scaled grad was inf/nan.
// Built with -ffp-contract=off, so each op rounds like the reference's separate torch ops; the two std::fma
// are where torch's own CPU kernels fuse (lerp, addcmul), so exp_avg and exp_avg_sq match torch bit for bit.
template <typename grad_t, typename param_t>
static int adamw_range(const AdamWArgs& a, int64_t begin, int64_t end, float decay) {
  // locals, so the compiler knows our stores cannot change them (keeps the loop vectorized)
  float* master = a.master; float* exp_avg = a.exp_avg; float* exp_avg_sq = a.exp_avg_sq;
  const grad_t* grad = (const grad_t*)a.grad;
  param_t* param = (param_t*)a.param;
  const float grad_scale = a.grad_scale, w1 = a.one_minus_beta1, beta2 = a.beta2, w2 = a.one_minus_beta2;
  const float eps = a.eps, step_size = a.step_size, bc2_sqrt = a.bias_correction2_sqrt;
  int bad = 0;
  #pragma omp simd reduction(|:bad)
  for (int64_t i = begin; i < end; ++i) {
    float g = load(grad, i) * grad_scale;
    bad |= !std::isfinite(g);
    float m = std::fma(w1, g - exp_avg[i], exp_avg[i]);        // exp_avg.lerp_(g, 1 - beta1)
    float v = std::fma(w2 * g, g, exp_avg_sq[i] * beta2);     // exp_avg_sq.mul_(beta2).addcmul_(g, g, 1 - beta2)
    float denom = std::sqrt(v) / bc2_sqrt + eps;
    float p = master[i] * decay - step_size * m / denom;      // param.mul_(decay).addcdiv_(m, denom, -step_size)
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    master[i] = p;
    store(param, i, p);
  }
  return bad;
}

template <typename grad_t, typename param_t>
static void adamw_cpu(const AdamWArgs& a) {
  int bad = 0;
  // One thread team per call (below ~64K elements a team costs more than it saves). Each thread takes a
  // contiguous chunk, a multiple of 32 elements (64 B of bf16) so threads do not share cache lines, and cuts
  // it at decay_numel: [decayed | not decayed] -> two vectorized loops, no per-element test.
  // E.g. n = 100000, decay_numel = 70000, 2 threads: chunk 50016, thread 0 [0, 50016) all decayed,
  // thread 1 [50016, 70000) decayed + [70000, 100000) not.
  #pragma omp parallel reduction(|:bad) if(a.n > 65536)
  {
    const int64_t threads = omp_get_num_threads(), t = omp_get_thread_num();
    const int64_t chunk = ((a.n + threads - 1) / threads + 31) / 32 * 32;
    const int64_t lo = std::min(a.n, t * chunk), hi = std::min(a.n, lo + chunk);
    const int64_t cut = std::clamp(a.decay_numel, lo, hi);
    bad |= adamw_range<grad_t, param_t>(a, lo, cut, a.decay);
    bad |= adamw_range<grad_t, param_t>(a, cut, hi, 1.0f);
  }
  if (bad) *a.found_inf = 1.0f;
}

void adamw_launch(const AdamWArgs& a) {
  if (a.grad_bf16) a.param_bf16 ? adamw_cpu<uint16_t, uint16_t>(a) : adamw_cpu<uint16_t, float>(a);
  else             a.param_bf16 ? adamw_cpu<float, uint16_t>(a) : adamw_cpu<float, float>(a);
}
"""

# Pure CUDA, no torch headers: `nvcc -c -arch=sm_90 adamw.cu` compiles it on its own (test_kernels.py does).
CUDA_SOURCE = r"""
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <stdint.h>
""" + ARGS_STRUCT + r"""
__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ void from_float(float x, float& out) { out = x; }
__device__ __forceinline__ void from_float(float x, __nv_bfloat16& out) { out = __float2bfloat16_rn(x); }

// The CPU loop's math for one element, rounded the same way: sqrtf and / are IEEE-rounded (no --use_fast_math)
// and --fmad=false leaves only the explicit fmaf's fused.
template <typename grad_t, typename param_t>
__device__ __forceinline__ bool adamw_element(const AdamWArgs& a, int64_t i, float& master, float& m,
                                              float& v, grad_t grad, param_t& param) {
  float g = to_float(grad) * a.grad_scale;
  m = fmaf(a.one_minus_beta1, g - m, m);
  v = fmaf(a.one_minus_beta2 * g, g, v * a.beta2);
  float denom = sqrtf(v) / a.bias_correction2_sqrt + a.eps;
  float decay = i < a.decay_numel ? a.decay : 1.0f;  // [Note: weight decay as one index]
  master = master * decay - a.step_size * m / denom;
  from_float(master, param);
  return !isfinite(g);
}

// N elements per thread, loaded as one N * sizeof(T)-byte access: N = 4 gives 16-byte loads of the fp32
// streams (8-byte for bf16); N = 1 is the path for any length and any alignment.
template <typename T, int N> struct alignas(N * sizeof(T)) Vec { T x[N]; };

template <typename grad_t, typename param_t, int N>
__global__ void adamw_kernel(const AdamWArgs a, int64_t begin, int64_t end) {
  const int64_t i = begin + N * ((int64_t)blockIdx.x * blockDim.x + threadIdx.x);
  bool bad = false;
  if (i < end) {  // end - begin is a multiple of N
    Vec<float, N> master = *(const Vec<float, N>*)(a.master + i);
    Vec<float, N> m = *(const Vec<float, N>*)(a.exp_avg + i);
    Vec<float, N> v = *(const Vec<float, N>*)(a.exp_avg_sq + i);
    Vec<grad_t, N> grad = *(const Vec<grad_t, N>*)((const grad_t*)a.grad + i);
    Vec<param_t, N> param;
    #pragma unroll
    for (int k = 0; k < N; ++k)
      bad |= adamw_element(a, i + k, master.x[k], m.x[k], v.x[k], grad.x[k], param.x[k]);
    *(Vec<float, N>*)(a.master + i) = master;
    *(Vec<float, N>*)(a.exp_avg + i) = m;
    *(Vec<float, N>*)(a.exp_avg_sq + i) = v;
    *(Vec<param_t, N>*)((param_t*)a.param + i) = param;
  }
  // one write per block, of the same value by any block that saw a bad grad: no atomics, no host sync
  if (__syncthreads_or(bad) && threadIdx.x == 0) *a.found_inf = 1.0f;
}

static bool aligned(const void* p, int bytes) { return (uintptr_t)p % bytes == 0; }

template <typename grad_t, typename param_t>
static cudaError_t launch(const AdamWArgs& a, cudaStream_t stream) {
  const int threads = 256;
  // a shard view that starts at an odd offset takes the N = 1 path for all of it
  const bool vec_ok = aligned(a.master, 16) && aligned(a.exp_avg, 16) && aligned(a.exp_avg_sq, 16) &&
                      aligned(a.grad, 4 * sizeof(grad_t)) && aligned(a.param, 4 * sizeof(param_t));
  const int64_t n_vec = vec_ok ? a.n / 4 * 4 : 0;  // e.g. n = 4097: 4096 in the vector kernel, 1 in the tail
  if (n_vec > 0)
    adamw_kernel<grad_t, param_t, 4><<<(unsigned)((n_vec / 4 + threads - 1) / threads), threads, 0, stream>>>(a, 0, n_vec);
  if (a.n > n_vec)
    adamw_kernel<grad_t, param_t, 1><<<(unsigned)((a.n - n_vec + threads - 1) / threads), threads, 0, stream>>>(a, n_vec, a.n);
  return cudaGetLastError();
}

cudaError_t adamw_cuda(const AdamWArgs& a, cudaStream_t stream) {
  if (a.grad_bf16) return a.param_bf16 ? launch<__nv_bfloat16, __nv_bfloat16>(a, stream) : launch<__nv_bfloat16, float>(a, stream);
  return a.param_bf16 ? launch<float, __nv_bfloat16>(a, stream) : launch<float, float>(a, stream);
}
"""

CUDA_GLUE = r"""
#include <c10/cuda/CUDAStream.h>  // c10::cuda::getCurrentCUDAStream is at::cuda::getCurrentCUDAStream
cudaError_t adamw_cuda(const AdamWArgs& a, cudaStream_t stream);  // in CUDA_SOURCE
void adamw_launch(const AdamWArgs& a) {
  cudaError_t err = adamw_cuda(a, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "nanozero adamw kernel launch failed: ", cudaGetErrorString(err));
}
"""

# The checks live here, next to the raw pointers, so a bad call fails loudly instead of corrupting memory.
BINDING = r"""
#include <torch/extension.h>
#include <cmath>
void adamw_launch(const AdamWArgs& a);  // the CPU loop or the CUDA glue, compiled after this

void adamw_step(torch::Tensor master, torch::Tensor grad, torch::Tensor exp_avg, torch::Tensor exp_avg_sq,
                torch::Tensor param, torch::Tensor found_inf, int64_t decay_numel, int64_t step,
                double lr, double beta1, double beta2, double eps, double weight_decay, double grad_scale) {
  const int64_t n = master.numel();
  for (const torch::Tensor& t : {master, grad, exp_avg, exp_avg_sq, param})
    TORCH_CHECK(t.is_contiguous() && t.numel() == n && t.device() == master.device(),
                "adamw_step: shard tensors must be contiguous, with master's numel and device");
  for (const torch::Tensor& t : {master, exp_avg, exp_avg_sq, found_inf})
    TORCH_CHECK(t.scalar_type() == torch::kFloat32, "adamw_step: master, exp_avg, exp_avg_sq, found_inf must be fp32");
  for (const torch::Tensor& t : {grad, param})
    TORCH_CHECK(t.scalar_type() == torch::kFloat32 || t.scalar_type() == torch::kBFloat16,
                "adamw_step: grad and param must be fp32 or bf16");
  TORCH_CHECK(found_inf.numel() == 1 && found_inf.device() == master.device(), "adamw_step: found_inf must be (1,) on master's device");
  TORCH_CHECK(0 <= decay_numel && decay_numel <= n, "adamw_step: need 0 <= decay_numel <= numel");
  const c10::OptionalDeviceGuard device_guard(master.device());
  AdamWArgs a;
  a.master = master.data_ptr<float>(); a.exp_avg = exp_avg.data_ptr<float>(); a.exp_avg_sq = exp_avg_sq.data_ptr<float>();
  a.grad = grad.data_ptr(); a.param = param.data_ptr(); a.found_inf = found_inf.data_ptr<float>();
  a.n = n; a.decay_numel = decay_numel;
  a.grad_bf16 = grad.scalar_type() == torch::kBFloat16; a.param_bf16 = param.scalar_type() == torch::kBFloat16;
  // the same double arithmetic as adamw_step_reference, then one rounding to float
  a.grad_scale = (float)grad_scale; a.one_minus_beta1 = (float)(1 - beta1);
  a.beta2 = (float)beta2; a.one_minus_beta2 = (float)(1 - beta2); a.eps = (float)eps;
  a.decay = (float)(1 - lr * weight_decay);
  a.step_size = (float)(lr / (1 - std::pow(beta1, (double)step)));
  a.bias_correction2_sqrt = (float)std::pow(1 - std::pow(beta2, (double)step), 0.5);
  adamw_launch(a);
}
"""

# ----------------------------------------------------------------------------
# build once per process (load_inline caches the .so on disk, so later processes only load it)

CPU_FLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-ffp-contract=off"]  # -fno-math-errno lets sqrt vectorize
CUDA_FLAGS = ["-O3", "--fmad=false"]  # no fma contraction beyond the explicit ones, as in the CPU build

_EXTENSIONS = {}  # 'cpu' / 'cuda' -> the built module, or the RuntimeError its build raised


def _build(impl):
    """Compile (or load from the torch extensions dir) one extension; RuntimeError with a one-line reason.
    Building the CUDA one needs nvcc and a CUDA build of torch, not a GPU (set TORCH_CUDA_ARCH_LIST, e.g. "9.0")."""
    from torch.utils import cpp_extension
    if not cpp_extension.is_ninja_available():
        raise RuntimeError("ninja not found (pip install ninja)")
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        raise RuntimeError(f"no C++ compiler ({os.environ.get('CXX', 'c++')}) on PATH")
    if impl == "cuda" and torch.version.cuda is None:
        raise RuntimeError(f"torch {torch.__version__} is a CPU-only build")
    if impl == "cuda" and cpp_extension.CUDA_HOME is None:
        raise RuntimeError("no CUDA toolkit (nvcc) found")
    # Concurrent ranks are fine: load_inline holds a file lock in the build dir, one process compiles and
    # the others wait and load the result (a rank killed mid-build can leave a stale `lock` file behind).
    try:
        if impl == "cpu":
            # -march=native code only runs on CPUs like this one: the ISA level in the name keeps a shared
            # extensions dir from handing an AVX-512 build to an AVX2 machine
            isa = torch.backends.cpu.get_cpu_capability().lower()
            return cpp_extension.load_inline(
                name=f"nanozero_adamw_cpu_{isa}", cpp_sources=[ARGS_STRUCT + BINDING + CPU_SOURCE],
                functions=["adamw_step"], extra_cflags=CPU_FLAGS, extra_ldflags=["-fopenmp"], verbose=False)
        # unless told otherwise, build for this GPU only: "9.0" (sm_90) on H100/H200; the arch list is in the
        # name so builds for different GPUs sharing an extensions dir do not overwrite each other
        if not os.environ.get("TORCH_CUDA_ARCH_LIST"):  # load_inline reads it from the environment
            os.environ["TORCH_CUDA_ARCH_LIST"] = "%d.%d" % torch.cuda.get_device_capability()
        arch = os.environ["TORCH_CUDA_ARCH_LIST"]
        return cpp_extension.load_inline(
            name="nanozero_adamw_cuda_" + "".join(c if c.isalnum() else "_" for c in arch),
            cpp_sources=[ARGS_STRUCT + BINDING + CUDA_GLUE],
            cuda_sources=[CUDA_SOURCE], functions=["adamw_step"],
            extra_cflags=["-O3"], extra_cuda_cflags=CUDA_FLAGS, verbose=False)
    except Exception as e:  # the compiler's first "error:" line says more than "Error building extension"
        lines = str(e).splitlines() or [type(e).__name__]
        reason = next((line for line in lines if "error:" in line), lines[0]).strip()
        raise RuntimeError(f"{impl} build failed: {reason[:300]}") from e


def resolve_impl(name="auto", device=torch.device("cpu")):
    """'auto' -> 'cuda' / 'cpu' for the device if that kernel builds, else 'reference' with one warning.
    Forcing 'cpu' or 'cuda' raises RuntimeError if it cannot build. Builds at most once per process."""
    if name == "reference":
        return name
    if name not in ("auto", "cpu", "cuda"):
        raise ValueError(f"impl must be 'auto', 'reference', 'cpu' or 'cuda', not {name!r}")
    kernel = torch.device(device).type if name == "auto" else name
    if kernel not in ("cpu", "cuda"):
        return "reference"  # e.g. 'auto' on a meta device: there is no kernel to try
    first_try = kernel not in _EXTENSIONS
    if first_try:
        try:
            if kernel == "cuda" and not torch.cuda.is_available():
                raise RuntimeError("no CUDA device (torch.cuda.is_available() is False)")
            _EXTENSIONS[kernel] = _build(kernel)
        except RuntimeError as e:
            _EXTENSIONS[kernel] = e
    if not isinstance(_EXTENSIONS[kernel], RuntimeError):
        return kernel
    if name != "auto":
        raise RuntimeError(f"kernels: impl={name!r} is not available: {_EXTENSIONS[kernel]}")
    if first_try:
        warnings.warn(f"kernels: using the PyTorch reference AdamW step: {_EXTENSIONS[kernel]}", stacklevel=2)
    return "reference"

# ----------------------------------------------------------------------------
# the API zero.py calls

def adamw_step(master, grad, exp_avg, exp_avg_sq, param, found_inf, *,
               lr, beta1, beta2, eps, weight_decay, decay_numel, step, grad_scale=1.0, impl="auto"):
    """master/exp_avg/exp_avg_sq: fp32 1-D contiguous (n,); grad: fp32|bf16 (n,); param: fp32|bf16 (n,) output
    (may be a contiguous view into a bigger buffer); found_inf: fp32 (1,). step is the 1-based step count for
    bias correction. Elements i < decay_numel get weight decay ([Note: weight decay as one index]).
    grad is multiplied by grad_scale first, so loss-scale unscaling and the clip coefficient are free.
    found_inf is set to 1.0 if any scaled grad is inf/nan and never reset: check it once after all buckets.
    The outputs are written either way."""
    if not 0 <= decay_numel <= master.numel():
        raise ValueError(f"decay_numel={decay_numel} is outside [0, {master.numel()}]")
    impl = resolve_impl(impl, master.device)
    if impl == "reference":
        adamw_step_reference(master, grad, exp_avg, exp_avg_sq, param, found_inf, lr=lr, beta1=beta1, beta2=beta2,
                             eps=eps, weight_decay=weight_decay, decay_numel=decay_numel, step=step, grad_scale=grad_scale)
        return
    if impl != master.device.type:
        raise ValueError(f"impl={impl!r} cannot run on {master.device} tensors")
    _EXTENSIONS[impl].adamw_step(master, grad, exp_avg, exp_avg_sq, param, found_inf, decay_numel, step,
                                 lr, beta1, beta2, eps, weight_decay, grad_scale)

# ----------------------------------------------------------------------------
# TEMPORARY stand-ins for the precision API being built on branch kernels-modes (replaced wholesale on merge)
from dataclasses import dataclass as _dataclass

_old_adamw_step = adamw_step


def adamw_step(master, grad, exp_avg, exp_avg_sq, param, found_inf, *, absmax=None, rounding_seed=None,
               index_offset=0, **kw):
    assert absmax is None and rounding_seed is None and master is not None
    if param is None:
        param = master
    _old_adamw_step(master, grad, exp_avg, exp_avg_sq, param, found_inf, **kw)


def cast_param(master, dtype):
    return master.to(dtype, copy=True)


@_dataclass(frozen=True)
class Precision:
    master_weights: str = 'fp32'
    state_dtype: str = 'float32'
    stochastic_rounding: bool = False

    def check(self, param_dtype):
        if (self.master_weights, self.state_dtype, self.stochastic_rounding) != ('fp32', 'float32', False):
            raise ValueError("precision modes are not merged yet")

    def master_dtype(self, param_dtype):
        return None if param_dtype == torch.float32 else torch.float32

    state_torch_dtype = torch.float32
    align = 1

    def bytes_per_element(self, param_dtype):
        return {'master': 0 if param_dtype == torch.float32 else 4, 'exp_avg': 4, 'exp_avg_sq': 4}

    def label(self, population, param_dtype):
        return '(the params)' if population == 'master' and param_dtype == torch.float32 else 'float32'

    def warning(self, param_dtype):
        return None

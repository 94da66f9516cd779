// The CUDA library: pure CUDA, no torch headers (kernels.py builds it with nvcc). test_kernels.py also compiles
// it with g++, the CUDA built-ins emulated, to run it on the host.
#include "adamw_common.h"
// N elements per thread, loaded as one N * sizeof(T)-byte access: N = 4 gives 16-byte loads of the fp32
// streams (8-byte for bf16); N = 1 is the path for any length and any alignment.
template <class T, int N> struct alignas(N * sizeof(T)) Vec { T x[N]; };
template <class T, int N> __device__ __forceinline__ Vec<T, N> load(const void* p, int64_t i) {
  if constexpr (std::is_same<T, Empty>::value) return {}; else return *(const Vec<T, N>*)((const T*)p + i);
}
template <class T, int N> __device__ __forceinline__ void store(void* p, int64_t i, const Vec<T, N>& x) {
  if constexpr (!std::is_same<T, Empty>::value) *(Vec<T, N>*)((T*)p + i) = x;
}

template <class G, class S, class W, int N>
__global__ void adamw_kernel(const AdamWArgs a, int64_t begin, int64_t end) {
  using M = typename W::master_t; using P = typename W::param_t;
  const int64_t i = begin + N * ((int64_t)blockIdx.x * blockDim.x + threadIdx.x);
  bool bad = false;
  if (i < end) {  // end - begin is a multiple of N
    Vec<G, N> grad = load<G, N>(a.grad, i);
    Vec<S, N> m = load<S, N>(a.exp_avg, i), v = load<S, N>(a.exp_avg_sq, i);
    Vec<M, N> master = load<M, N>(a.master, i);
    Vec<P, N> param = W::reads_param ? load<P, N>(a.param, i) : Vec<P, N>{};
    #pragma unroll
    for (int k = 0; k < N; ++k) {
      float mk = to_float(m.x[k]), vk = to_float(v.x[k]);
      const float decay = i + k < a.decay_numel ? a.decay : 1.0f;  // [Note: weight decay as one index]
      bad |= adamw_element<W>(a, i + k, decay, to_float(grad.x[k]), mk, vk, master.x[k], param.x[k]);
      from_float(mk, m.x[k]); from_float(vk, v.x[k]);
    }
    store(a.exp_avg, i, m); store(a.exp_avg_sq, i, v); store(a.master, i, master); store(a.param, i, param);
  }
  // one write per block, of the same value by any block that saw a bad grad: no atomics, no host sync
  if (__syncthreads_or(bad) && threadIdx.x == 0) *a.found_inf = 1.0f;
}

// uint8 state: one 256-thread block per 256-element quantization block. [Note: 8-bit state]
template <class G, class W>
__global__ void adamw_block_kernel(const AdamWArgs a) {
  using M = typename W::master_t; using P = typename W::param_t;
  __shared__ float absmax[2][256];  // exp_avg's and exp_avg_sq's, reduced in place
  const int t = threadIdx.x;
  const int64_t block = blockIdx.x, i = block * 256 + t;
  float m = dequantize(((const uint8_t*)a.exp_avg)[i], a.exp_avg_absmax[block], a.tables + SIGNED_MAP);
  float v = dequantize(((const uint8_t*)a.exp_avg_sq)[i], a.exp_avg_sq_absmax[block], a.tables + UNSIGNED_MAP);
  M master = get<M>(a.master, i);
  P param = W::reads_param ? get<P>(a.param, i) : P{};
  const float decay = i < a.decay_numel ? a.decay : 1.0f;
  const bool bad = adamw_element<W>(a, i, decay, to_float(get<G>(a.grad, i)), m, v, master, param);
  put(a.master, i, master); put(a.param, i, param);
  absmax[0][t] = magnitude(m); absmax[1][t] = magnitude(v);
  __syncthreads();
  for (int half = 128; half > 0; half >>= 1) {  // 256 -> 128 -> ... -> 1; max is exact, so any order gives the CPU's
    if (t < half) {
      absmax[0][t] = fmaxf(absmax[0][t], absmax[0][t + half]);
      absmax[1][t] = fmaxf(absmax[1][t], absmax[1][t + half]);
    }
    __syncthreads();
  }
  ((uint8_t*)a.exp_avg)[i] = quantize(m, absmax[0][0], a.tables + SIGNED_MIDPOINTS, a.buckets + SIGNED_BUCKETS);
  ((uint8_t*)a.exp_avg_sq)[i] = quantize(v, absmax[1][0], a.tables + UNSIGNED_MIDPOINTS, a.buckets + UNSIGNED_BUCKETS);
  if (t == 0) { a.exp_avg_absmax[block] = absmax[0][0]; a.exp_avg_sq_absmax[block] = absmax[1][0]; }
  if (__syncthreads_or(bad) && t == 0) *a.found_inf = 1.0f;
}

static bool aligned(const void* p, int bytes) { return (uintptr_t)p % bytes == 0; }

template <class G, class S, class W>
static cudaError_t launch(const AdamWArgs& a, cudaStream_t stream) {
  const int threads = 256;
  if constexpr (std::is_same<S, uint8_t>::value) {
    if (a.n > 0) adamw_block_kernel<G, W><<<(unsigned)(a.n / 256), threads, 0, stream>>>(a);
  } else {
    // a shard view that starts at an odd offset takes the N = 1 path for all of it
    const bool vec_ok = aligned(a.grad, 4 * sizeof(G)) && aligned(a.exp_avg, 4 * sizeof(S)) &&
                        aligned(a.exp_avg_sq, 4 * sizeof(S)) && aligned(a.master, 4 * sizeof(typename W::master_t)) &&
                        aligned(a.param, 4 * sizeof(typename W::param_t));
    const int64_t n_vec = vec_ok ? a.n / 4 * 4 : 0;  // e.g. n = 4097: 4096 in the vector kernel, 1 in the tail
    if (n_vec > 0)
      adamw_kernel<G, S, W, 4><<<(unsigned)((n_vec / 4 + threads - 1) / threads), threads, 0, stream>>>(a, 0, n_vec);
    if (a.n > n_vec)
      adamw_kernel<G, S, W, 1><<<(unsigned)((a.n - n_vec + threads - 1) / threads), threads, 0, stream>>>(a, n_vec, a.n);
  }
  return cudaGetLastError();
}

extern "C" int adamw_step(const AdamWArgs* a, void* stream) {
  return dispatch(*a, [&](auto grad, auto state, auto weights) {
    return (int)launch<decltype(grad), decltype(state), decltype(weights)>(*a, (cudaStream_t)stream);
  });
}
extern "C" const char* adamw_error_string(int error) { return cudaGetErrorString((cudaError_t)error); }

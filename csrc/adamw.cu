// The CUDA library: pure CUDA, no torch headers (library.py builds it with nvcc). test_kernels.py also compiles
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
      bad |= adamw_element<W>(a, index_of(a.index_offset + i + k), decay, to_float(grad.x[k]), mk, vk, master.x[k],
                              param.x[k]);
      from_float(mk, m.x[k]); from_float(vk, v.x[k]);
    }
    store(a.exp_avg, i, m); store(a.exp_avg_sq, i, v); store(a.master, i, master); store(a.param, i, param);
  }
  // one write per block, of the same value by any block that saw a bad grad: no atomics, no host sync
  if (__syncthreads_or(bad) && threadIdx.x == 0) *a.found_inf = 1.0f;
}

// uint8 state: [Note: 8-bit state]. One warp per 256-element quantization block, its values in registers from the
// load to the store: lane l holds elements 8l .. 8l + 7 (the codes as one 8-byte load, the other streams as 16- or
// 32-byte loads) when every pointer is aligned for that (`vec`), else elements l, l + 32, ... (scalar, coalesced).
// The block's new absmax is a warp reduction (one REDUX), the code maps sit in shared memory, the buckets are read
// through the L1 cache: each block is read once and written once. A CUDA block is 8 warps, each taking 8
// quantization blocks in turn, so that the maps are loaded into shared memory once per 16K elements.
// [Note: registers for occupancy] Left alone, nvcc gives this kernel 80-102 registers a thread: 2 CUDA blocks (16
// warps) an SM, too few to hide the loads' latency behind a warp's long update and the buckets' gathers. We ask for 4
// (__launch_bounds__): 64 registers and no spills (ptxas -v, sm_90, every instance; test
// test_the_8bit_cuda_kernel_fits_4_blocks_an_sm_without_spills), 32 warps; 5 spill. The divides by a block's scale
// and by bias_correction2_sqrt go through their reciprocals ([Note: dividing by the reciprocal, exactly]): a GPU
// divide branches to a slow path, and the branches kept nvcc from overlapping one element's chain with the next and
// each bucket gather with the previous one; and the vector and strided layouts are two kernels (`vec`, a template
// argument). On one H200 (256M elements, fp32-master int8 mode, tried in turns in one run): 3 blocks an SM and 4
// rounds, 0.67 of the copy bandwidth; 4 blocks, 0.72; 4 blocks and 8 rounds, 0.74; 2 rounds, 0.73. Also tried there,
// no faster: the update in phases over a lane's 8 elements (moments, roots, weights), and sqrtf's fast path for the
// whole warp at once. What bounds it now is the instructions it issues: assets/kernels_8bit.md.
// [Note: the 8-bit kernel's memory hints] Two hints that change no result: (1) the streams are read and written once,
// so their vector loads and stores are evict-first (__ldcs, __stcs, 8 or 16 bytes each), which leaves the caches to
// the bucket table the encode gathers from; (2) at the end of each round a warp asks L2 for its block two rounds on
// (prefetch.global.L2, one instruction a stream a lane, no registers held), so that round's loads find it there
// instead of waiting on DRAM (asked at a round's start for the next round, the addresses held registers: spills). On
// one H200 at 256M elements, in turns with the kernel without them (fp32-master, remainder, stochastic int8): 0.79 /
// 0.81 / 0.56 of copy against 0.76 / 0.73 / 0.55, time 0.96x / 0.90x / 0.99x; the evict-first hint alone 1.02x / 0.97x
// / 0.98x, the prefetch alone 0.98x / 0.93x / 1.01x; three rounds ahead, or 16 rounds a block, no better. The build
// timed also prefetched the fp32-master mode's bf16 param, which that mode only writes (2 bytes an element read for
// nothing); it no longer does, untimed.
constexpr int kWarps = 8, kRounds = 8, kBlocksPerSM = 4;

template <class T> __device__ __forceinline__ void load8(const void* p, int64_t i, bool vec, T (&x)[8]) {
  if constexpr (!std::is_same<T, Empty>::value) {
    if (vec) {  // [Note: the 8-bit kernel's memory hints]
      const T* q = (const T*)p + i;
      if constexpr (sizeof(x) == 8) { const uint2 w = __ldcs((const uint2*)q); memcpy(x, &w, 8); }
      else for (int c = 0; c < (int)sizeof(x) / 16; ++c) {
        const uint4 w = __ldcs((const uint4*)q + c); memcpy((char*)x + 16 * c, &w, 16);
      }
    } else {
      for (int k = 0; k < 8; ++k) x[k] = ((const T*)p)[i + 32 * k];
    }
  }
}
template <class T> __device__ __forceinline__ void store8(void* p, int64_t i, bool vec, const T (&x)[8]) {
  if constexpr (!std::is_same<T, Empty>::value) {
    if (vec) {
      T* q = (T*)p + i;
      if constexpr (sizeof(x) == 8) { uint2 w; memcpy(&w, x, 8); __stcs((uint2*)q, w); }
      else for (int c = 0; c < (int)sizeof(x) / 16; ++c) {
        uint4 w; memcpy(&w, (const char*)x + 16 * c, 16); __stcs((uint4*)q + c, w);
      }
    } else {
      for (int k = 0; k < 8; ++k) ((T*)p)[i + 32 * k] = x[k];
    }
  }
}

template <class T> __device__ __forceinline__ void prefetch8(const void* p, int64_t i) {  // into L2: a hint
  if constexpr (!std::is_same<T, Empty>::value) {
#ifdef __CUDA_ARCH__
    asm volatile("prefetch.global.L2 [%0];" :: "l"((const T*)p + i));
#elif defined(HOST_PREFETCH)  // test_kernels.py's host build records each address, to check what is asked for
    HOST_PREFETCH((const T*)p + i);
#endif
  }
}

// code k of a lane's 8 as one PRMT (the byte moved down, zeros above), which the map's address then scales and adds in
// one LEA: 2 instructions a code where nvcc's own pick (a shift, a mask, then the add) issued 3
__device__ __forceinline__ uint32_t code_at(const uint8_t (&codes)[8], int k) {
  uint32_t words[2];
  memcpy(words, codes, 8);
  return __byte_perm(words[k / 4], 0, 0x4440 | (k % 4));
}

template <class G, class W, bool vec>  // a template argument: one kernel's loads would be issued for both layouts
__global__ void __launch_bounds__(kWarps * 32, kBlocksPerSM) adamw_block_kernel(const AdamWArgs a) {
  using M = typename W::master_t; using P = typename W::param_t;
  __shared__ float maps[512];  // SIGNED_MAP, UNSIGNED_MAP
  for (int t = threadIdx.x; t < 512; t += blockDim.x) maps[t] = a.tables[t];
  __syncthreads();
  const int lane = threadIdx.x % 32;
  bool bad = false;
  // this warp's block of round r, if there is one, the streams it reads: [Note: the 8-bit kernel's memory hints]
  const auto prefetch_round = [&](int r) {
    const int64_t b = ((int64_t)blockIdx.x * kRounds + r) * kWarps + threadIdx.x / 32;
    if (r < kRounds && b < a.n / 256) {
      const int64_t j = b * 256 + 8 * lane;
      prefetch8<uint8_t>(a.exp_avg, j); prefetch8<uint8_t>(a.exp_avg_sq, j); prefetch8<G>(a.grad, j);
      prefetch8<M>(a.master, j);
      if constexpr (W::reads_param) prefetch8<P>(a.param, j);  // an fp32 master's param is only written
    }
  };
  prefetch_round(1);
  for (int round = 0; round < kRounds; ++round) {  // `active` is the same for the 32 lanes of a warp: whole-warp shuffles
    const int64_t block = ((int64_t)blockIdx.x * kRounds + round) * kWarps + threadIdx.x / 32;
    const bool active = block < a.n / 256;
    const int64_t i = block * 256 + (vec ? 8 * lane : lane);  // this lane's first element; the k-th: i + k * step
    const int step = vec ? 1 : 32;
    float m[8], v[8], absmax_m = 0.0f, absmax_v = 0.0f;
    if (active) {
      uint8_t codes_m[8], codes_v[8]; G grad[8]; M master[8]; P param[8] = {};
      load8(a.exp_avg, i, vec, codes_m); load8(a.exp_avg_sq, i, vec, codes_v); load8(a.grad, i, vec, grad);
      load8(a.master, i, vec, master);
      if constexpr (W::reads_param) load8(a.param, i, vec, param);
      const float old_absmax_m = a.exp_avg_absmax[block], old_absmax_v = a.exp_avg_sq_absmax[block];
      // element k decays if i + k * step < decay_numel: one 64-bit difference a lane, then 32-bit compares
      const int64_t left = a.decay_numel - i;
      const int decaying = (int)(left < 0 ? 0 : left > 256 ? 256 : left);
      for (int k = 0; k < 8; ++k) {
        m[k] = maps[SIGNED_MAP + code_at(codes_m, k)] * old_absmax_m;  // = dequantize(), without the CPU's signed
        v[k] = maps[UNSIGNED_MAP + code_at(codes_v, k)] * old_absmax_v;  // indexing
        const float decay = k * step < decaying ? a.decay : 1.0f;
        bad |= adamw_element<W, true>(a, index_of(a.index_offset + i + k * step), decay, to_float(grad[k]), m[k], v[k],
                                      master[k], param[k]);
        absmax_m = fmaxf(absmax_m, fabsf(m[k])); absmax_v = fmaxf(absmax_v, fabsf(v[k]));  // fmaxf drops a NaN
      }
      store8(a.master, i, vec, master); store8(a.param, i, vec, param);
    }
    // the warp's absmax: each lane's is a float >= 0 (not NaN: fmaxf drops one), ordered as its bits are, so one
    // integer max of the bits (REDUX on sm_80+: 25 instructions a round fewer than 5 shuffles and maxes each); max is
    // exact, so any order gives the CPU's absmax. Older GPUs shuffle (the host emulation runs the REDUX form, and the
    // shuffles in test_the_cuda_kernels_absmax_by_shuffles_for_gpus_before_sm80_equals_the_cpu_kernel)
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 800
    absmax_m = float_of(__reduce_max_sync(0xFFFFFFFFu, bits_of(absmax_m)));
    absmax_v = float_of(__reduce_max_sync(0xFFFFFFFFu, bits_of(absmax_v)));
#else
    for (int lanes = 16; lanes > 0; lanes >>= 1) {
      absmax_m = fmaxf(absmax_m, __shfl_xor_sync(0xFFFFFFFFu, absmax_m, lanes));
      absmax_v = fmaxf(absmax_v, __shfl_xor_sync(0xFFFFFFFFu, absmax_v, lanes));
    }
#endif
    if (active) {
      uint8_t codes_m[8], codes_v[8];
      const float scale_m = code_scale(absmax_m), scale_v = code_scale(absmax_v);
      if (reciprocal_divides_exactly(scale_m) && reciprocal_divides_exactly(scale_v)) {  // the same for the warp
        const float r_m = 1.0f / scale_m, r_v = 1.0f / scale_v;
        for (int k = 0; k < 8; ++k) {
          codes_m[k] = code_of(divide_by_reciprocal<false>(m[k], scale_m, r_m), a.buckets + SIGNED_BUCKETS);
          codes_v[k] = code_of<false>(divide_by_reciprocal<false>(v[k], scale_v, r_v), a.buckets + UNSIGNED_BUCKETS);
        }
      } else {  // an absmax past 2^64 (or an inf moment) or below 2^-64
        for (int k = 0; k < 8; ++k) {
          codes_m[k] = quantize(m[k], scale_m, a.buckets + SIGNED_BUCKETS);
          codes_v[k] = quantize(v[k], scale_v, a.buckets + UNSIGNED_BUCKETS);
        }
      }
      store8(a.exp_avg, i, vec, codes_m); store8(a.exp_avg_sq, i, vec, codes_v);
      if (lane == 0) { a.exp_avg_absmax[block] = absmax_m; a.exp_avg_sq_absmax[block] = absmax_v; }
    }
    prefetch_round(round + 2);
  }
  if (__syncthreads_or(bad) && threadIdx.x == 0) *a.found_inf = 1.0f;
}

static bool aligned(const void* p, int bytes) { return (uintptr_t)p % bytes == 0; }

template <class G, class S, class W>
static cudaError_t launch(const AdamWArgs& a, cudaStream_t stream) {
  const int threads = 256;
  static_assert(threads == kWarps * 32, "the 8-bit kernel's launch bounds assume 256 threads");
  if constexpr (std::is_same<S, uint8_t>::value) {
    // e.g. n = 256 * 96: 96 quantization blocks -> 2 CUDA blocks, the second with 32 of its 64 slots used
    const int64_t per_cuda_block = kWarps * kRounds;
    const bool vec = aligned(a.grad, 8 * sizeof(G)) && aligned(a.exp_avg, 8) && aligned(a.exp_avg_sq, 8) &&
                     aligned(a.master, 8 * sizeof(typename W::master_t)) && aligned(a.param, 8 * sizeof(typename W::param_t));
    const unsigned grid = (unsigned)((a.n / 256 + per_cuda_block - 1) / per_cuda_block);
    if (a.n > 0 && vec)
      adamw_block_kernel<G, W, true><<<grid, threads, 0, stream>>>(a);
    else if (a.n > 0)
      adamw_block_kernel<G, W, false><<<grid, threads, 0, stream>>>(a);
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
// A stage-3 gather's compute param from the fp32 master shard: kernels.cast_param, one pass of 6 bytes an element.
// N elements a thread, as one 4N-byte load when the pointers allow (N = 4), else one (N = 1).
template <int N> __global__ void cast_bf16_kernel(const float* x, bf16* out, int64_t n) {
  const int64_t i = N * ((int64_t)blockIdx.x * blockDim.x + threadIdx.x);
  if (i < n) {  // n is a multiple of N
    const Vec<float, N> v = load<float, N>(x, i);
    Vec<bf16, N> b;
    for (int k = 0; k < N; ++k) b.x[k] = bf16_away(v.x[k]);
    store(out, i, b);
  }
}
extern "C" int cast_bf16(const float* x, bf16* out, int64_t n, void* stream_) {
  const cudaStream_t stream = (cudaStream_t)stream_;
  const int threads = 256;
  const int64_t n_vec = aligned(x, 16) && aligned(out, 8) ? n / 4 * 4 : 0;
  if (n_vec > 0)
    cast_bf16_kernel<4><<<(unsigned)((n_vec / 4 + threads - 1) / threads), threads, 0, stream>>>(x, out, n_vec);
  if (const int64_t tail = n - n_vec; tail > 0)
    cast_bf16_kernel<1><<<(unsigned)((tail + threads - 1) / threads), threads, 0, stream>>>(x + n_vec, out + n_vec, tail);
  return (int)cudaGetLastError();
}
extern "C" const char* adamw_error_string(int error) { return cudaGetErrorString((cudaError_t)error); }

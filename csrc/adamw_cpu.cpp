// The CPU library: an OpenMP loop over the shard (kernels.py builds it with the system C++ compiler).
#include "adamw_common.h"
#include <algorithm>
#include <omp.h>

// Elements [begin, end) with one decay factor; returns 1 if any scaled grad was inf/nan.
template <class G, class S, class W>
static int adamw_range(const AdamWArgs& args, int64_t begin, int64_t end, float decay) {
  const AdamWArgs a = args;  // a local copy: our stores cannot change it, which keeps the loop vectorized
  using M = typename W::master_t; using P = typename W::param_t;
  S* exp_avg = (S*)a.exp_avg; S* exp_avg_sq = (S*)a.exp_avg_sq;
  int bad = 0;
  #pragma omp simd reduction(|:bad)
  for (int64_t i = begin; i < end; ++i) {
    float m = to_float(exp_avg[i]), v = to_float(exp_avg_sq[i]);
    M master = get<M>(a.master, i);
    P param = W::reads_param ? get<P>(a.param, i) : P{};
    bad |= adamw_element<W>(a, i, decay, to_float(((const G*)a.grad)[i]), m, v, master, param);
    from_float(m, exp_avg[i]); from_float(v, exp_avg_sq[i]);
    put(a.master, i, master); put(a.param, i, param);
  }
  return bad;
}

// uint8 state: one 256-element block, read once and written once. Its m and v stay in local arrays (2 KB, in L1)
// between the two loops: dequantize, update and find the new absmax; then requantize with it. Both loops vectorize
// (16 lanes with AVX-512): a code's map value and a bucket are gathered loads from L1-resident tables, the rest is
// arithmetic. [Note: 8-bit state]
template <class G, class W>
static int adamw_block(const AdamWArgs& args, int64_t block) {
  const AdamWArgs a = args;
  using M = typename W::master_t; using P = typename W::param_t;
  uint8_t* codes_m = (uint8_t*)a.exp_avg + block * 256; uint8_t* codes_v = (uint8_t*)a.exp_avg_sq + block * 256;
  const float old_absmax_m = a.exp_avg_absmax[block], old_absmax_v = a.exp_avg_sq_absmax[block];
  alignas(64) float m[256], v[256];
  float absmax_m = 0.0f, absmax_v = 0.0f;
  int bad = 0;
  #pragma omp simd reduction(|:bad) reduction(max:absmax_m, absmax_v)
  for (int j = 0; j < 256; ++j) {
    const int64_t i = block * 256 + j;
    m[j] = dequantize(codes_m[j], old_absmax_m, a.tables + SIGNED_MAP);
    v[j] = dequantize(codes_v[j], old_absmax_v, a.tables + UNSIGNED_MAP);
    M master = get<M>(a.master, i);
    P param = W::reads_param ? get<P>(a.param, i) : P{};
    const float decay = i < a.decay_numel ? a.decay : 1.0f;
    bad |= adamw_element<W>(a, i, decay, to_float(((const G*)a.grad)[i]), m[j], v[j], master, param);
    put(a.master, i, master); put(a.param, i, param);
    absmax_m = std::max(absmax_m, magnitude(m[j])); absmax_v = std::max(absmax_v, magnitude(v[j]));
  }
  const float scale_m = code_scale(absmax_m), scale_v = code_scale(absmax_v);
  #pragma omp simd
  for (int j = 0; j < 256; ++j) {
    codes_m[j] = quantize(m[j], scale_m, a.buckets + SIGNED_BUCKETS);
    codes_v[j] = quantize(v[j], scale_v, a.buckets + UNSIGNED_BUCKETS);
  }
  a.exp_avg_absmax[block] = absmax_m; a.exp_avg_sq_absmax[block] = absmax_v;
  return bad;
}

template <class G, class S, class W>
static void adamw_cpu(const AdamWArgs& a) {
  int bad = 0;
  if constexpr (std::is_same<S, uint8_t>::value) {
    #pragma omp parallel for reduction(|:bad) if(a.n > 65536)
    for (int64_t block = 0; block < a.n / 256; ++block) bad |= adamw_block<G, W>(a, block);
  } else {
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
      bad |= adamw_range<G, S, W>(a, lo, cut, a.decay);
      bad |= adamw_range<G, S, W>(a, cut, hi, 1.0f);
    }
  }
  if (bad) *a.found_inf = 1.0f;
}

extern "C" int adamw_step(const AdamWArgs* a, void* stream) {
  dispatch(*a, [&](auto grad, auto state, auto weights) {
    adamw_cpu<decltype(grad), decltype(state), decltype(weights)>(*a);
    return 0;
  });
  return 0;
}

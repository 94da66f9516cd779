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

// [Note: decoding codes with byte permutes]
// Decoding is a lookup in a 256-entry table per code. A gather instruction does 16 lookups in ~16 cycles (AVX-512,
// measured); with AVX-512 VBMI the table fits in registers instead: byte k of the 256 floats is a 256-byte "plane",
// 4 registers, and vpermi2b looks up 64 codes in 128 of its entries at once. So 64 codes = 4 planes x (2 lookups +
// a blend on the code's top bit), then the 4 byte vectors interleaved back into 64 floats: ~5x faster than gathers.
// The interleave (unpack within 128-bit lanes) yields floats in the order 0-3, 16-19, 32-35, 48-51, 4-7, ...: the
// codes are permuted first so that the floats come out in order. The multiply by absmax is the scalar one.
#if defined(__AVX512VBMI__)
#include <immintrin.h>
struct CodeMap { __m512i planes[4][4]; };  // planes[k][q]: byte k of map[64 q .. 64 q + 63]

static CodeMap code_map(const float* map) {
  CodeMap c;
  alignas(64) uint8_t bytes[4][256];
  for (int j = 0; j < 256; ++j) for (int k = 0; k < 4; ++k) bytes[k][j] = (uint8_t)(bits_of(map[j]) >> 8 * k);
  for (int k = 0; k < 4; ++k) for (int q = 0; q < 4; ++q) c.planes[k][q] = _mm512_load_si512(bytes[k] + 64 * q);
  return c;
}

static void decode(const uint8_t* codes, const CodeMap& map, float absmax, float* out) {  // 256 codes
  alignas(64) uint8_t order[64];  // byte 16 L + 4 q + e <- code 16 q + 4 L + e: undoes the interleave's order
  for (int x = 0; x < 64; ++x) order[x] = (uint8_t)(16 * (x / 4 % 4) + 4 * (x / 16) + x % 4);
  const __m512i shuffle = _mm512_load_si512(order);
  const __m512 scale = _mm512_set1_ps(absmax);
  for (int j = 0; j < 256; j += 64) {
    const __m512i c = _mm512_permutexvar_epi8(shuffle, _mm512_loadu_si512(codes + j));
    const __mmask64 upper = _mm512_movepi8_mask(c);  // codes >= 128: the upper 128 entries
    __m512i b[4];
    for (int k = 0; k < 4; ++k)
      b[k] = _mm512_mask_blend_epi8(upper, _mm512_permutex2var_epi8(map.planes[k][0], c, map.planes[k][1]),
                                           _mm512_permutex2var_epi8(map.planes[k][2], c, map.planes[k][3]));
    const __m512i lo01 = _mm512_unpacklo_epi8(b[0], b[1]), hi01 = _mm512_unpackhi_epi8(b[0], b[1]);
    const __m512i lo23 = _mm512_unpacklo_epi8(b[2], b[3]), hi23 = _mm512_unpackhi_epi8(b[2], b[3]);
    const __m512i f[4] = {_mm512_unpacklo_epi16(lo01, lo23), _mm512_unpackhi_epi16(lo01, lo23),
                          _mm512_unpacklo_epi16(hi01, hi23), _mm512_unpackhi_epi16(hi01, hi23)};
    for (int q = 0; q < 4; ++q) _mm512_store_ps(out + j + 16 * q, _mm512_mul_ps(_mm512_castsi512_ps(f[q]), scale));
  }
}
#else
struct CodeMap { const float* map; };
static CodeMap code_map(const float* map) { return {map}; }
static void decode(const uint8_t* codes, const CodeMap& map, float absmax, float* out) {  // 256 codes
  #pragma omp simd
  for (int j = 0; j < 256; ++j) out[j] = dequantize(codes[j], absmax, map.map);
}
#endif

// uint8 state: one 256-element block, read once and written once. Its m and v stay in local arrays (2 KB, in L1)
// through three loops: decode; update and find the new absmax; requantize with it. The update and the requantize
// vectorize (16 lanes with AVX-512): a bucket is a gathered load from an L1-resident table. [Note: 8-bit state]
template <class G, class W>
static int adamw_block(const AdamWArgs& args, const CodeMap (&maps)[2], int64_t block) {
  const AdamWArgs a = args;
  using M = typename W::master_t; using P = typename W::param_t;
  uint8_t* codes_m = (uint8_t*)a.exp_avg + block * 256; uint8_t* codes_v = (uint8_t*)a.exp_avg_sq + block * 256;
  alignas(64) float m[256], v[256];
  decode(codes_m, maps[0], a.exp_avg_absmax[block], m);
  decode(codes_v, maps[1], a.exp_avg_sq_absmax[block], v);
  float absmax_m = 0.0f, absmax_v = 0.0f;
  int bad = 0;
  #pragma omp simd reduction(|:bad) reduction(max:absmax_m, absmax_v)
  for (int j = 0; j < 256; ++j) {
    const int64_t i = block * 256 + j;
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
    const CodeMap maps[2] = {code_map(a.tables + SIGNED_MAP), code_map(a.tables + UNSIGNED_MAP)};
    #pragma omp parallel for reduction(|:bad) if(a.n > 65536)
    for (int64_t block = 0; block < a.n / 256; ++block) bad |= adamw_block<G, W>(a, maps, block);
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

// The CPU library: an OpenMP loop over the shard (library.py builds it with the system C++ compiler).
#include "adamw_common.h"
#include <algorithm>
#include <omp.h>

// Index base + j of the flat buffer for a lane offset j < 2^32, in 32-bit lanes: the high half moves on where the low
// one wraps (two instructions; an int64 index would take 64-bit lanes and conversions). Only the stochastic rounding
// reads it.
struct IndexFrom {
  Index base;
  explicit IndexFrom(int64_t first) : base(index_of(first)) {}
  Index at(uint32_t j) const {
    const uint32_t low = base.low + j;
    return {low, base.high_mixed + select(low < base.low, kHighMix, 0u)};
  }
};

// Elements [begin, end) with one decay factor, in pieces of at most 2^30 (their offsets in 32-bit lanes); returns 1 if
// any scaled grad was inf/nan.
template <class G, class S, class W>
static int adamw_range(const AdamWArgs& args, int64_t begin, int64_t end, float decay) {
  const AdamWArgs a = args;  // a local copy: our stores cannot change it, which keeps the loop vectorized
  using M = typename W::master_t; using P = typename W::param_t;
  S* exp_avg = (S*)a.exp_avg; S* exp_avg_sq = (S*)a.exp_avg_sq;
  int bad = 0;
  for (int64_t first = begin; first < end; first += 1 << 30) {
    const int count = (int)std::min<int64_t>(end - first, 1 << 30);
    const IndexFrom index(a.index_offset + first);
    #pragma omp simd reduction(|:bad)
    for (int j = 0; j < count; ++j) {
      const int64_t i = first + j;
      float m = to_float(exp_avg[i]), v = to_float(exp_avg_sq[i]);
      M master = get<M>(a.master, i);
      P param = W::reads_param ? get<P>(a.param, i) : P{};
      bad |= adamw_element<W>(a, index.at(j), decay, to_float(((const G*)a.grad)[i]), m, v, master, param);
      from_float(m, exp_avg[i]); from_float(v, exp_avg_sq[i]);
      put(a.master, i, master); put(a.param, i, param);
    }
  }
  return bad;
}

// A block of uint8 state: its codes, its absmaxes (as stored; after the update, the new ones), and its m and v decoded
// (2 KB, in L1)
struct Block { uint8_t* codes_m; uint8_t* codes_v; float absmax_m, absmax_v; float* m; float* v; };

// [Note: decoding codes with byte permutes]
// Decoding is a lookup in a 256-entry table per code. A gather instruction does 16 lookups in ~16 cycles (AVX-512,
// measured); with AVX-512 VBMI the table fits in registers instead: byte k of the 256 floats is a 256-byte "plane",
// 4 registers, and vpermi2b looks up 64 codes in 128 of its entries at once. So 64 codes = 4 planes x (2 lookups +
// a blend on the code's top bit), then the 4 byte vectors interleaved back into 64 floats: ~5x faster than gathers.
// The interleave (unpack within 128-bit lanes) yields floats in the order 0-3, 16-19, 32-35, 48-51, 4-7, ...: the
// codes are permuted first so that the floats come out in order. The multiply by absmax is the scalar one.
#if defined(__AVX512VBMI__)
#include <immintrin.h>
// The permute helpers below are inlined by force: g++ calls the bigger ones, and a call between the encode's and the
// decode's chunks keeps them from interleaving ([Note: encoding a block while decoding the next]: 1.18 -> 1.10 ns).
#define ALWAYS_INLINE inline __attribute__((always_inline))
// planes[k][q]: byte k of table[64 q .. 64 q + 63]; decoding reads the map, encoding its midpoints and the decades
// ([Note: a code from its decade]).
struct CodeMap {
  __m512i planes[4][4], mid_planes[4][4];
  __m512i order;  // byte 16 L + 4 q + e <- index 16 q + 4 L + e: undoes the interleave's order (decode64)
  __m512i low_bytes, low_bytes_in_order;  // of two vectors of 16-bit lanes: their 64 low bytes; the same in `order`
  __m512i fraction_switch, a[2], b[2];  // 16-bit lanes: by binade (32); by binade, above its switch or not (64)
};

static void to_planes(const float* table, __m512i (&planes)[4][4]) {
  alignas(64) uint8_t bytes[4][256];
  for (int j = 0; j < 256; ++j) for (int k = 0; k < 4; ++k) bytes[k][j] = (uint8_t)(bits_of(table[j]) >> 8 * k);
  for (int k = 0; k < 4; ++k) for (int q = 0; q < 4; ++q) planes[k][q] = _mm512_load_si512(bytes[k] + 64 * q);
}

// [Note: a code from its decade]
// The bucket gather costs ~16 cycles per 16 codes; byte permutes look up 64 at once (above). So encoding first
// estimates each code k from xn's decade, then settles it with one exact compare against midpoint k, looked up like
// a decode: code = k + (xn > midpoints[k]), which is the reference's count of midpoints below xn whenever the true
// code is k or k + 1. Within a decade of the dynamic map (values in [0.1, 1) * 10^-z) the values are evenly spaced,
// d = 0.9 * 10^-z / (their number), so t = c + (y - v) / d (y = |xn|, v the decade's first value, c its code) is
// the code as a real number: the true code is round(t), and k = floor(t) is within one below it. The estimate runs
// in 16-bit lanes, 32 values a vector (half the instructions of fp32 lanes): within a binade [2^e, 2^(e+1)), y =
// 2^e (1 + F / 2^16 + less), F the top 16 of its 23 fraction bits, so t = (A + B F / 2^16) / 256 in 8.8 fixed point,
// A and B the binade's line, looked up by its exponent (a 64-entry word permute), and k = (A + mulhi(B, F)) >> 8;
// A rounded down and B up, k errs by -3/256 to +1/256 of a code (-2.04/256 to +0.85/256 over every y). A binade
// holds at most one switch between decades, the last value of the decade below; an F above the switch's F takes the
// line above (a switch equal in F to y takes the line below, which is still within one there). Binade 0 holds
// everything below 2^-30, all of which take the code of zero (127 in the signed map, 0 in the unsigned; a constant
// line, B = 0); binade 31, [1, 2), holds 1 and the NaNs (their exponent is 255, the same low 5 bits): 255, and the
// settle's add saturates too: midpoint 255 is inf, so only a NaN xn passes it, and stays 255. Negatives
// mirror positives in the signed map (value j = -value 254 - j, so midpoint j = -midpoint 253 - j): an xn with its
// sign bit set, NaNs aside (its top 16 bits read as an int16 below -128, one compare), takes 253 - k of y, saturated
// at 0; -0 takes 126, one below its code 127, which the settle adds. The unsigned map (exp_avg_sq) has no negatives:
// y = max(0, xn). Each k is computed in a 16-bit lane, the low byte its code: one byte permute of two such vectors
// gives the 64 codes in order, another gives them in `order`, which the midpoint lookup wants as the decode does.
// Checked for every fp32 xn in [-1, 1] and every NaN, both maps, against the buckets ([Note: a code in one load]):
// `python .ci/cpu_kernel.py check` (2.1G values a map, 0 mismatches; ~5 s); test_kernels.py checks a dense subset
// through the kernel.
static void decades(const float* map, CodeMap& c) {
  const double tenth[7] = {1, 1e-1, 1e-2, 1e-3, 1e-4, 1e-5, 1e-6};
  double first[7] = {}, count[7] = {}, last[7] = {}; int first_code[7] = {}, zero_code = 0;
  for (int j = 0; j < 256; ++j) {
    const double v = map[j];
    if (v == 0.0) zero_code = j;
    if (!(v > 0.0 && v < 1.0)) continue;  // 0, 1 and the negatives lie on no decade
    int z = 0;
    while (z < 6 && v < tenth[z + 1]) ++z;  // v in [10^-(z+1), 10^-z)
    if (count[z]++ == 0) { first[z] = v; first_code[z] = j; }
    last[z] = v;
  }
  auto line = [&](int z, double lo, uint16_t& a, uint16_t& b) {  // decade z's t over the binade [lo, 2 lo); 7: zero's
    const double slope = z < 7 ? count[z] / (0.9 * tenth[z]) : 0.0;
    const double offset = z < 7 ? first_code[z] - first[z] * slope : zero_code;
    a = (uint16_t)std::clamp(std::floor(256 * (slope * lo + offset)), 0.0, 65535.0);
    b = (uint16_t)std::ceil(256 * slope * lo);  // < 2^16: a binade holds fewer than 256 codes
  };
  alignas(64) uint16_t fraction_switch[32], a[64], b[64];  // a[i], b[i]: above binade i's switch; a[32 + i]: below
  for (int i = 0; i < 32; ++i) {  // binade [2^(i - 31), 2^(i - 30))
    const double lo = ldexp(1.0, i - 31), hi = 2 * lo;
    int below = 6;  // y above the last value of decade z + 1: decade z
    for (int z = 5; z >= 0; --z) if (last[z + 1] < lo) below = z;
    int above = below;
    fraction_switch[i] = 0xFFFF;  // no switch: never exceeded
    for (int z = 0; z < 6; ++z) if (last[z + 1] >= lo && last[z + 1] < hi) {
      above = z;
      fraction_switch[i] = (uint16_t)(bits_of((float)last[z + 1]) >> 7);
    }
    line(i == 0 ? 7 : below, lo, a[32 + i], b[32 + i]);
    line(above, lo, a[i], b[i]);
    if (i == 31) a[i] = a[32 + i] = 65535, b[i] = b[32 + i] = 0;
  }
  c.fraction_switch = _mm512_load_si512(fraction_switch);
  for (int h = 0; h < 2; ++h) c.a[h] = _mm512_load_si512(a + 32 * h), c.b[h] = _mm512_load_si512(b + 32 * h);
}

static CodeMap code_map(const float* map, const int32_t*) {  // the buckets: for CPUs without VBMI (below)
  CodeMap c;
  float midpoints[256];
  for (int j = 0; j < 255; ++j) midpoints[j] = (map[j] + map[j + 1]) / 2;  // as kernels._midpoints
  midpoints[255] = INFINITY;  // never looked up: k <= 254
  to_planes(map, c.planes); to_planes(midpoints, c.mid_planes);
  alignas(64) uint8_t order[64], low_bytes[64], low_bytes_in_order[64];
  for (int x = 0; x < 64; ++x) {
    order[x] = (uint8_t)(16 * (x / 4 % 4) + 4 * (x / 16) + x % 4);
    low_bytes[x] = (uint8_t)(2 * x), low_bytes_in_order[x] = (uint8_t)(2 * order[x]);
  }
  c.order = _mm512_load_si512(order);
  c.low_bytes = _mm512_load_si512(low_bytes); c.low_bytes_in_order = _mm512_load_si512(low_bytes_in_order);
  decades(map, c);
  return c;
}

// 64 table entries for 64 byte indices c already in `order`: out[q] = table[the indices 16 q .. 16 q + 15].
static ALWAYS_INLINE void lookup_in_order(const __m512i (&planes)[4][4], __m512i c, __m512 (&out)[4]) {
  const __mmask64 upper = _mm512_movepi8_mask(c);  // indices >= 128: the upper 128 entries
  __m512i b[4];
  for (int k = 0; k < 4; ++k)
    b[k] = _mm512_mask_blend_epi8(upper, _mm512_permutex2var_epi8(planes[k][0], c, planes[k][1]),
                                         _mm512_permutex2var_epi8(planes[k][2], c, planes[k][3]));
  const __m512i lo01 = _mm512_unpacklo_epi8(b[0], b[1]), hi01 = _mm512_unpackhi_epi8(b[0], b[1]);
  const __m512i lo23 = _mm512_unpacklo_epi8(b[2], b[3]), hi23 = _mm512_unpackhi_epi8(b[2], b[3]);
  out[0] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(lo01, lo23));
  out[1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(lo01, lo23));
  out[2] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(hi01, hi23));
  out[3] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(hi01, hi23));
}

static ALWAYS_INLINE void decode64(const uint8_t* codes, const CodeMap& map, __m512 absmax, float* out) {  // 64 codes
  __m512 f[4];
  lookup_in_order(map.planes, _mm512_permutexvar_epi8(map.order, _mm512_loadu_si512(codes)), f);
  for (int q = 0; q < 4; ++q) _mm512_store_ps(out + 16 * q, _mm512_mul_ps(f[q], absmax));
}

template <bool is_signed>
static ALWAYS_INLINE __m512i estimate(__m512 x0, __m512 x1, const CodeMap& map) {  // 32 codes k, 16-bit lanes
  // [Note: a code from its decade]
  if (!is_signed)  // y = max(0, xn): a NaN stays (max returns its second operand)
    x0 = _mm512_max_ps(_mm512_setzero_ps(), x0), x1 = _mm512_max_ps(_mm512_setzero_ps(), x1);
  const __m512i odd = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33,
                                       31, 29, 27, 25, 23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);  // the high halves
  const __m512i b0 = _mm512_castps_si512(x0), b1 = _mm512_castps_si512(x1);
  const __m512i high = _mm512_permutex2var_epi16(b0, odd, b1);  // sign, exponent, 7 fraction bits
  const __m512i f = _mm512_permutex2var_epi16(_mm512_slli_epi32(b0, 9), odd, _mm512_slli_epi32(b1, 9));  // F
  const __m512i e = _mm512_max_epu16(_mm512_srli_epi16(_mm512_slli_epi16(high, 1), 8), _mm512_set1_epi16(96));
  const __mmask32 up = _mm512_cmpgt_epu16_mask(f, _mm512_permutexvar_epi16(e, map.fraction_switch));  // e's low 5 bits
  // e is 96..127 or 255 (|xn| <= 1 or NaN): bit 5 is set, so its low 6 bits are 32 + binade; the line above: binade
  const __m512i line = _mm512_mask_sub_epi16(e, up, e, _mm512_set1_epi16(32));
  const __m512i a = _mm512_permutex2var_epi16(map.a[0], line, map.a[1]);
  const __m512i b = _mm512_permutex2var_epi16(map.b[0], line, map.b[1]);
  const __m512i k = _mm512_srli_epi16(_mm512_adds_epu16(a, _mm512_mulhi_epu16(b, f)), 8);
  if (!is_signed) return k;
  const __mmask32 negative = _mm512_cmplt_epi16_mask(high, _mm512_set1_epi16(-128));  // the sign bit, not a NaN
  return _mm512_mask_subs_epu16(k, negative, _mm512_set1_epi16(253), k);
}

// 64 values x / scale -> their codes in two halves: estimate (all 64 codes k, and k in `order`), then settle
struct Estimate { __m512i k, k_in_order; };
template <bool is_signed>
static ALWAYS_INLINE Estimate estimate64(const __m512 (&xn)[4], const CodeMap& map) {
  const __m512i k0 = estimate<is_signed>(xn[0], xn[1], map), k1 = estimate<is_signed>(xn[2], xn[3], map);
  return {_mm512_permutex2var_epi8(k0, map.low_bytes, k1), _mm512_permutex2var_epi8(k0, map.low_bytes_in_order, k1)};
}
static ALWAYS_INLINE void settle64(const Estimate& e, const __m512 (&xn)[4], const CodeMap& map, uint8_t* codes) {
  __m512 mid[4];
  lookup_in_order(map.mid_planes, e.k_in_order, mid);
  __mmask16 above[4];  // xn > midpoint k, or NaN
  for (int q = 0; q < 4; ++q) above[q] = _mm512_cmp_ps_mask(xn[q], mid[q], _CMP_NLE_UQ);
  const __mmask64 up = _mm512_kunpackd(_mm512_kunpackw(above[3], above[2]), _mm512_kunpackw(above[1], above[0]));
  _mm512_storeu_si512(codes, _mm512_mask_adds_epu8(e.k, up, e.k, _mm512_set1_epi8(1)));  // 255 stays 255
}

static void decode_block(const Block& in, const CodeMap (&maps)[2]) {
  const __m512 absmax_m = _mm512_set1_ps(in.absmax_m), absmax_v = _mm512_set1_ps(in.absmax_v);
  for (int j = 0; j < 256; j += 64)
    decode64(in.codes_m + j, maps[0], absmax_m, in.m + j), decode64(in.codes_v + j, maps[1], absmax_v, in.v + j);
}

// Encodes a block's m and v (256 each) and, with kNext, decodes the next block's between: [Note: encoding a block
// while decoding the next]
template <bool kNext>
static void encode_block(const float* m, float scale_m, const float* v, float scale_v, const CodeMap (&maps)[2],
                         uint8_t* codes_m, uint8_t* codes_v, const Block& next) {
  const __m512 sm = _mm512_set1_ps(scale_m), sv = _mm512_set1_ps(scale_v);
  const __m512 next_m = _mm512_set1_ps(next.absmax_m), next_v = _mm512_set1_ps(next.absmax_v);
  for (int j = 0; j < 256; j += 64) {
    __m512 xm[4], xv[4];
    for (int q = 0; q < 4; ++q) xm[q] = _mm512_div_ps(_mm512_load_ps(m + j + 16 * q), sm);
    for (int q = 0; q < 4; ++q) xv[q] = _mm512_div_ps(_mm512_load_ps(v + j + 16 * q), sv);
    if (kNext) decode64(next.codes_m + j, maps[0], next_m, next.m + j);
    const Estimate em = estimate64<true>(xm, maps[0]), ev = estimate64<false>(xv, maps[1]);
    if (kNext) decode64(next.codes_v + j, maps[1], next_v, next.v + j);
    settle64(em, xm, maps[0], codes_m + j); settle64(ev, xv, maps[1], codes_v + j);
  }
}
#else
// Without VBMI: gathers from the tables in L1 ([Note: table lookups that vectorize]); the next block's decode after the
// encode, not between its chunks.
struct CodeMap { const float* map; const int32_t* buckets; };
static CodeMap code_map(const float* map, const int32_t* buckets) { return {map, buckets}; }

static void decode_block(const Block& in, const CodeMap (&maps)[2]) {
  const Block b = in; const float* map_m = maps[0].map; const float* map_v = maps[1].map;  // copies, as adamw_range's
  #pragma omp simd
  for (int j = 0; j < 256; ++j) b.m[j] = dequantize(b.codes_m[j], b.absmax_m, map_m);
  #pragma omp simd
  for (int j = 0; j < 256; ++j) b.v[j] = dequantize(b.codes_v[j], b.absmax_v, map_v);
}

template <bool kNext>
static void encode_block(const float* m, float scale_m, const float* v, float scale_v, const CodeMap (&maps)[2],
                         uint8_t* codes_m, uint8_t* codes_v, const Block& next) {
  const int32_t* buckets_m = maps[0].buckets; const int32_t* buckets_v = maps[1].buckets;  // copies: 0.2 ns an element
  #pragma omp simd
  for (int j = 0; j < 256; ++j) {
    codes_m[j] = quantize(m[j], scale_m, buckets_m);
    codes_v[j] = quantize(v[j], scale_v, buckets_v);
  }
  if (kNext) decode_block(next, maps);
}
#endif

// The update of one block's 256 elements, its m and v in place, its absmaxes the new ones; returns 1 if any scaled grad
// was inf/nan: its exponent bits all set, so that the lanes' least of the bits left unset is 0 (an and-not and an
// unsigned min a vector, where adamw_element's flag took 4 instructions). kDecay: whether the block's elements decay
// (none, all, or those before `cut`, for the one block that holds decay_numel: per element, as a bit mask; not a ?:,
// see select)
enum class Decay { none, all, before_cut };
template <class G, class W, Decay kDecay>
static int update_block(const AdamWArgs& args, int64_t block, int cut, Block& b) {
  const AdamWArgs a = args;  // as adamw_range's
  using M = typename W::master_t; using P = typename W::param_t;
  float* m = (float*)__builtin_assume_aligned(b.m, 64);  // the buffers' alignment: no loop to peel
  float* v = (float*)__builtin_assume_aligned(b.v, 64);
  const IndexFrom index(a.index_offset + block * 256);
  float absmax_m = 0.0f, absmax_v = 0.0f;
  uint32_t unset = 0x7F800000u;  // of the scaled grads' exponent bits
  #pragma omp simd reduction(min:unset) reduction(max:absmax_m, absmax_v)
  for (int j = 0; j < 256; ++j) {
    const int64_t i = block * 256 + j;
    M master = get<M>(a.master, i);
    P param = W::reads_param ? get<P>(a.param, i) : P{};
    const float decay = kDecay == Decay::all ? a.decay : kDecay == Decay::none ? 1.0f
                      : float_of(select(j < cut, bits_of(a.decay), bits_of(1.0f)));
    const float grad = to_float(((const G*)a.grad)[i]);
    adamw_element<W>(a, index.at(j), decay, grad, m[j], v[j], master, param);
    put(a.master, i, master); put(a.param, i, param);
    const uint32_t unset_here = ~bits_of(grad * a.grad_scale) & 0x7F800000u;  // the scaled grad, as adamw_element's
    unset = unset_here < unset ? unset_here : unset;
    const float abs_m = fabsf(m[j]), abs_v = fabsf(v[j]);  // a NaN never passes the > (one vmaxps): it is ignored
    absmax_m = abs_m > absmax_m ? abs_m : absmax_m; absmax_v = abs_v > absmax_v ? abs_v : absmax_v;
  }
  b.absmax_m = absmax_m; b.absmax_v = absmax_v;
  return unset == 0;
}

// uint8 state, blocks [first, last): each 256-element block read once and written once. Its m and v stay in L1
// (2 KB) from the decode through the update, which finds their new absmaxes, to the encode with them; the encode of
// block b decodes block b + 1 into the other buffer. [Note: 8-bit state]
//
// [Note: encoding a block while decoding the next]
// A block's phases lean on different units: the update on the floating-point pipes (two divides, a square root, ~30
// other operations per 16 elements), the decode and the encode on the byte and word permutes (~90 per 64 elements,
// both moments). The encode is also one long chain per 64 values (divide, estimate, lookup, compare), and alone it
// leaves the permute pipe idle while the chain waits. So the encode of block b decodes block b + 1 too, the two
// interleaved 64 values at a time: together they take 0.61 ns an element, apart 0.73 (in cache, one thread of the
// 2-core Zen 4: `python .ci/cpu_kernel.py time`, its "part" lines). Interleaving the update as well, in parts of 64
// or 32 elements (with the encode, the decode or both), ran slower: 1.20-1.43 ns an element for the step, against 1.10.
template <class G, class W>
static int adamw_blocks(const AdamWArgs& args, const CodeMap (&maps)[2], int64_t first, int64_t last) {
  const AdamWArgs a = args;  // a local copy, as adamw_range's
  alignas(64) float moments[2][2][256];  // [block & 1][m, v]
  const auto block_at = [&](int64_t block) {
    float* m = moments[block & 1][0]; float* v = moments[block & 1][1];
    return Block{(uint8_t*)a.exp_avg + block * 256, (uint8_t*)a.exp_avg_sq + block * 256,
                 a.exp_avg_absmax[block], a.exp_avg_sq_absmax[block], m, v};
  };
  if (first < last) decode_block(block_at(first), maps);
  int bad = 0;
  for (int64_t block = first; block < last; ++block) {
    Block here = block_at(block);
    const int cut = (int)std::clamp<int64_t>(a.decay_numel - block * 256, 0, 256);  // j < cut: decayed
    bad |= cut == 256 ? update_block<G, W, Decay::all>(a, block, cut, here)
         : cut == 0 ? update_block<G, W, Decay::none>(a, block, cut, here)
                    : update_block<G, W, Decay::before_cut>(a, block, cut, here);
    const float scale_m = code_scale(here.absmax_m), scale_v = code_scale(here.absmax_v);
    if (block + 1 < last)
      encode_block<true>(here.m, scale_m, here.v, scale_v, maps, here.codes_m, here.codes_v, block_at(block + 1));
    else
      encode_block<false>(here.m, scale_m, here.v, scale_v, maps, here.codes_m, here.codes_v, {});  // no next
    a.exp_avg_absmax[block] = here.absmax_m; a.exp_avg_sq_absmax[block] = here.absmax_v;
  }
  return bad;
}

template <class G, class S, class W>
static void adamw_cpu(const AdamWArgs& a) {
  int bad = 0;
  if constexpr (std::is_same<S, uint8_t>::value) {
    const CodeMap maps[2] = {code_map(a.tables + SIGNED_MAP, a.buckets + SIGNED_BUCKETS),
                             code_map(a.tables + UNSIGNED_MAP, a.buckets + UNSIGNED_BUCKETS)};
    #pragma omp parallel reduction(|:bad) if(a.n > 65536)
    {  // each thread a contiguous run of blocks, for the pipeline above
      const int64_t blocks = a.n / 256, threads = omp_get_num_threads(), t = omp_get_thread_num();
      const int64_t per = (blocks + threads - 1) / threads;
      bad |= adamw_blocks<G, W>(a, maps, std::min(blocks, t * per), std::min(blocks, (t + 1) * per));
    }
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

// A stage-3 gather's compute param from the fp32 master shard: kernels.cast_param, one pass of 6 bytes an element
// (`parallel:` keeps the threshold off the simd: a bare if(...) on a combined construct turns simd off too)
extern "C" int cast_bf16(const float* x, bf16* out, int64_t n, void* stream) {
  #pragma omp parallel for simd if(parallel: n > 65536)
  for (int64_t i = 0; i < n; ++i) out[i] = bf16_away(x[i]);
  return 0;
}

// The part of nanozero's fused AdamW step that the CPU library (adamw_cpu.cpp, g++) and the CUDA library
// (adamw.cu, nvcc) share: the argument struct, the roundings, the weight policies, the element update.
// library.py builds them, kernels.py calls them; see their notes for the why of each piece.
#pragma once
#include <stdint.h>
#include <stddef.h>
#include <string.h>
#include <math.h>
#include <type_traits>
#ifdef __CUDACC__
#define HD __host__ __device__ __forceinline__
#else
#define HD inline
#endif

// One step over a flat shard of n elements; library.AdamWArgs mirrors it field for field.
struct AdamWArgs {
  void* master;          // fp32 or int16 remainder (n,), or null
  void* param;           // fp32, bf16 or fp16 (n,), or null
  const void* grad;      // fp32 or bf16 (n,)
  void* exp_avg; void* exp_avg_sq;  // fp32, bf16 or uint8 codes (n,)
  float* exp_avg_absmax; float* exp_avg_sq_absmax;  // uint8 state: (n / 256,)
  const float* tables;   // uint8 state: the signed and the unsigned code map (kernels._code_tables)
  const int32_t* buckets;  // uint8 state: [Note: a code in one load]
  float* found_inf;      // (1,): set to 1.0 if any scaled grad is inf/nan, never reset
  int64_t n, decay_numel;  // elements [0, decay_numel) get weight decay
  int64_t index_offset;  // the shard's offset in the flat buffer, for the rounding hash
  int32_t grad_kind, state_kind, weights_kind;  // which template instance: see dispatch()
  uint32_t seed, step;   // stochastic rounding: [Note: stochastic rounding, reproducibly]
  // the step's constants, computed in double and rounded to float as torch's AdamW does
  float grad_scale, one_minus_beta1, beta2, one_minus_beta2, eps;
  float decay;                  // 1 - lr * weight_decay
  float step_size;              // lr / (1 - beta1^step)
  float bias_correction2_sqrt;  // sqrt(1 - beta2^step)
};
extern "C" size_t adamw_args_size() { return sizeof(AdamWArgs); }

// 16-bit floats as their bits, so the same types work in host and device code. Empty: a stream the mode lacks.
struct bf16 { uint16_t bits; };
struct fp16 { uint16_t bits; };
struct Empty {};
template <class T> HD T get(const void* p, int64_t i) {
  if constexpr (std::is_same<T, Empty>::value) return {}; else return ((const T*)p)[i];
}
template <class T> HD void put(void* p, int64_t i, T x) {
  if constexpr (!std::is_same<T, Empty>::value) ((T*)p)[i] = x;
}

HD uint32_t bits_of(float x) { uint32_t u; memcpy(&u, &x, 4); return u; }
HD float float_of(uint32_t u) { float x; memcpy(&x, &u, 4); return x; }
// c ? x : y, on the CPU as bit masks: g++ turns some ?: into branches when it vectorizes for AVX2 (no mask registers),
// and the loop around them runs scalar (the 8-bit block's decay cut made its step 2x slower there). nvcc keeps the ?:
// (a select instruction; the masks cost the fp16 kernels ~8 instructions an element)
HD uint32_t select(bool c, uint32_t x, uint32_t y) {
#ifdef __CUDA_ARCH__
  return c ? x : y;
#else
  return y ^ ((x ^ y) & (0u - (uint32_t)c));
#endif
}
HD float to_float(float x) { return x; }
HD float to_float(bf16 x) { return float_of((uint32_t)x.bits << 16); }

// bf16 = the top half of the fp32 bits after adding `below` (< 2^16): 0x8000 rounds half away from zero,
// 0x7FFF + the lowest kept bit to nearest-even, a random number stochastically. [Note: one bf16 rounding rule]
HD bf16 bf16_round(float x, uint32_t below) {
  const uint32_t b = bits_of(x);
  uint32_t rounded = b + below;
  if (x != x) rounded = b | 0x400000u;  // the add could carry a NaN into inf: keep it a quiet NaN (its quiet bit set)
  // (x != x and !(|g| < inf) below hold because neither library is built with fast math, which would fold them to
  // false). One shift for both: an instruction less on sm_90. Written as an `if`, not a ?: whose arms g++ shifts and
  // narrows apart: its vector loop then adds under the NaN mask, 4.5 instructions a value where it took 6.5
  return {(uint16_t)(rounded >> 16)};
}
HD bf16 bf16_nearest_even(float x) { return bf16_round(x, 0x7FFFu + ((bits_of(x) >> 16) & 1u)); }
HD bf16 bf16_away(float x) { return bf16_round(x, 0x8000u); }

// fp32 -> fp16, round to nearest-even, denormals, inf and NaN included (as .to(torch.float16)). Both roundings are
// computed and one selected, without branches, so the CPU loop stays vectorized.
HD fp16 fp16_nearest_even(float x) {
  const uint32_t b = bits_of(x), a = b & 0x7FFFFFFFu;
  // >= 2^-14, a normal fp16: rebias the exponent 127 -> 15 and round at bit 13, as bf16_nearest_even at bit 16
  const uint32_t normal = (a - 0x38000000u + 0xFFFu + ((a >> 13) & 1u)) >> 13;
  // below, a denormal fp16: a multiple of 2^-24, to which the FPU rounds |x| + 0.5 (whose ulp is 2^-24)
  const uint32_t denormal = bits_of(float_of(a) + 0.5f) - 0x3F000000u;
  const uint32_t h = select(a > 0x7F800000u, 0x7E00u,        // NaN -> quiet NaN
                            select(a >= 0x477FF000u, 0x7C00u,  // >= 65520, the tie between 65504 and 2^16: inf
                                   select(a >= 0x38800000u, normal, denormal)));
  return {(uint16_t)((b >> 16 & 0x8000u) | h)};
}

HD uint32_t lowbias32(uint32_t x) {
  x ^= x >> 16; x *= 0x7FEB352Du; x ^= x >> 15; x *= 0x846CA68Bu; x ^= x >> 16; return x;
}
HD uint32_t rounding_key(uint32_t seed, uint32_t step) { return lowbias32(lowbias32(seed) ^ step); }  // once a step
// An element's index in the full flat buffer as the hash reads it: the low half, and the high half times an odd constant
// (folded in by one xor). A type of its own so that the CPU's loops carry it in 32-bit lanes: the high half changes
// once in 2^32 elements (IndexFrom, adamw_cpu.cpp), whereas an int64 index takes 64-bit lanes and conversions.
struct Index { uint32_t low, high_mixed; };
constexpr uint32_t kHighMix = 0x9E3779B9u;
HD Index index_of(int64_t i) { return {(uint32_t)i, (uint32_t)((uint64_t)i >> 32) * kHighMix}; }
// one mix an element, of an odd multiple of the index plus the step's key: [Note: stochastic rounding, reproducibly]
HD uint32_t rounding_hash(uint32_t key, Index at) { return lowbias32((at.low ^ at.high_mixed) * (key | 1u) + key); }

// Weights policies: where the fp32 weights come from and where they go. param_t is read only if reads_param; `at`, the
// element's index in the flat buffer, only by the stochastic rounding.
HD void cast(float, Empty&) {}
HD void cast(float x, float& p) { p = x; }
HD void cast(float x, bf16& p) { p = bf16_away(x); }
HD void cast(float x, fp16& p) { p = fp16_nearest_even(x); }

template <class P> struct Fp32Master {  // the fp32 master, and a compute param (none, fp32, bf16, fp16) cast from it
  using master_t = float; using param_t = P; static constexpr bool reads_param = false;
  static HD float load(float master, P) { return master; }
  static HD void store(const AdamWArgs&, Index, float x, float& master, P& param) { master = x; cast(x, param); }
};
struct Remainder {  // [Note: remainder master]
  using master_t = int16_t; using param_t = bf16; static constexpr bool reads_param = true;
  static HD float load(int16_t low, bf16 param) {
    const uint32_t high = (uint16_t)(param.bits - (low < 0));  // a negative remainder: the bf16 was rounded up
    return float_of(high << 16 | (uint16_t)low);
  }
  static HD void store(const AdamWArgs&, Index, float x, int16_t& low, bf16& param) {
    param = bf16_away(x);
    low = (int16_t)(uint16_t)bits_of(x);
  }
};
template <bool stochastic> struct NoMaster {  // the bf16 param is the only copy of the weights
  using master_t = Empty; using param_t = bf16; static constexpr bool reads_param = true;
  static HD float load(Empty, bf16 param) { return to_float(param); }
  static HD void store(const AdamWArgs& a, Index at, float x, Empty&, bf16& param) {
    param = stochastic ? bf16_round(x, rounding_hash(rounding_key(a.seed, a.step), at) & 0xFFFFu)
                       : bf16_nearest_even(x);
  }
};

// The moments: fp32 or bf16 (rounded to nearest-even) per element; uint8 per block, in the kernels' block paths,
// with the code maps at these offsets in args.tables and the buckets in args.buckets (kernels._code_tables)
enum { SIGNED_MAP = 0, UNSIGNED_MAP = 256 };
enum { SIGNED_BUCKETS = 0, UNSIGNED_BUCKETS = 1 << 16 };
HD void from_float(float x, float& out) { out = x; }
HD void from_float(float x, bf16& out) { out = bf16_nearest_even(x); }
// [Note: table lookups that vectorize] Both loops of the CPU block gather from tables. g++ emits a gather (16 lanes in
// one instruction) only for a signed 32-bit offset computed in 32-bit lanes; an offset it can prove non-negative
// (a uint8 code, the top half of a uint32) is widened to 64 bits and the "gather" becomes 16 scalar loads. So each
// table is indexed from its middle by bits read as signed: code - 128 = (int8_t)(code ^ 0x80), made with 32-bit
// shifts; a bucket by the top 16 bits of xn read as an int16 (one arithmetic shift), the kernels' bucket tables stored
// rotated by half (kernels._code_tables: negative values' buckets first). About twice the speed (measured on AVX-512).
// Rotated, not t ^ 0x8000 on the table in order: one instruction a value less (sm_90, .ci/sass_round.py).
HD float dequantize(uint8_t code, float absmax, const float* map) {
  return (map + 128)[(int32_t)((uint32_t)code << 24 ^ 0x80000000u) >> 24] * absmax;
}
HD float code_scale(float absmax) { return absmax > 0.0f ? absmax : 1.0f; }  // an all-zero block divides by 1
// [Note: a code in one load]
// The code of xn is the number of midpoints below it; a binary search over the 255 midpoints costs 8 dependent loads
// per element. Instead, group the fp32 values by their top 16 bits (sign, exponent, 7 fraction bits): 2^16 buckets,
// each 1/256 to 1/128 of its values wide. No bucket holds two midpoints (the closest two are 0.9/128 apart, near 1,
// where a bucket is 1/256 wide; kernels._buckets builds the table and checks it), so one int32 per bucket answers
// exactly: its low 8 bits count the midpoints below the bucket, the bits above hold a threshold on the low 16 bits
// of xn, past which xn is above the bucket's own midpoint too. Within a bucket the low 16 bits grow with the value
// (flipped for negatives: there they grow with the magnitude), so code = (entry & 255) + (key(xn) >= entry >> 8),
// one gathered load and integer compares. E.g. the unsigned midpoint 240 is 0.9015625119 = 0x3F66CCCD: bucket 0x3F66
// holds 240 below and the threshold 0xCCCE, so xn = that midpoint (a tie) gets code 240 and the next fp32 up,
// 0x3F66CCCE, code 241. A bucket without a midpoint has threshold 2^16, never reached. NaN buckets hold 255, as
// torch.searchsorted puts a NaN above every midpoint (xn = x / absmax is never +-inf: an inf x makes absmax inf and
// xn NaN).
// flip = false (the unsigned map's buckets, exp_avg_sq): its midpoints are all positive, so no bucket of negative
// values (NaNs included) holds one, and their threshold 2^16 is never reached whatever the key: the flip changes no
// code there (test_kernels.py checks the table), and the GPU's encode saves its instructions.
template <bool flip = true> HD uint8_t code_of(float xn, const int32_t* buckets) {
  const uint32_t b = bits_of(xn);
  const int32_t entry = (buckets + 32768)[(int32_t)b >> 16];  // the bucket of top 16 bits t: kernels' entry t ^ 0x8000
  const int32_t key = (int32_t)((flip ? b ^ (uint32_t)((int32_t)b >> 31) : b) & 0xFFFFu);  // negatives: low half flipped
  return (uint8_t)(entry + ((uint32_t)((entry >> 8) - 1 - key) >> 31));  // + 1 where key >= threshold (sign of the
  // difference, not a compare and a select: 2 instructions a value less on sm_90; entry's low 8 bits never carry)
}
HD uint8_t quantize(float x, float scale, const int32_t* buckets) { return code_of(x / scale, buckets); }

// [Note: dividing by the reciprocal, exactly]
// x / d rounded once (IEEE), from r = 1 / d (itself rounded once) and four fmas, for a d shared by many x (a block's
// scale, the step's bias_correction2_sqrt): a GPU's divide is a reciprocal, five dependent fmas, a range check and a
// branch to a slow path, per element. The claim: for d in [2^-64, 2^64], the result is x / d bit for bit wherever
// |x| >= 2^-100 and the quotient is normal and finite (|x / d| in [2^-126, 2^127)); an x = inf gives inf and a NaN a
// NaN; and any quotient below 2^-24 comes out below 2^-23 (in the 8-bit code all of those take the code of 0: the
// smallest midpoints are 1.6e-7 and 2.7e-7). The kernel's two uses stay there: x / scale is at most 1 in magnitude,
// and sqrt(v) / bias_correction2_sqrt is at least 2^-74.5 (or 0) over at least 2^-26.5 (kernels.adamw_step takes
// 0 <= beta2 < 1), at most 2^64 / 2^-26.5.
// Why: q0 = x * r is within 1.5 ulps of x / d, not always within 1. The first correction, q0 + (x - q0 * d) * r with
// its residual rounded, lands within an ulp (faithful). The second residual, x - q1 * d, is then exact (Boldo and
// Daumas), and with r within half an ulp of 1 / d, q1 + that residual * r rounded once is the correctly rounded
// quotient (Markstein's theorem; no underflow: hence the bounds above).
// Checked: test_dividing_by_the_reciprocal_equals_the_divide, against the divide on the host, whose fma and divide
// are IEEE as the GPU's are; when written, 2e9 random pairs and every fp32 x in [0, d] for five d gave no mismatch,
// for one correction as for two: the second is there for the proof. The encode's divides skip the guard for x = inf
// (may_be_inf = false): on the kernel's fast path the block's scale is at most 2^64, so every moment is finite or NaN
// (an inf moment makes absmax inf: the slow path). Two compares and selects an element less (.ci/sass_round.py,
// sm_90: 115.4 -> 111.4 instructions an element in the fp32-master int8 mode, 110.4 with code_of<false>; the same
// test checks both forms).
HD bool reciprocal_divides_exactly(float d) { return d >= 0x1p-64f && d <= 0x1p64f; }
template <bool may_be_inf = true> HD float divide_by_reciprocal(float x, float d, float r) {
  const float q0 = x * r;
  const float q1 = fmaf(fmaf(-q0, d, x), r, q0);
  const float q2 = fmaf(fmaf(-q1, d, x), r, q1);
  return may_be_inf && fabsf(q0) == INFINITY ? q0 : q2;  // x = inf: the residual is inf - inf
}

// The update of one element, in the reference's op order. Each op rounds once (the CPU build has -ffp-contract=off,
// the CUDA one --fmad=false; sqrtf and / are IEEE); the two fmaf are where torch's own CPU kernels fuse (lerp,
// addcmul), so exp_avg and exp_avg_sq match torch bit for bit. Returns true if the scaled grad is inf or nan.
// kByReciprocal (the CUDA 8-bit kernel): sqrt(v) / bias_correction2_sqrt by [Note: dividing by the reciprocal,
// exactly]; the same reciprocal every element, computed once after inlining (kernels.adamw_step takes 0 <= beta2 < 1,
// so bias_correction2_sqrt is in [2^-27, 1], in the domain).
template <class W, bool kByReciprocal = false>
HD bool adamw_element(const AdamWArgs& a, Index at, float decay, float grad, float& m, float& v,
                      typename W::master_t& master, typename W::param_t& param) {
  const float g = grad * a.grad_scale;
  m = fmaf(a.one_minus_beta1, g - m, m);          // exp_avg.lerp_(g, 1 - beta1)
  v = fmaf(a.one_minus_beta2 * g, g, v * a.beta2);  // exp_avg_sq.mul_(beta2).addcmul_(g, g, 1 - beta2)
  const float root = sqrtf(v);
  const float bc2 = a.bias_correction2_sqrt;
  const float denom = (kByReciprocal ? divide_by_reciprocal(root, bc2, 1.0f / bc2) : root / bc2) + a.eps;
  const float x = W::load(master, param) * decay - a.step_size * m / denom;  // mul_(decay).addcdiv_(m, denom, -step_size)
  W::store(a, at, x, master, param);
  return !(fabsf(g) < INFINITY);  // inf or NaN: one compare
}

// Calls f(grad type, state type, weights policy) for the kinds in the args: 2 x 3 x 7 = 42 instances, one switch.
template <class F> auto dispatch(const AdamWArgs& a, F f) {
  auto with_weights = [&](auto grad, auto state) {
    switch (a.weights_kind) {  // kernels._WEIGHTS_KINDS
      case 1: return f(grad, state, Fp32Master<float>{});
      case 2: return f(grad, state, Fp32Master<bf16>{});
      case 3: return f(grad, state, Fp32Master<fp16>{});
      case 4: return f(grad, state, Remainder{});
      case 5: return f(grad, state, NoMaster<false>{});
      case 6: return f(grad, state, NoMaster<true>{});
      default: return f(grad, state, Fp32Master<Empty>{});
    }
  };
  auto with_state = [&](auto grad) {
    return a.state_kind == 2 ? with_weights(grad, uint8_t{}) :
           a.state_kind == 1 ? with_weights(grad, bf16{}) : with_weights(grad, float{});
  };
  return a.grad_kind == 1 ? with_state(bf16{}) : with_state(float{});
}

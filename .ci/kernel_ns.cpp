// The CPU kernel's step in cache, one thread, no Python in the way: ns an element for each storage-precision mode of
// bench.py kernels --modes (fp32 grads, 64K elements, the best of 400 calls). Run by `python .ci/cpu_kernel.py time`;
// compiler flags after `time` (e.g. -DNAME) build a variant of csrc/ under #ifdef NAME. With AVX-512 VBMI it also
// times the 8-bit block's byte-permute parts alone, ns an element (its m and its v): the encode, the decode, and the
// encode with the next block's decode between ([Note: encoding a block while decoding the next]).
#include "../csrc/adamw_cpu.cpp"
#include <chrono>
#include <cstdio>
#include <random>
#include <vector>

int main(int argc, char** argv) {
  std::vector<float> tables(512); std::vector<int32_t> buckets(2 << 16);
  FILE* f = fopen(argv[1], "rb");
  if (!f || fread(tables.data(), 4, 512, f) != 512 || fread(buckets.data(), 4, 2 << 16, f) != 2 << 16) return 2;
  fclose(f);
  const int64_t n = 1 << 16;
  std::mt19937 rng(1); std::normal_distribution<float> normal(0, 1);
  std::vector<float> master(n), grad(n), m32(n, 0.0f), v32(n, 0.0f), absmax_m(n / 256, 1e-3f), absmax_v(n / 256, 1e-6f);
  std::vector<uint16_t> param(n), m16(n, 0), v16(n, 0);
  std::vector<int16_t> remainder(n, 0);
  std::vector<uint8_t> m8(n), v8(n);
  for (int64_t i = 0; i < n; ++i)
    master[i] = normal(rng) * 0.02f, grad[i] = normal(rng) * 1e-3f, m8[i] = rng(), v8[i] = rng();
  float found_inf = 0;
  const struct { const char* name; int weights, state; } modes[] = {  // kernels._WEIGHTS_KINDS, _STATE_KINDS
    {"fp32 master -> bf16 param", 2, 0}, {"fp32 master -> bf16, bf16 m/v", 2, 1},
    {"fp32 master -> bf16, int8 m/v", 2, 2}, {"fp32 master, no param", 0, 0}, {"fp32 master -> fp16 param", 3, 0},
    {"remainder + bf16 param", 4, 0}, {"remainder, int8 m/v", 4, 2}, {"bf16 param only", 5, 0},
    {"bf16 param only, stochastic", 6, 0}, {"bf16 param only, stochastic, int8 m/v", 6, 2}};
  for (const auto& mode : modes) {
    AdamWArgs a{};
    a.master = mode.weights <= 3 ? (void*)master.data() : mode.weights == 4 ? (void*)remainder.data() : nullptr;
    a.param = mode.weights == 0 ? nullptr : param.data(); a.grad = grad.data();
    void* moments[3][2] = {{m32.data(), v32.data()}, {m16.data(), v16.data()}, {m8.data(), v8.data()}};
    a.exp_avg = moments[mode.state][0]; a.exp_avg_sq = moments[mode.state][1];
    a.exp_avg_absmax = absmax_m.data(); a.exp_avg_sq_absmax = absmax_v.data();
    a.tables = tables.data(); a.buckets = buckets.data(); a.found_inf = &found_inf;
    a.n = n; a.decay_numel = n / 2; a.state_kind = mode.state; a.weights_kind = mode.weights; a.seed = 1; a.step = 10;
    a.grad_scale = 1; a.one_minus_beta1 = 0.1f; a.beta2 = 0.95f; a.one_minus_beta2 = 0.05f; a.eps = 1e-8f;
    a.decay = 1 - 6e-5f; a.step_size = 6e-4f; a.bias_correction2_sqrt = 0.6f;
    double best = 1e30;
    for (int r = 0; r < 400; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      adamw_step(&a, nullptr);
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    printf("%-40s %.3f ns an element\n", mode.name, best * 1e9 / n);
  }
#if defined(__AVX512VBMI__)
  const CodeMap maps[2] = {code_map(tables.data() + SIGNED_MAP, nullptr), code_map(tables.data() + UNSIGNED_MAP, nullptr)};
  alignas(64) static float x[2][64 * 256]; alignas(64) static uint8_t codes[2][64 * 256];  // 64 blocks: in cache
  for (int j = 0; j < 64 * 256; ++j) x[0][j] = normal(rng) * 0.01f, x[1][j] = x[0][j] * x[0][j];
  for (int part = 0; part < 3; ++part) {
    double best = 1e30;
    for (int r = 0; r < 2000; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      for (int b = 0; b < 64; ++b) {
        const int at = 256 * b, next = 256 * ((b + 1) % 64);
        const Block block{codes[0] + next, codes[1] + next, 0.05f, 0.0025f, x[0] + next, x[1] + next};
        if (part == 0) encode_block<false>(x[0] + at, 0.05f, x[1] + at, 0.0025f, maps, codes[0] + at, codes[1] + at, {});
        else if (part == 1) decode_block({codes[0] + at, codes[1] + at, 0.05f, 0.0025f, x[0] + at, x[1] + at}, maps);
        else encode_block<true>(x[0] + at, 0.05f, x[1] + at, 0.0025f, maps, codes[0] + at, codes[1] + at, block);
      }
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    const char* names[3] = {"  part: encode (m and v)", "  part: decode (m and v)", "  part: encode + next's decode"};
    printf("%-40s %.3f ns an element\n", names[part], best * 1e9 / (64 * 256));
  }
#endif
}

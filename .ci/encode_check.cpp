// Every fp32 xn in [-1, 1] and every NaN, both code maps: the CPU kernel's encode (csrc/adamw_cpu.cpp, [Note: a code
// from its decade]) gives the code the buckets give ([Note: a code in one load]: the reference's searchsorted count).
// Run by `python .ci/cpu_kernel.py check`, which writes the tables and compiles this with the library's CPU flags.
#include "../csrc/adamw_cpu.cpp"
#include <cstdio>
#include <vector>

int main(int argc, char** argv) {
#if !defined(__AVX512VBMI__)
  printf("this CPU has no AVX-512 VBMI: the kernel encodes by the buckets themselves, nothing to check\n");
  return 0;
#else
  std::vector<float> tables(512); std::vector<int32_t> buckets(2 << 16);
  FILE* f = fopen(argv[1], "rb");
  if (!f || fread(tables.data(), 4, 512, f) != 512 || fread(buckets.data(), 4, 2 << 16, f) != 2 << 16) return 2;
  fclose(f);
  const CodeMap maps[2] = {code_map(tables.data() + SIGNED_MAP, nullptr), code_map(tables.data() + UNSIGNED_MAP, nullptr)};
  int64_t values = 0, wrong[2] = {0, 0};
  #pragma omp parallel for reduction(+:values) schedule(dynamic, 1)
  for (int64_t chunk = 0; chunk < (1 << 16); ++chunk) {
    alignas(64) static thread_local float x[1 << 16];  // the kernel's loads are aligned
    alignas(64) static thread_local uint8_t codes[2][1 << 16];
    int n = 0;
    for (uint32_t i = 0; i < (1u << 16); ++i) {  // bits = index * an odd number: every 32-bit pattern once, in an order
      const float xn = float_of(((uint32_t)chunk << 16 | i) * 0x9E3779B9u);  // that mixes signs and sizes in a vector
      if (fabsf(xn) <= 1.0f || xn != xn) x[n++] = xn;  // (in bit order a lane-order bug hides: the settle repairs it)
    }
    if (n == 0) continue;
    values += n;
    for (; n % 256; ++n) x[n] = 0.0f;
    for (int j = 0; j < n; j += 256)  // scale 1: x / 1 is x; the same x as m (signed map) and as v (unsigned)
      encode_block<false>(x + j, 1.0f, x + j, 1.0f, maps, codes[0] + j, codes[1] + j, {});
    for (int j = 0; j < n; ++j) {
      const uint8_t want[2] = {code_of<true>(x[j], buckets.data() + SIGNED_BUCKETS),
                               code_of<false>(x[j], buckets.data() + UNSIGNED_BUCKETS)};
      for (int s = 0; s < 2; ++s) if (codes[s][j] != want[s]) {
        #pragma omp atomic
        ++wrong[s];
        if (wrong[s] <= 3) printf("%s map: xn %a (0x%08x) gets code %d, the buckets %d\n", s ? "unsigned" : "signed",
                                  x[j], bits_of(x[j]), codes[s][j], want[s]);
      }
    }
  }
  printf("%lld values a map (every fp32 in [-1, 1], every NaN): %lld signed and %lld unsigned codes differ\n",
         (long long)values, (long long)wrong[0], (long long)wrong[1]);
  return wrong[0] || wrong[1];
#endif
}

// Prefill timing of one kernel table against another build of the library's kernels, in one
// process, interleaved rounds, fastest of each (docs/benchmarks.md, "Evening, prefill on the
// same Zen 3"). The headers' kernels are instantiated here for AVX2 (internal linkage, so they
// do not clash with the objects linked in); the linked objects are the library to compare with:
//
//   g++ -O3 -std=c++17 -mavx2 -mfma -mf16c -DCIM_INT4_X86_KERNELS -Iops/cpp
//       ops/cpp/tools/prefill_bench.cpp <other build>/CMakeFiles/cim_int4_kernels.dir/kernels/*.o -o prefill_bench
//   (one command line)
//   ./prefill_bench M K N ROUNDS LAYERS RANGES   (defaults 128 4096 4096 7 1 1; group 32, float16 scales)
//
// LAYERS > 1 times a chain of that many layers of the same shape (each its own weights, so
// they come from memory, not cache, as in a model) and prints the time per layer; RANGES > 1
// runs each layer's tiles in at most that many calls, split as the op splits them (one range
// per pool thread).
//
// With -DPREFILL_BENCH_AVX512 (and -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512vnni
// -mfma -mf16c) the headers are instantiated as the avx512_vnni table and timed against it.
//
// It prints GMAC/s per form and says when the two give different bits.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "kernels/prefill_kernels.h"
#include "kernels/repack.h"
#include "kernels/simd_avx2.h"
#include "kernels/simd_avx512.h"

using namespace cim;
#if defined(PREFILL_BENCH_AVX512)
using S = Avx512<true>;
constexpr const char* kTable = "avx512_vnni";
#else
using S = Avx2<Dot::kMaddubs>;
constexpr const char* kTable = "avx2";
#endif
using P = PrefillKernels<S>;
using T = TileKernels<S>;

int main(int argc, char** argv) {
  const int64_t M = argc > 1 ? atoll(argv[1]) : 128, K = argc > 2 ? atoll(argv[2]) : 4096;
  const int64_t N = argc > 3 ? atoll(argv[3]) : 4096;
  const int rounds = argc > 4 ? atoi(argv[4]) : 7;
  const int layers = argc > 5 ? atoi(argv[5]) : 1;
  const int64_t ranges = argc > 6 ? atoll(argv[6]) : 1;
  if (M < 1 || K < 1 || N < 1 || rounds < 1 || layers < 1 || ranges < 1) {
    std::fprintf(stderr, "M, K, N, ROUNDS, LAYERS and RANGES must be positive\n");
    return 1;
  }
  const int64_t gs = 32;
  std::mt19937 rng(1);
  std::vector<uint8_t> packed(static_cast<size_t>(N * ((K + gs - 1) / gs * gs) / 2));
  for (auto& b : packed) b = static_cast<uint8_t>(rng());
  std::vector<uint16_t> scales(static_cast<size_t>(N * ((K + gs - 1) / gs)));
  for (auto& s : scales) s = static_cast<uint16_t>(0x2000 + (rng() & 0x3ff));  // small float16
  std::vector<PackedStorage> st(static_cast<size_t>(layers));
  for (auto& layer : st) {
    const std::string err = layer.build(K, N, gs, 4, packed.data(), scales.data(), cim::kScaleF16, nullptr, nullptr);
    if (!err.empty()) {
      std::fprintf(stderr, "%s\n", err.c_str());
      return 1;
    }
  }
  std::vector<float> A(static_cast<size_t>(M * K)), Y(static_cast<size_t>(M * N)), Y2(Y.size());
  for (auto& a : A) a = std::uniform_real_distribution<float>(-1, 1)(rng);
  const int64_t groups = (K + gs - 1) / gs;
  std::vector<int8_t> q(static_cast<size_t>(M * groups * gs));
  std::vector<float> qs(static_cast<size_t>(M * groups));
  std::vector<int32_t> qz(qs.size());
  T::quantize_a(A.data(), M, K, K, gs, q.data(), qs.data(), qz.data());
  QuantizedA qa{q.data(), qs.data(), qz.data()};
  MatMulArgs here{A.data(), M, K, Y.data(), N, &st[0].weights(), &qa};
  MatMulArgs linked = here;
  linked.Y = Y2.data();
  const char* available = nullptr;
  const KernelTable* lib = select_kernels(kTable, &available);
  if (lib == nullptr) {
    std::fprintf(stderr, "this CPU does not run the %s table (available: %s)\n", kTable, available);
    return 1;
  }
  using F32 = T::Form<4, true, false>;
  using I8 = T::Form<4, true, true>;
  const int64_t tiles = st[0].weights().tiles;
  const int64_t span = range_span(tiles, ranges);  // the op's split (kernel.h)
  // Seconds per layer of f(args, tile_begin, tile_end) over the chain, RANGES calls a layer.
  auto time = [&](MatMulArgs& args, auto f) {
    const auto t0 = std::chrono::steady_clock::now();
    for (const auto& layer : st) {
      args.W = &layer.weights();
      for (int64_t begin = 0; begin < tiles; begin += span) f(args, begin, std::min(tiles, begin + span));
    }
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / layers;
  };
  double best[4] = {1e9, 1e9, 1e9, 1e9};
  bool same[2] = {true, true};
  const MatMulFn fp32 = lib->default_variant(kFp32).matmul[kFp32], int8 = lib->default_variant(kInt8).matmul[kInt8];
  for (int r = 0; r < rounds; ++r) {
    best[0] = std::min(best[0], time(here, [](auto& a, int64_t b, int64_t e) { P::prefill<F32>(a, b, e); }));
    best[1] = std::min(best[1], time(linked, [&](auto& a, int64_t b, int64_t e) { fp32(a, b, e); }));
    same[0] = same[0] && std::memcmp(Y.data(), Y2.data(), Y.size() * sizeof(float)) == 0;
    best[2] = std::min(best[2], time(here, [](auto& a, int64_t b, int64_t e) { P::prefill<I8>(a, b, e); }));
    best[3] = std::min(best[3], time(linked, [&](auto& a, int64_t b, int64_t e) { int8(a, b, e); }));
    same[1] = same[1] && std::memcmp(Y.data(), Y2.data(), Y.size() * sizeof(float)) == 0;
  }
  const char* names[4] = {"fp32, these headers", "fp32, linked library", "int8, these headers", "int8, linked library"};
  for (int i = 0; i < 4; ++i) {
    std::printf("M=%lld K=%lld N=%lld %-22s %8.2f ms %6.1f GMAC/s\n", static_cast<long long>(M),
                static_cast<long long>(K), static_cast<long long>(N), names[i], best[i] * 1e3,
                double(M) * K * N / best[i] / 1e9);
  }
  std::printf("same bits: fp32 %s, int8 %s\n", same[0] ? "yes" : "NO", same[1] ? "yes" : "NO");
  return same[0] && same[1] ? 0 : 2;
}

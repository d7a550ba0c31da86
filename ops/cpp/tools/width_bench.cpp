// Decode (M = 1, int8 mode) of one layer held in L2, every code width, kernel only: how fast each
// width's loop runs when memory is not what limits it (docs/widths.md, "Compute-bound speed by
// width"). A width whose loop runs slower per byte than the 4-bit one, hot, is compute-bound near
// the memory wall too: a cold stream then takes about the read's time plus the loop's. Build
// against the library's kernel objects:
//
//   g++ -O2 -std=c++17 -mavx2 -DCIM_INT4_X86_KERNELS -Iops/cpp -I<build>/generated
//       ops/cpp/tools/width_bench.cpp <build>/CMakeFiles/cim_int4_kernels.dir/kernels/*.o -o width_bench
//   CIM_INT4_KERNEL=avx512_vnni [CIM_INT4_VARIANT=n4x2-pf2k] ./width_bench [K N CALLS]
//                                                         (default 576 1536 500: 0.3-0.9 MB)
//
// Per width (4: the table's int8 default variant, or CIM_INT4_VARIANT's; the other widths
// follow its form, KernelTable::matmul_for), the fastest of 5 passes of CALLS calls on the
// same weights, float16 scales, group 32: GB/s of the stream and billions of weights a second.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <string>
#include <vector>

#include "kernels/kernel.h"
#include "kernels/repack.h"
#include "tools/bench_table.h"

using namespace cim;

int main(int argc, char** argv) {
  const int64_t K = argc > 1 ? std::atoll(argv[1]) : 576;
  const int64_t N = argc > 2 ? std::atoll(argv[2]) : 1536;
  const int calls = argc > 3 ? std::atoi(argv[3]) : 500;
  if (K < 32 || K % 32 != 0 || N < 1 || calls < 1) {
    std::fprintf(stderr, "usage: width_bench [K N CALLS] (K a multiple of 32)\n");
    return 2;
  }
  const char* name = nullptr;
  const KernelTable* table = bench_table(&name);
  if (table == nullptr) return 1;
  std::mt19937 rng(1);
  std::vector<float> A(static_cast<size_t>(K)), Y(static_cast<size_t>(N));
  for (auto& a : A) a = std::uniform_real_distribution<float>(-1, 1)(rng);
  std::vector<int8_t> q(static_cast<size_t>(K));
  std::vector<float> qs(static_cast<size_t>(K / 32));
  std::vector<int32_t> qz(static_cast<size_t>(K / 32));
  table->quantize_a(A.data(), 1, K, K, 32, q.data(), qs.data(), qz.data());
  const QuantizedA qa{q.data(), qs.data(), qz.data()};
  // The 4-bit variant whose decode form the other widths follow (one strip or two at once).
  const char* variant_env = std::getenv("CIM_INT4_VARIANT");
  const KernelVariant* variant =
      variant_env != nullptr ? table->find_variant(variant_env) : &table->variants[table->defaults[kInt8]];
  if (variant == nullptr) {
    std::fprintf(stderr, "CIM_INT4_VARIANT=%s is not a variant of the %s table\n", variant_env, name);
    return 1;
  }
  std::printf("%s table, variant %s, %lld x %lld, %d calls a pass\n", name, variant->name,
              static_cast<long long>(K), static_cast<long long>(N), calls);
  for (int bits : {2, 3, 4, 5, 6, 8}) {
    std::vector<uint8_t> packed(static_cast<size_t>(N * K * bits / 8));
    for (auto& b : packed) b = static_cast<uint8_t>(rng());
    std::vector<uint16_t> scales(static_cast<size_t>(N * K / 32));
    for (auto& s : scales) s = static_cast<uint16_t>(0x2000 + (rng() & 0x3ff));
    PackedStorage st;
    const std::string problem =
        st.build(K, N, 32, bits, packed.data(), scales.data(), kScaleF16, nullptr, nullptr);
    if (!problem.empty()) {
      std::fprintf(stderr, "%s\n", problem.c_str());
      return 1;
    }
    const PackedWeights& w = st.weights();
    const MatMulArgs args{A.data(), 1, K, Y.data(), N, &w, &qa};
    const MatMulFn fn = table->matmul_for(bits, kInt8, *variant);
    double best = 1e9;
    for (int pass = 0; pass < 5; ++pass) {
      const auto t0 = std::chrono::steady_clock::now();
      for (int c = 0; c < calls; ++c) fn(args, 0, w.tiles);
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    std::printf("  %d-bit  %6.1f GB/s  %6.1f G weights/s  (%.1f us a call)\n", bits,
                static_cast<double>(st.bytes()) * calls / best / 1e9, static_cast<double>(K * N) * calls / best / 1e9,
                best / calls * 1e6);
  }
  return 0;
}

// Decode (M = 1, int8 mode) of one layer, every code width, kernel only: how fast each width's
// loop runs when memory is not what limits it (docs/widths.md, "Compute-bound speed by
// width"). A width whose loop runs slower per byte than the 4-bit one, hot, is compute-bound near
// the memory wall too: a cold stream then takes about the read's time plus the loop's. With
// LAYERS > 1 the calls cycle over that many copies of the layer (cold once they outgrow the
// last-level cache), and a plain read of the same streams (a byte of each 64-byte line,
// after the kernel's passes) is timed beside them: the kernel's share of the read's speed,
// near what `tools/measure_widths.py` reports through ORT against its own probe. Build
// against the library's kernel objects:
//
//   g++ -O2 -std=c++17 -mavx2 -DCIM_INT4_X86_KERNELS -Iops/cpp -I<build>/generated
//       ops/cpp/tools/width_bench.cpp <build>/CMakeFiles/cim_int4_kernels.dir/kernels/*.o -o width_bench
//       [-DCIM_PAD_BYTES=N: every kernel N bytes further on]
//   CIM_INT4_KERNEL=avx512_vnni [CIM_INT4_VARIANT=n4x2-pf2k] ./width_bench [K N CALLS [LAYERS [SCALES]]]
//       (default 576 1536 500 1 f16: 0.3-0.9 MB, hot; cold: 4096 4096 2 16; SCALES f32, f16 or i8)
//
// Per width (4: the table's int8 default variant, or CIM_INT4_VARIANT's; the other widths
// follow its form, KernelTable::matmul_for), the fastest of 5 passes of CALLS calls over the
// layers, group 32: GB/s of the stream and billions of weights a second.
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
#include "tools/bench_layers.h"
#include "tools/bench_table.h"

using namespace cim;

#ifdef CIM_PAD_BYTES
// -DCIM_PAD_BYTES=N: N bytes of code linked in front of the kernel objects (this object comes
// first on the command line), which moves every kernel and nothing else: by N bytes between
// two builds whose N differ by a multiple of 16 (the functions' alignment; against no pad at
// all, N plus the function's own few bytes, rounded up to 16). How the widths' cold decode
// was found to hang on where their code sits (docs/widths.md).
#define CIM_STR2(x) #x
#define CIM_STR(x) CIM_STR2(x)
__attribute__((used, noinline)) void cim_pad_bytes() { asm volatile(".skip " CIM_STR(CIM_PAD_BYTES) ", 0x90"); }
#endif

int main(int argc, char** argv) {
  const int64_t K = argc > 1 ? std::atoll(argv[1]) : 576;
  const int64_t N = argc > 2 ? std::atoll(argv[2]) : 1536;
  const int calls = argc > 3 ? std::atoi(argv[3]) : 500;
  const int layers = argc > 4 ? std::atoi(argv[4]) : 1;
  const std::string scale_name = argc > 5 ? argv[5] : "f16";
  const int scale_type = scale_name == "f32" ? kScaleF32 : scale_name == "i8" ? kScaleI8 : kScaleF16;
  if (K < 32 || K % 32 != 0 || N < 1 || calls < 1 || layers < 1 ||
      (scale_name != "f32" && scale_name != "f16" && scale_name != "i8")) {
    std::fprintf(stderr, "usage: width_bench [K N CALLS [LAYERS [f32|f16|i8]]] (K a multiple of 32)\n");
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
  std::printf("%s table, variant %s, %lld x %lld, %s scales, %d layer(s), %d calls a pass\n", name, variant->name,
              static_cast<long long>(K), static_cast<long long>(N), scale_name.c_str(), layers, calls);
  for (int bits : {2, 3, 4, 5, 6, 8}) {
    std::vector<PackedStorage> st(static_cast<size_t>(layers));
    for (auto& s : st) {
      const std::string problem = random_layer(s, K, N, bits, scale_type, rng);
      if (!problem.empty()) {
        std::fprintf(stderr, "%s\n", problem.c_str());
        return 1;
      }
    }
    std::vector<MatMulArgs> args;
    for (auto& s : st) args.push_back(MatMulArgs{A.data(), 1, K, Y.data(), N, &s.weights(), &qa});
    const MatMulFn fn = table->matmul_for(bits, kInt8, *variant);
    double best = 1e9;
    for (int pass = 0; pass < 5; ++pass) {
      const auto t0 = std::chrono::steady_clock::now();
      for (int c = 0; c < calls; ++c)
        for (const auto& a : args) fn(a, 0, a.W->tiles);
      best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    const double bytes = static_cast<double>(st[0].bytes()) * layers * calls;
    std::printf("  %d-bit  %6.1f GB/s  %6.1f G weights/s  (%.1f us a call)", bits, bytes / best / 1e9,
                static_cast<double>(K * N) * layers * calls / best / 1e9, best / calls / layers * 1e6);
    if (layers > 1) {
      // A plain read of the same streams in the same order.
      double read = 1e9;
      uint64_t sink = 0;
      for (int pass = 0; pass < 5; ++pass) {
        const auto t0 = std::chrono::steady_clock::now();
        for (int c = 0; c < calls; ++c)
          for (const auto& s : st) sink += touch_stream(s);
        read = std::min(read, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      }
      std::printf("  read %.1f GB/s, kernel %.2f of it%s", bytes / read / 1e9, read / best, sink == 1 ? " " : "");
    }
    std::printf("\n");
  }
  return 0;
}

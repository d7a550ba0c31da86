// Decode (M = 1, int8 mode) of the avx2 table over 16 separate 4096 x 4096 layers, as the
// benchmark chain lays them out, against one layer of the same bytes and a plain read of
// them; cold (256 MiB written before each timed pass), fastest of 15 rounds. It separates
// the kernel's stream from what ORT and the host add (docs/benchmarks.md, "Evening,
// prefill on the same Zen 3"). Build against the library's kernel objects:
//
//   g++ -O2 -std=c++17 -DCIM_INT4_X86_KERNELS -Iops/cpp ops/cpp/tools/chain_bench.cpp
//       <build>/CMakeFiles/cim_int4_kernels.dir/kernels/*.o -o chain_bench   (one command line)
//   ./chain_bench [VARIANT]     (default: the table's int8 default)
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <memory>
#include <random>
#include <vector>

#include "kernels/kernel.h"
#include "kernels/repack.h"
#include "tools/bench_layers.h"

using namespace cim;

namespace {

std::vector<char> evict_buffer(size_t(256) << 20);

void evict() {
  for (size_t i = 0; i < evict_buffer.size(); i += 64) evict_buffer[i] = static_cast<char>(evict_buffer[i] + 1);
}

double seconds_of(const std::chrono::steady_clock::time_point& t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  constexpr int kLayers = 16;
  constexpr int64_t K = 4096, N = 4096, gs = 32;
  const char* available = nullptr;
  const KernelTable* table = select_kernels("avx2", &available);
  if (table == nullptr) {
    std::fprintf(stderr, "this CPU does not run the avx2 table (available: %s)\n", available);
    return 1;
  }
  const KernelVariant* variant = argc > 1 ? table->find_variant(argv[1]) : &table->default_variant(kInt8);
  if (variant == nullptr) {
    std::fprintf(stderr, "no variant '%s' in the avx2 table\n", argv[1]);
    return 1;
  }
  std::mt19937 rng(1);
  std::vector<std::unique_ptr<PackedStorage>> layers;
  for (int l = 0; l < kLayers; ++l) {
    layers.emplace_back(new PackedStorage);
    if (!random_layer(*layers.back(), K, N, 4, kScaleF16, rng).empty()) return 1;
  }
  PackedStorage one;
  if (!random_layer(one, K, N * kLayers, 4, kScaleF16, rng).empty()) return 1;
  std::vector<float> A(K), Y(static_cast<size_t>(N * kLayers));
  for (auto& a : A) a = std::uniform_real_distribution<float>(-1, 1)(rng);
  std::vector<int8_t> q(K);
  std::vector<float> qs(K / gs);
  std::vector<int32_t> qz(K / gs);
  auto run = [&](const PackedStorage& st) {
    table->quantize_a(A.data(), 1, K, K, gs, q.data(), qs.data(), qz.data());
    QuantizedA qa{q.data(), qs.data(), qz.data()};
    MatMulArgs args{A.data(), 1, K, Y.data(), st.weights().N, &st.weights(), &qa};
    variant->matmul[kInt8](args, 0, st.weights().tiles);
  };
  double chain = 1e9, single = 1e9, read = 1e9;
  uint64_t sink = 0;
  for (int r = 0; r < 15; ++r) {
    evict();
    auto t0 = std::chrono::steady_clock::now();
    for (const auto& st : layers) run(*st);
    chain = std::min(chain, seconds_of(t0));
    evict();
    t0 = std::chrono::steady_clock::now();
    run(one);
    single = std::min(single, seconds_of(t0));
    evict();
    t0 = std::chrono::steady_clock::now();
    sink += touch_stream(one);
    read = std::min(read, seconds_of(t0));
  }
  const double bytes = double(layers[0]->bytes()) * kLayers;
  std::printf("%s: %d layers %.2f ms (%.1f GB/s); one layer of the same bytes %.2f ms (%.1f GB/s); read %.1f GB/s%s\n",
              variant->name, kLayers, chain * 1e3, bytes / chain / 1e9, single * 1e3, one.bytes() / single / 1e9,
              one.bytes() / read / 1e9, sink == 1 ? " " : "");
  return 0;
}

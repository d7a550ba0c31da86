// Decode (M = 1, int8 mode, group 32, float16 scales; int8 ones, the export's default, with
// LAYERS_SCALES=int8; fp32 mode with LAYERS_MODE=fp32) of a real decoder's weight layers, kernel only:
// every variant of the avx2 table (or of the one CIM_INT4_KERNEL names) against a plain read of
// the same buffers in the same order, on 1 or 2 threads, cold (256 MiB written before each pass),
// fastest of 9 passes. It tells whether a decode step's MatMuls stream at the memory wall on this
// CPU, apart from what ORT adds per node (docs/real-llm.md, "Where a 2-thread step goes"). Two
// threads split each layer as the op does (halves of its 4-tile strips; the read by halves of
// each layer), the second thread spinning between layers. Build against the library's kernel
// objects:
//
//   g++ -O2 -std=c++17 -mavx2 -pthread -DCIM_INT4_X86_KERNELS -Iops/cpp -I<build>/generated
//       ops/cpp/tools/layers_bench.cpp <build>/CMakeFiles/cim_int4_kernels.dir/kernels/*.o -o layers_bench
//   ./layers_bench THREADS REPEAT "KxN ..." ["KxN ..."]
//
// The first list of layers runs REPEAT times, then the second once. SmolLM2-135M with gated MLPs
// fused (gate and up as two 576x1536 streams) and its LM head:
//   ./layers_bench 2 30 "576x960 576x576 576x1536 576x1536 1536x576" "576x49152"
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cinttypes>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <memory>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "kernels/kernel.h"
#include "kernels/repack.h"
#include "tools/bench_layers.h"
#include "tools/bench_table.h"

using namespace cim;

namespace {

std::vector<char> evict_buffer(size_t(256) << 20);

void evict() {
  for (size_t i = 0; i < evict_buffer.size(); i += 64) evict_buffer[i] = static_cast<char>(evict_buffer[i] + 1);
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

struct Shape {
  int64_t K, N;
};

// "KxN KxN ...": at least one layer, K a multiple of 32, nothing else in a word.
bool parse(const char* text, std::vector<Shape>& out) {
  std::istringstream in(text);
  std::string word;
  const size_t before = out.size();
  while (in >> word) {
    Shape s{};
    int used = 0;
    if (std::sscanf(word.c_str(), "%" SCNd64 "x%" SCNd64 "%n", &s.K, &s.N, &used) != 2 ||
        used != static_cast<int>(word.size()) || s.K < 32 || s.N < 1 || s.K % 32) {
      return false;
    }
    out.push_back(s);
  }
  return out.size() > before;
}

// A whole-word positive int, else 0.
int positive(const char* text) {
  char* end = nullptr;
  const long v = std::strtol(text, &end, 10);
  return end != text && *end == '\0' && v > 0 && v < 1000000 ? static_cast<int>(v) : 0;
}

// The second thread, spinning (with pause, as ORT's pool does) until `go` moves: it runs `job`
// and bumps `done`. The main thread sets `job` before moving `go` and waits for `done`.
struct Helper {
  std::function<void()> job;
  std::atomic<int> go{0}, done{0};
  std::atomic<bool> stop{false};
  void loop() {
    for (int seen = 0; !stop.load(std::memory_order_relaxed);) {
      if (go.load(std::memory_order_acquire) == seen) {
        _mm_pause();
        continue;
      }
      ++seen;
      job();
      done.fetch_add(1, std::memory_order_release);
    }
  }
  // Runs `mine` here and `theirs` on the second thread, and returns when both are done.
  void both(const std::function<void()>& mine, std::function<void()> theirs) {
    job = std::move(theirs);
    const int target = done.load(std::memory_order_relaxed) + 1;
    go.fetch_add(1, std::memory_order_release);
    mine();
    while (done.load(std::memory_order_acquire) != target) _mm_pause();
  }
};

// Sum of part `part` of `parts` of one layer's stream (no bias here: bytes() is the stream), 32
// bytes at a time: the read the kernels are held against.
// With `streams` = 2, the part's two halves side by side (two sequential streams, as the n4x2
// variants read two strips): on an Intel Xeon (family 6 model 167) one stream a core is not the
// core's read bandwidth (docs/benchmarks.md, "Intel Xeon, 2026-12-06").
uint64_t read_part(const PackedStorage& st, int part, int parts, int streams = 1) {
  __m256i acc = _mm256_setzero_si256();
  const auto* p = reinterpret_cast<const __m256i*>(st.weights().stream);
  const int64_t n = st.bytes() / 32;
  const int64_t begin = n * part / parts, end = n * (part + 1) / parts;
  if (streams == 1) {
    for (int64_t i = begin; i < end; ++i) acc = _mm256_add_epi8(acc, _mm256_load_si256(p + i));
  } else {
    const int64_t half = (end - begin) / 2;
    for (int64_t i = begin; i < begin + half; ++i) {
      acc = _mm256_add_epi8(acc, _mm256_add_epi8(_mm256_load_si256(p + i), _mm256_load_si256(p + i + half)));
    }
    for (int64_t i = begin + 2 * half; i < end; ++i) acc = _mm256_add_epi8(acc, _mm256_load_si256(p + i));
  }
  return static_cast<uint64_t>(_mm256_extract_epi64(acc, 0));
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<Shape> block, tail;
  const int threads = argc > 1 ? positive(argv[1]) : 0;
  const int repeat = argc > 2 ? positive(argv[2]) : 0;
  if (argc < 4 || (threads != 1 && threads != 2) || repeat < 1 || !parse(argv[3], block) ||
      (argc > 4 && !parse(argv[4], tail))) {
    std::fprintf(stderr, "usage: layers_bench THREADS(1|2) REPEAT \"KxN ...\" [\"KxN ...\"] (K a multiple of 32)\n");
    return 2;
  }
  const KernelTable* table = bench_table();
  if (table == nullptr) return 1;
  const char* scales_env = std::getenv("LAYERS_SCALES");
  const std::string scales_name = scales_env != nullptr ? scales_env : "float16";
  if (scales_name != "float16" && scales_name != "int8") {
    std::fprintf(stderr, "LAYERS_SCALES is '%s', expected float16 or int8\n", scales_name.c_str());
    return 2;
  }
  const bool int8_scales = scales_name == "int8";
  const char* mode_env = std::getenv("LAYERS_MODE");
  const std::string mode_name = mode_env != nullptr ? mode_env : "int8";
  if (mode_name != "int8" && mode_name != "fp32") {
    std::fprintf(stderr, "LAYERS_MODE is '%s', expected int8 or fp32\n", mode_name.c_str());
    return 2;
  }
  const Mode mode = mode_name == "int8" ? kInt8 : kFp32;
  std::vector<Shape> shapes;
  for (int r = 0; r < repeat; ++r) shapes.insert(shapes.end(), block.begin(), block.end());
  shapes.insert(shapes.end(), tail.begin(), tail.end());
  std::mt19937 rng(1);
  std::vector<std::unique_ptr<PackedStorage>> layers;
  double bytes = 0;
  int64_t max_k = 0, max_n = 0;
  for (const Shape& s : shapes) {
    layers.emplace_back(new PackedStorage);
    const std::string problem = random_layer(*layers.back(), s.K, s.N, 4, int8_scales ? kScaleI8 : kScaleF16, rng);
    if (!problem.empty()) {
      std::fprintf(stderr, "%s\n", problem.c_str());
      return 1;
    }
    bytes += static_cast<double>(layers.back()->bytes());
    max_k = std::max(max_k, s.K);
    max_n = std::max(max_n, s.N);
  }
  std::vector<float> A(static_cast<size_t>(max_k)), Y(static_cast<size_t>(max_n));
  for (auto& a : A) a = std::uniform_real_distribution<float>(-1, 1)(rng);
  std::vector<int8_t> q(static_cast<size_t>(max_k));
  std::vector<float> qs(static_cast<size_t>(max_k / 32));
  std::vector<int32_t> qz(static_cast<size_t>(max_k / 32));

  Helper helper;
  std::thread second;
  if (threads == 2) second = std::thread([&] { helper.loop(); });
  // The read goes layer by layer with the same handshake as the kernels below, one stream a
  // thread (the kernels' "% of the read") and two.
  uint64_t sink = 0, other = 0;
  double reads[2] = {1e9, 1e9};
  for (int r = 0; r < 9; ++r) {
    for (int streams = 1; streams <= 2; ++streams) {
      evict();
      const auto t0 = std::chrono::steady_clock::now();
      for (const auto& st : layers) {
        if (threads == 1) {
          sink += read_part(*st, 0, 1, streams);
          continue;
        }
        helper.both([&] { sink += read_part(*st, 0, 2, streams); }, [&] { other += read_part(*st, 1, 2, streams); });
      }
      reads[streams - 1] = std::min(reads[streams - 1], seconds_since(t0));
    }
  }
  sink += other;
  const double read = reads[0];
  std::printf("%zu layers, %.1f MB (%s scales, %s mode), %d thread(s); read %.2f ms (%.1f GB/s), two streams a thread %.2f ms\n",
              layers.size(), bytes / 1e6, scales_name.c_str(), mode_name.c_str(), threads, read * 1e3, bytes / read / 1e9, reads[1] * 1e3);

  for (int v = 0; v < table->variant_count; ++v) {
    const KernelVariant& variant = table->variants[v];
    double best = 1e9;
    for (int r = 0; r < 9; ++r) {
      evict();
      const auto t0 = std::chrono::steady_clock::now();
      for (const auto& st : layers) {
        const PackedWeights& w = st->weights();
        if (mode == kInt8) table->quantize_a(A.data(), 1, w.K, w.K, 32, q.data(), qs.data(), qz.data());
        QuantizedA qa{q.data(), qs.data(), qz.data()};
        MatMulArgs args{A.data(), 1, w.K, Y.data(), w.N, &w, &qa};
        if (threads == 1) {
          variant.matmul[mode](args, 0, w.tiles);
          continue;
        }
        const int64_t half = std::min(w.tiles, range_span(w.tiles, 2));  // the op's split (kernel.h)
        const MatMulFn fn = variant.matmul[mode];
        helper.both([&] { fn(args, 0, half); }, [&] { fn(args, half, w.tiles); });
      }
      best = std::min(best, seconds_since(t0));
    }
    std::printf("  %-16s %.2f ms (%.1f GB/s, %.0f%% of the read)%s\n", variant.name, best * 1e3, bytes / best / 1e9,
                100 * read / best, v == table->defaults[mode] ? "  <- default" : "");
  }
  helper.stop = true;
  if (second.joinable()) second.join();
  return sink == 1 ? 3 : 0;
}

// Read-bandwidth probe and cache evictor for the benchmarks (cim_int4.bench, via ctypes).
//
// One pass reads a buffer once with N std::threads, each pinned to a given CPU as our
// sessions pin ORT's intra-op threads, and reports bytes per second. The same pass over a
// buffer larger than the last-level cache evicts the weights of the case under test.
//
// The loads are summed into a checksum the caller receives, so the compiler cannot drop
// them. AVX-512 and AVX2 bodies are compiled with function target attributes and chosen
// once by CPUID, so the library builds with the default -m flags and runs on any x86-64.
#include <immintrin.h>
#include <pthread.h>
#include <sched.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

namespace {

using Clock = std::chrono::steady_clock;

// Each reader sums 64-bit lanes of [p, p + bytes); bytes is a multiple of 256.
using ReadFn = uint64_t (*)(const uint8_t* p, size_t bytes);

__attribute__((target("avx512f"))) uint64_t read_avx512(const uint8_t* p, size_t bytes) {
  // Four accumulators keep four independent loads in flight per iteration.
  __m512i a0 = _mm512_setzero_si512(), a1 = a0, a2 = a0, a3 = a0;
  for (size_t i = 0; i < bytes; i += 256) {
    a0 = _mm512_add_epi64(a0, _mm512_loadu_si512(p + i));
    a1 = _mm512_add_epi64(a1, _mm512_loadu_si512(p + i + 64));
    a2 = _mm512_add_epi64(a2, _mm512_loadu_si512(p + i + 128));
    a3 = _mm512_add_epi64(a3, _mm512_loadu_si512(p + i + 192));
  }
  // A plain store, not _mm512_reduce_add_epi64: GCC 12 warns inside that intrinsic.
  alignas(64) uint64_t lanes[8];
  _mm512_store_si512(lanes, _mm512_add_epi64(_mm512_add_epi64(a0, a1), _mm512_add_epi64(a2, a3)));
  uint64_t sum = 0;
  for (uint64_t lane : lanes) sum += lane;
  return sum;
}

__attribute__((target("avx2"))) uint64_t read_avx2(const uint8_t* p, size_t bytes) {
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  for (size_t i = 0; i < bytes; i += 128) {
    a0 = _mm256_add_epi64(a0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i)));
    a1 = _mm256_add_epi64(a1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 32)));
    a2 = _mm256_add_epi64(a2, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 64)));
    a3 = _mm256_add_epi64(a3, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + 96)));
  }
  alignas(32) uint64_t lanes[4];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes),
                     _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3)));
  return lanes[0] + lanes[1] + lanes[2] + lanes[3];
}

uint64_t read_portable(const uint8_t* p, size_t bytes) {
  uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0;
  for (size_t i = 0; i < bytes; i += 32) {
    uint64_t w[4];
    std::memcpy(w, p + i, sizeof w);
    a0 += w[0];
    a1 += w[1];
    a2 += w[2];
    a3 += w[3];
  }
  return a0 + a1 + a2 + a3;
}

struct Isa {
  const char* name;
  ReadFn read;
};

const Isa& best_isa() {
  static const Isa isa = [] {
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f")) return Isa{"avx512", read_avx512};
    if (__builtin_cpu_supports("avx2")) return Isa{"avx2", read_avx2};
    return Isa{"portable", read_portable};
  }();
  return isa;
}

// Chunks handed to threads are whole multiples of this many bytes (a page), so no two
// threads share a cache line and every SIMD body sees a multiple of 256 bytes.
constexpr size_t kChunkAlign = 4096;

}  // namespace

extern "C" {

// Name of the instruction set the probe reads with: "avx512", "avx2" or "portable".
__attribute__((visibility("default"))) const char* cim_bwprobe_isa() { return best_isa().name; }

// Reads [data, data + bytes) once with `threads` threads, thread i pinned to cpus[i]
// (cpus may be null: threads are not pinned). Returns bytes per second from the moment
// all threads are pinned and released to the moment the last one finishes, or -1 for
// bad arguments or a failed pin. *checksum (if not null) gets the sum of the words read.
__attribute__((visibility("default"))) double cim_bwprobe_read(const void* data, size_t bytes, int threads,
                                                               const int* cpus, uint64_t* checksum) {
  if (data == nullptr || threads < 1 || bytes < kChunkAlign * static_cast<size_t>(threads)) return -1.0;
  const auto* base = static_cast<const uint8_t*>(data);
  const ReadFn read = best_isa().read;
  // Bytes past the last whole page are read by thread 0 alone, byte by byte.
  const size_t pages = bytes / kChunkAlign;
  const size_t tail_begin = pages * kChunkAlign;

  std::atomic<int> ready{0};
  std::atomic<int> failed{0};
  std::atomic<bool> go{false};
  std::vector<uint64_t> sums(static_cast<size_t>(threads), 0);
  std::vector<Clock::time_point> ends(static_cast<size_t>(threads));
  std::vector<std::thread> pool;
  pool.reserve(static_cast<size_t>(threads));
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      if (cpus != nullptr) {
        cpu_set_t set;
        CPU_ZERO(&set);
        CPU_SET(cpus[t], &set);
        if (pthread_setaffinity_np(pthread_self(), sizeof set, &set) != 0) failed.store(1);
      }
      const size_t first = pages * static_cast<size_t>(t) / static_cast<size_t>(threads);
      const size_t last = pages * static_cast<size_t>(t + 1) / static_cast<size_t>(threads);
      ready.fetch_add(1);
      // Yield while waiting: a reader may share its CPU with the thread that releases it.
      while (!go.load(std::memory_order_acquire)) std::this_thread::yield();
      uint64_t sum = read(base + first * kChunkAlign, (last - first) * kChunkAlign);
      if (t == 0) {
        for (size_t i = tail_begin; i < bytes; ++i) sum += base[i];
      }
      sums[static_cast<size_t>(t)] = sum;
      ends[static_cast<size_t>(t)] = Clock::now();
    });
  }
  while (ready.load() < threads) std::this_thread::yield();
  const Clock::time_point start = Clock::now();
  go.store(true, std::memory_order_release);
  for (std::thread& th : pool) th.join();

  Clock::time_point end = start;
  uint64_t total = 0;
  for (int t = 0; t < threads; ++t) {
    if (ends[static_cast<size_t>(t)] > end) end = ends[static_cast<size_t>(t)];
    total += sums[static_cast<size_t>(t)];
  }
  if (checksum != nullptr) *checksum = total;
  if (failed.load() != 0) return -1.0;
  const double seconds = std::chrono::duration<double>(end - start).count();
  return seconds > 0.0 ? static_cast<double>(bytes) / seconds : -1.0;
}

}  // extern "C"

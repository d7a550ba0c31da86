#include "tune/tuner.h"

#include <unistd.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <random>

#include "kernels/repack.h"

namespace cim {
namespace {

using Clock = std::chrono::steady_clock;

volatile uint64_t g_sink;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// The last-level cache this CPU sees. sysfs first: in a VM, glibc's sysconf may report the
// host's total L3 (384 MiB on one Zen 5 guest whose sysfs and lscpu say 32 MiB).
int64_t llc_bytes() {
  std::ifstream f("/sys/devices/system/cpu/cpu0/cache/index3/size");  // e.g. "32768K"
  int64_t n = 0;
  char unit = 0;
  if (f >> n) {
    f >> unit;
    return unit == 'K' ? n << 10 : unit == 'M' ? n << 20 : n;
  }
#if defined(_SC_LEVEL3_CACHE_SIZE)
  if (const long l3 = sysconf(_SC_LEVEL3_CACHE_SIZE); l3 > 0) return l3;
#endif
  return 0;
}

// A streaming read of the bytes (SSE2, in every x86-64 baseline: 16-byte loads keep up with
// DRAM on one core), summed so the loads stay. It prefetches 8 KiB ahead as the kernels do:
// on one Zen 5 core a plain read reached less than half the speed of a prefetched one.
uint64_t read_stream(const uint8_t* p, int64_t bytes) {
#if defined(__SSE2__)
  __m128i acc[8];
  for (__m128i& a : acc) a = _mm_setzero_si128();
  int64_t i = 0;
  for (; i + 128 <= bytes; i += 128) {
    _mm_prefetch(reinterpret_cast<const char*>(p + i + 8192), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(p + i + 8192 + 64), _MM_HINT_T0);
    for (int j = 0; j < 8; ++j) {
      acc[j] = _mm_add_epi64(acc[j], _mm_load_si128(reinterpret_cast<const __m128i*>(p + i + 16 * j)));
    }
  }
  for (int j = 1; j < 8; ++j) acc[0] = _mm_add_epi64(acc[0], acc[j]);
  alignas(16) uint64_t lanes[2];
  _mm_store_si128(reinterpret_cast<__m128i*>(lanes), acc[0]);
  return lanes[0] + lanes[1];
#else
  uint64_t sum = 0;
  for (int64_t i = 0; i + 8 <= bytes; i += 8) {
    uint64_t v;
    std::memcpy(&v, p + i, sizeof v);
    sum += v;
  }
  return sum;
#endif
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};

// A decode-shaped problem: K = 4096 in groups of 32 (the common LLM layout), as many
// channels as fill `bytes`, random codes, small scales, random A.
struct Synthetic {
  std::unique_ptr<uint8_t, FreeDeleter> stream;
  std::vector<float> a, y, qscale;
  std::vector<int8_t> q;
  std::vector<int32_t> qsum;
  PackedWeights w;
  QuantizedA qa;

  Synthetic(const KernelTable& table, int64_t bytes) {
    w.K = 4096;
    w.group_size = 32;
    w.groups = w.K / w.group_size;
    w.block_bytes = block_bytes_of(4, w.group_size, false);
    w.tiles = std::max<int64_t>(kStripTiles, bytes / (w.groups * w.block_bytes) / kStripTiles * kStripTiles);
    w.N = w.tiles * kTileN;
    const int64_t total = w.tiles * w.groups * w.block_bytes;
    stream.reset(static_cast<uint8_t*>(allocate_stream(total)));
    uint64_t x = 0x9E3779B97F4A7C15ull;
    const int64_t code_bytes = w.group_size / 8 * kCodeRowBytes;
    for (int64_t off = 0; off < total; off += w.block_bytes) {
      for (int64_t i = 0; i < code_bytes; i += 8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        std::memcpy(stream.get() + off + i, &x, 8);
      }
      float scales[kTileN];
      std::fill(scales, scales + kTileN, 0.01f);
      std::memcpy(stream.get() + off + code_bytes, scales, sizeof scales);
    }
    w.stream = stream.get();
    a.resize(static_cast<size_t>(w.K));
    for (int64_t k = 0; k < w.K; ++k) a[k] = static_cast<float>((k * 7919) % 2001 - 1000) / 1000.0f;
    y.resize(static_cast<size_t>(w.N));
    q.resize(static_cast<size_t>(w.K));
    qscale.resize(static_cast<size_t>(w.groups));
    qsum.resize(static_cast<size_t>(w.groups));
    table.quantize_a(a.data(), 1, w.K, w.K, w.group_size, q.data(), qscale.data(), qsum.data());
    qa = QuantizedA{q.data(), qscale.data(), qsum.data()};
  }

  double time(MatMulFn fn) {
    MatMulArgs args;
    args.A = a.data();
    args.M = 1;
    args.lda = w.K;
    args.Y = y.data();
    args.ldy = w.N;
    args.W = &w;
    args.QA = &qa;
    const auto t0 = Clock::now();
    fn(args, 0, w.tiles);
    return seconds_since(t0);
  }
};

}  // namespace

TuneReport tune(const KernelTable& table, const TuneOptions& options) {
  TuneReport r;
  r.table = table.name;
  r.llc_bytes = llc_bytes();
  for (int i = 0; i < table.variant_count; ++i) r.rows.push_back({table.variants[i].name, {0, 0}});
  r.chosen[kFp32] = table.defaults[kFp32];
  r.chosen[kInt8] = table.defaults[kInt8];
  if (table.variant_count < 2) return r;

  const auto setup0 = Clock::now();
  int64_t bytes = options.stream_bytes;
  if (bytes <= 0) bytes = std::clamp<int64_t>(2 * r.llc_bytes, int64_t(16) << 20, int64_t(256) << 20);
  Synthetic s(table, bytes);
  r.stream_bytes = s.w.tiles * s.w.groups * s.w.block_bytes;
  r.setup_seconds = seconds_since(setup0);

  const int n = table.variant_count;
  std::vector<double> read;
  std::vector<std::vector<double>> times(static_cast<size_t>(2 * n));
  uint64_t checksum = 0;
  const auto t0 = Clock::now();
  double round_seconds = 0;
  std::vector<int> order(static_cast<size_t>(2 * n));
  for (int j = 0; j < 2 * n; ++j) order[static_cast<size_t>(j)] = j;
  std::mt19937 rng(12345);
  while (r.rounds == 0 || seconds_since(t0) + round_seconds <= options.budget_seconds) {
    const auto round0 = Clock::now();
    const auto r0 = Clock::now();
    checksum += read_stream(s.w.stream, r.stream_bytes);
    read.push_back(seconds_since(r0));
    // A new order each round: a pass may find some of the stream its predecessor left in
    // the last-level cache, so no variant may always follow the same one.
    std::shuffle(order.begin(), order.end(), rng);
    for (int j : order) {
      const int v = j / 2, mode = j % 2;
      const double t = s.time(table.variants[v].matmul[mode]);
      times[static_cast<size_t>(j)].push_back(t);
    }
    round_seconds = seconds_since(round0);
    r.longest_round_seconds = std::max(r.longest_round_seconds, round_seconds);
    ++r.rounds;
  }
  r.elapsed_seconds = seconds_since(t0);
  g_sink = checksum;  // the read's loads must stay
  r.read_seconds = median(read);
  for (int v = 0; v < n; ++v) {
    for (int mode = 0; mode < 2; ++mode) r.rows[v].seconds[mode] = median(times[static_cast<size_t>(2 * v + mode)]);
  }
  // Per variant, the median over rounds of its time over the default's in the same round:
  // paired, so a load that comes and goes between rounds cancels out.
  for (int mode = 0; mode < 2; ++mode) {
    const auto& def = times[static_cast<size_t>(2 * table.defaults[mode] + mode)];
    int best = table.defaults[mode];
    double best_ratio = 1.0;
    for (int v = 0; v < n; ++v) {
      const auto& t = times[static_cast<size_t>(2 * v + mode)];
      std::vector<double> ratios;
      int wins = 0;  // rounds in which it beat the default by more than the margin
      for (size_t i = 0; i < t.size(); ++i) {
        ratios.push_back(t[i] / def[i]);
        wins += ratios.back() < 1.0 - kTuneMargin;
      }
      r.rows[v].vs_default[mode] = median(ratios);
      const bool steady = 4 * wins >= 3 * r.rounds;
      if (steady && r.rows[v].vs_default[mode] < best_ratio) {
        best_ratio = r.rows[v].vs_default[mode];
        best = v;
      }
    }
    r.chosen[mode] = r.rounds >= kTuneMinRounds && best_ratio < 1.0 - kTuneMargin ? best : table.defaults[mode];
  }
  return r;
}

}  // namespace cim

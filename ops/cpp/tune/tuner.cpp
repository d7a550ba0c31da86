#include "tune/tuner.h"

#include <unistd.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include <algorithm>
#include <chrono>
#include <cmath>
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
// DRAM on one core), summed so the loads stay, software-prefetching kAhead bytes ahead (0:
// none). Cores disagree on which reads faster: on one Zen 5 core a plain read reached less
// than half the speed of one prefetching 8 KiB ahead, on a Zen 4 core the prefetching read
// was the slower; the tuner times both and takes the faster as "the" read.
template <int64_t kAhead>
uint64_t read_stream(const uint8_t* p, int64_t bytes) {
#if defined(__SSE2__)
  __m128i acc[8];
  for (__m128i& a : acc) a = _mm_setzero_si128();
  int64_t i = 0;
  for (; i + 128 <= bytes; i += 128) {
    if constexpr (kAhead > 0) {
      _mm_prefetch(reinterpret_cast<const char*>(p + i + kAhead), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(p + i + kAhead + 64), _MM_HINT_T0);
    }
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
// channels as fill `bytes`, random codes, small scales, random A. A stream larger than
// kTuneWindowBytes is cut into `windows` equal windows of whole strips; each pass (a read
// or a kernel) takes the next one in rotation (tuner.h says why).
struct Synthetic {
  std::unique_ptr<uint8_t, FreeDeleter> stream;
  std::vector<float> a, y, qscale;
  std::vector<int8_t> q;
  std::vector<int32_t> qsum;
  PackedWeights w;
  QuantizedA qa;
  int64_t windows = 1;
  int64_t window_tiles = 0;
  int64_t passes = 0;  // passes so far: the next one reads window passes % windows

  Synthetic(const KernelTable& table, int64_t bytes) {
    w.K = 4096;
    w.group_size = 32;
    w.groups = w.K / w.group_size;
    // The exporter's default scales: int8, with a float16 super-scale record per run of
    // kSuperGroups groups (float32 scales, timed before, move 1.2x the scale bytes and
    // ranked the fp32 variants unlike the chain of default exports on a Zen 4).
    w.scale_type = kScaleI8;
    w.super_bytes = kTileN * 2;
    w.block_bytes = block_bytes_of(4, w.group_size, kScaleI8);
    const int64_t tile_bytes = w.strip_bytes_per_tile();
    w.tiles = std::max<int64_t>(kStripTiles, bytes / tile_bytes / kStripTiles * kStripTiles);
    windows = (w.tiles * tile_bytes + kTuneWindowBytes - 1) / kTuneWindowBytes;
    w.tiles = std::max<int64_t>(1, w.tiles / (windows * kStripTiles)) * windows * kStripTiles;
    window_tiles = w.tiles / windows;
    w.N = w.tiles * kTileN;
    const int64_t total = w.tiles * tile_bytes;
    stream.reset(static_cast<uint8_t*>(allocate_stream(total)));
    w.stream = stream.get();
    fill(total);
    a.resize(static_cast<size_t>(w.K));
    for (int64_t k = 0; k < w.K; ++k) a[k] = static_cast<float>((k * 7919) % 2001 - 1000) / 1000.0f;
    y.resize(static_cast<size_t>(w.N));
    q.resize(static_cast<size_t>(w.K));
    qscale.resize(static_cast<size_t>(w.groups));
    qsum.resize(static_cast<size_t>(w.groups));
    table.quantize_a(a.data(), 1, w.K, w.K, w.group_size, q.data(), qscale.data(), qsum.data());
    qa = QuantizedA{q.data(), qscale.data(), qsum.data()};
  }

  // Random codes, then int8 scales of 80 and super-scales of 2^-7 over them (a scale of
  // 0.005; w.scales, w.super_of). Four independent xorshift64
  // generators side by side: one alone is a chain of six dependent operations per 8 bytes,
  // and filling the largest stream (256 MiB) with it took 70 ms on a Zen 4, longer than its
  // page faults.
  void fill(int64_t total) {
    uint64_t x[4] = {0x9E3779B97F4A7C15ull, 0xBF58476D1CE4E5B9ull, 0x94D049BB133111EBull, 0x2545F4914F6CDD1Dull};
    for (int64_t i = 0; i + 32 <= total; i += 32) {  // total: a multiple of 32 (code rows, scales, records)
      for (int lane = 0; lane < 4; ++lane) {
        x[lane] ^= x[lane] << 13;
        x[lane] ^= x[lane] >> 7;
        x[lane] ^= x[lane] << 17;
        std::memcpy(stream.get() + i + 8 * lane, &x[lane], 8);
      }
    }
    uint16_t supers[kTileN];
    std::fill(supers, supers + kTileN, uint16_t(0x2000));  // float16 2^-7
    for (int64_t t = 0; t < w.tiles; ++t) {
      for (int64_t g = 0; g < w.groups; ++g) {
        std::memset(const_cast<uint8_t*>(w.scales(t, g)), 80, kTileN);
        if (g % kSuperGroups == 0) std::memcpy(const_cast<uint8_t*>(w.super_of(t, g)), supers, sizeof supers);
      }
    }
  }

  // The tile range of the next pass's window.
  void next_window(int64_t& t0, int64_t& t1) {
    t0 = passes++ % windows * window_tiles;
    t1 = t0 + window_tiles;
  }

  // Seconds of a streaming read (with software prefetch or without) of the next window,
  // times `windows`: the read of the whole stream at that speed.
  double read(bool prefetch, uint64_t& checksum) {
    int64_t t0, t1;
    next_window(t0, t1);
    const uint8_t* p = w.stream + t0 * w.strip_bytes_per_tile();
    const int64_t bytes = (t1 - t0) * w.strip_bytes_per_tile();
    const auto start = Clock::now();
    checksum += prefetch ? read_stream<8192>(p, bytes) : read_stream<0>(p, bytes);
    return seconds_since(start) * static_cast<double>(windows);
  }

  // Seconds of one decode (M = 1) of the next window by `fn`, times `windows`.
  double time(MatMulFn fn) {
    MatMulArgs args;
    args.A = a.data();
    args.M = 1;
    args.lda = w.K;
    args.Y = y.data();
    args.ldy = w.N;
    args.W = &w;
    args.QA = &qa;
    int64_t t0, t1;
    next_window(t0, t1);
    const auto start = Clock::now();
    fn(args, t0, t1);
    return seconds_since(start) * static_cast<double>(windows);
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
  r.stream_bytes = s.w.tiles * s.w.strip_bytes_per_tile();
  r.windows = static_cast<int>(s.windows);
  r.window_bytes = s.window_tiles * s.w.strip_bytes_per_tile();
  r.setup_seconds = seconds_since(setup0);

  const int n = table.variant_count;
  // Candidate j = 2 * variant + mode. A mode's entry that is the same function as an earlier
  // variant's (the n4 rows in fp32 mode are the t4 ones) is not timed again: it reports
  // that variant's times (`alias`).
  std::vector<int> alias(static_cast<size_t>(2 * n));
  for (int j = 0; j < 2 * n; ++j) {
    alias[static_cast<size_t>(j)] = j;
    for (int u = j % 2; u < j; u += 2) {
      if (table.variants[u / 2].matmul[j % 2] == table.variants[j / 2].matmul[j % 2]) {
        alias[static_cast<size_t>(j)] = u;
        break;
      }
    }
  }
  std::vector<char> live(static_cast<size_t>(2 * n));
  for (int j = 0; j < 2 * n; ++j) live[static_cast<size_t>(j)] = alias[static_cast<size_t>(j)] == j;
  std::vector<double> read;
  std::vector<std::vector<double>> times(static_cast<size_t>(2 * n));
  // The time of candidate j over its mode's default in each round j ran.
  auto ratios_of = [&](int j) {
    const auto& t = times[static_cast<size_t>(j)];
    const auto& def = times[static_cast<size_t>(2 * table.defaults[j % 2] + j % 2)];
    std::vector<double> out;
    for (size_t i = 0; i < t.size(); ++i) out.push_back(t[i] / def[i]);
    return out;
  };
  uint64_t checksum = 0;
  // A budget that is not a positive finite number runs the minimum rounds (the comparisons
  // below are written so that a NaN stops too).
  const double budget =
      std::isfinite(options.budget_seconds) && options.budget_seconds > 0 ? options.budget_seconds : 0.0;
  const auto t0 = Clock::now();
  double round_seconds = 0;
  std::mt19937 rng(12345);
  // Per mode: the variant that wins (the default unless one beats it), and whether the rounds
  // so far leave it open (`undecided`).
  auto decide = [&](int mode, bool& undecided) {
    int best = table.defaults[mode];
    double best_ratio = 1.0 - kTuneMargin;  // to beat: the default by the margin
    double best_unsteady = 1.0;             // the lowest median not yet won steadily
    for (int v = 0; v < n; ++v) {
      const int j = alias[static_cast<size_t>(2 * v + mode)];
      const std::vector<double> ratios = ratios_of(j);
      if (static_cast<int>(ratios.size()) < r.rounds) continue;  // dropped on the way
      int wins = 0;
      for (double x : ratios) wins += x < 1.0 - kTuneMargin;
      const double med = median(ratios);
      if (4 * wins < 3 * r.rounds) {
        best_unsteady = std::min(best_unsteady, med);
      } else if (med < best_ratio) {
        best_ratio = med;
        best = v;
      }
    }
    // Open while a candidate not yet steady leads the one that would be chosen (the
    // default, at 1, or the steady winner) by more than the margin.
    const double chosen_ratio = best == table.defaults[mode] ? 1.0 : best_ratio;
    undecided = best_unsteady < chosen_ratio * (1.0 - kTuneMargin);
    return r.rounds >= kTuneMinRounds ? best : table.defaults[mode];
  };
  auto undecided = [&] {
    bool open[2];
    decide(kFp32, open[kFp32]);
    decide(kInt8, open[kInt8]);
    return open[kFp32] || open[kInt8];
  };
  while (true) {
    const double next_end = seconds_since(t0) + round_seconds;  // if the next round is like the last
    if (r.rounds >= kTuneMinRounds && !(next_end <= budget)) {
      if (!(next_end <= kTuneExtendFactor * budget) || !undecided()) break;
      r.extended = true;
    }
    const auto round0 = Clock::now();
    // Two statements: the reads take windows in turn, so their order must be fixed.
    const double prefetched = s.read(true, checksum);
    read.push_back(std::min(prefetched, s.read(false, checksum)));
    // A new order each round: a pass may find some of the stream its predecessor left in
    // the last-level cache, so no variant may always follow the same one.
    std::vector<int> order;
    for (int j = 0; j < 2 * n; ++j) {
      if (live[static_cast<size_t>(j)]) order.push_back(j);
    }
    std::shuffle(order.begin(), order.end(), rng);
    // NTA passes last (the round's first reads follow them): a pass right after one ran
    // 1.12x its own median on average on an Intel Xeon (that pass leaves less of the
    // stream in the last-level cache), which once cost the best fp32 variant its steady win.
    std::stable_partition(order.begin(), order.end(), [&](int j) { return !table.variants[j / 2].nta; });
    for (int j : order) {
      const double t = s.time(table.variants[j / 2].matmul[j % 2]);
      times[static_cast<size_t>(j)].push_back(t);
    }
    round_seconds = seconds_since(round0);
    r.longest_round_seconds = std::max(r.longest_round_seconds, round_seconds);
    ++r.rounds;
    // From the second round on, a candidate clearly out of the race (its median over the
    // default more than kTuneDropFactor times the best one's) is no longer timed: the
    // remaining rounds go to the close ones. The defaults always run (every ratio needs them).
    if (r.rounds >= 2) {
      std::vector<double> med(static_cast<size_t>(2 * n), 0.0);
      double best[2] = {1.0, 1.0};
      for (int j = 0; j < 2 * n; ++j) {
        if (!live[static_cast<size_t>(j)]) continue;
        med[static_cast<size_t>(j)] = median(ratios_of(j));
        best[j % 2] = std::min(best[j % 2], med[static_cast<size_t>(j)]);
      }
      for (int j = 0; j < 2 * n; ++j) {
        if (live[static_cast<size_t>(j)] && j / 2 != table.defaults[j % 2] &&
            med[static_cast<size_t>(j)] > kTuneDropFactor * best[j % 2]) {
          live[static_cast<size_t>(j)] = 0;
        }
      }
    }
  }
  r.elapsed_seconds = seconds_since(t0);
  g_sink = checksum;  // the reads' loads must stay
  r.read_seconds = median(read);
  for (int v = 0; v < n; ++v) {
    for (int mode = 0; mode < 2; ++mode) {
      const int j = alias[static_cast<size_t>(2 * v + mode)];
      r.rows[v].seconds[mode] = median(times[static_cast<size_t>(j)]);
      r.rows[v].rounds[mode] = static_cast<int>(times[static_cast<size_t>(j)].size());
      r.rows[v].vs_default[mode] = median(ratios_of(j));
    }
  }
  bool open = false;
  r.chosen[kFp32] = decide(kFp32, open);
  r.chosen[kInt8] = decide(kInt8, open);
  return r;
}

}  // namespace cim

// The FMA rate of a float GEMM's inner loop by shape, and what each step toward fp32 mode's
// row loop (panel_kernels.h) costs it: R rows of A broadcast (packed R floats per input)
// against V zmm of a panel of 512 inputs per pass (V x 32 KB, from L2), R x V accumulators;
// then with groups and their scale step, with the kernel's panel layout, with A of 128 rows
// (Form below). Not timed: making the panels (the first block of rows) and the passes over Y.
// Also a register-only FMA loop for the core's peak. GMAC/s, the fastest of 5 interleaved
// rounds (docs/benchmarks.md: "AMD EPYC Zen 4, tuned on first use", its last part; the
// Intel figures of "fp32 prefill at M = 128, the evening's look" predate a fix to the sink):
//
//   g++ -O3 -std=c++17 -mavx512f -mfma ops/cpp/tools/fma_shape_bench.cpp -o fma_shape_bench
//   ./fma_shape_bench
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <vector>

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// The steps from a bare loop toward panel_kernels.h's row loop, one added at a time.
enum Form : int {
  kBare,       // one panel of V x 16 floats per input, contiguous; one block of A, in L1
  kGroups,     // + groups of 32 inputs: sums from zero, then acc (in L1) = fma(t, scale, acc)
  kTilePanels, // + each tile's panel in its own 32 KB (the kernel's layout: V streams 32 KB apart)
  kRowBlocks,  // + A of 128 rows in blocks of R, one block a pass (A from L2, as at M = 128)
};
constexpr const char* kFormNames[] = {"bare", "+ groups", "+ tile panels", "+ 128 rows of A"};
constexpr int kInputs = 512, kGroup = 32, kMRows = 128;

// GMAC/s of `passes` passes of R rows over a panel of kInputs inputs.
template <int R, int V, int kForm>
double shape(const float* panel, const float* a, const float* scales, int64_t passes) {
  alignas(64) float acc[R * V * 16] = {};
  __m512 t[R][V];
  for (auto& row : t)
    for (auto& x : row) x = _mm512_setzero_ps();
  constexpr int kBlocks = kForm >= kRowBlocks ? (kMRows + R - 1) / R : 1;
  constexpr int kGroupInputs = kForm >= kGroups ? kGroup : kInputs;
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t it = 0; it < passes; ++it) {
    const float* ablock = a + (it % kBlocks) * R * kInputs;
    for (int g = 0; g < kInputs / kGroupInputs; ++g) {
      if constexpr (kForm >= kGroups) {
        for (auto& row : t)
          for (auto& x : row) x = _mm512_setzero_ps();
      }
      for (int j = g * kGroupInputs; j < (g + 1) * kGroupInputs; ++j) {
        __m512 w[V];
        for (int x = 0; x < V; ++x) {
          w[x] = _mm512_load_ps(kForm >= kTilePanels ? panel + x * kInputs * 16 + j * 16 : panel + (j * V + x) * 16);
        }
        for (int r = 0; r < R; ++r) {
          const __m512 av = _mm512_set1_ps(ablock[j * R + r]);
          for (int x = 0; x < V; ++x) t[r][x] = _mm512_fmadd_ps(av, w[x], t[r][x]);
        }
      }
      if constexpr (kForm >= kGroups) {
        for (int x = 0; x < V; ++x) {
          const __m512 sc = _mm512_load_ps(scales + (g * V + x) * 16);
          for (int r = 0; r < R; ++r) {
            float* c = acc + (r * V + x) * 16;
            _mm512_store_ps(c, _mm512_fmadd_ps(t[r][x], sc, _mm512_load_ps(c)));
          }
        }
      }
    }
  }
  const double s = seconds_since(t0);
  float sink = 0;
  for (float x : acc) sink += x;  // every running sum live, so the groups' scale step is not dropped
  for (auto& row : t)
    for (auto& x : row) sink += _mm512_reduce_add_ps(x);
  if (sink == 1.2345f) std::puts("");  // keeps the sums live
  return double(passes) * kInputs * R * V * 16 / s / 1e9;
}

// Each form of an R x V shape, interleaved, the fastest of 5 rounds.
template <int R, int V>
void show(const float* panel, const float* a, const float* scales) {
  double best[4] = {};
  const int64_t passes = int64_t(2e9) / (kInputs * R * V * 16);
  for (int rep = 0; rep < 5; ++rep) {
    best[0] = std::max(best[0], shape<R, V, kBare>(panel, a, scales, passes));
    best[1] = std::max(best[1], shape<R, V, kGroups>(panel, a, scales, passes));
    best[2] = std::max(best[2], shape<R, V, kTilePanels>(panel, a, scales, passes));
    best[3] = std::max(best[3], shape<R, V, kRowBlocks>(panel, a, scales, passes));
  }
  std::printf("%2d rows x %d zmm (panel %3d KB):", R, V, kInputs * V * 64 / 1024);
  for (int f = 0; f < 4; ++f) std::printf("  %s %.1f", kFormNames[f], best[f]);
  std::printf(" GMAC/s\n");
}

// 12 independent FMA chains, nothing else: the core's FMA throughput.
double peak(float seed) {
  const __m512 a = _mm512_set1_ps(0.999f), b = _mm512_set1_ps(1e-4f * seed);
  __m512 t[12];
  for (int i = 0; i < 12; ++i) t[i] = _mm512_set1_ps(seed * float(i + 1));  // distinct, so not merged
  const int64_t n = 100000000;
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t i = 0; i < n; ++i) {
#pragma GCC unroll 12
    for (int k = 0; k < 12; ++k) t[k] = _mm512_fmadd_ps(t[k], a, b);
  }
  const double s = seconds_since(t0);
  __m512 z = t[0];
  for (int k = 1; k < 12; ++k) z = _mm512_add_ps(z, t[k]);
  if (_mm512_reduce_add_ps(z) == 1.2345f) std::puts("");
  return double(n) * 12 * 16 / s / 1e9;
}

}  // namespace

int main() {
  double best = 0;
  for (int rep = 0; rep < 3; ++rep) best = std::max(best, peak(1.0f + rep));
  std::printf("register-only FMA loop: %.1f GMAC/s (%.2f G zmm FMAs/s)\n", best, best / 16);
  auto aligned = [](std::vector<float>& v) {
    return reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(v.data()) + 63) & ~uintptr_t(63));
  };
  std::vector<float> panel_buf(4 * kInputs * 16 + 16, 1e-3f), a_buf((kMRows + 16) * kInputs + 16, 0.5f),
      scale_buf(kInputs / kGroup * 4 * 16 + 16, 0.25f);
  const float* panel = aligned(panel_buf);
  const float* a = aligned(a_buf);
  const float* scales = aligned(scale_buf);
  show<6, 2>(panel, a, scales);
  show<8, 2>(panel, a, scales);
  show<12, 2>(panel, a, scales);
  show<14, 2>(panel, a, scales);
  show<8, 3>(panel, a, scales);
  show<6, 4>(panel, a, scales);
}

// The FMA rate of a float GEMM's inner loop by shape, apart from everything else fp32 mode's
// prefill by panel does (panel_kernels.h: groups, scales, making the panels): R rows of A
// broadcast (packed R floats per input, in L1) against V zmm of a panel per input, R x V
// accumulators, over a panel held in L1 (24 KB) or of 512 inputs (V x 32 KB, from L2), and a
// register-only FMA loop for the core's peak. GMAC/s, the fastest of 3 (docs/benchmarks.md,
// "fp32 prefill at M = 128, the evening's look"):
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

// GMAC/s of `iters` passes over a panel of `inputs` inputs.
template <int R, int V>
double shape(const float* panel, const float* a, int inputs, int64_t iters) {
  __m512 t[R][V];
  for (auto& row : t)
    for (auto& x : row) x = _mm512_setzero_ps();
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t it = 0; it < iters; ++it) {
    const float* p = panel;
    const float* ap = a;
    for (int j = 0; j < inputs; ++j, p += V * 16, ap += R) {
      __m512 w[V];
      for (int x = 0; x < V; ++x) w[x] = _mm512_load_ps(p + x * 16);
      for (int r = 0; r < R; ++r) {
        const __m512 av = _mm512_set1_ps(ap[r]);
        for (int x = 0; x < V; ++x) t[r][x] = _mm512_fmadd_ps(av, w[x], t[r][x]);
      }
    }
  }
  const double s = seconds_since(t0);
  float sink = 0;
  for (auto& row : t)
    for (auto& x : row) sink += _mm512_reduce_add_ps(x);
  if (sink == 1.2345f) std::puts("");  // keeps the sums live
  return double(iters) * inputs * R * V * 16 / s / 1e9;
}

template <int R, int V>
void show(const float* panel, const float* a) {
  const int in_l1 = 24 * 1024 / (V * 64);
  double l1 = 0, l2 = 0;
  for (int rep = 0; rep < 3; ++rep) {
    l1 = std::max(l1, shape<R, V>(panel, a, in_l1, int64_t(2e9) / (in_l1 * R * V * 16)));
    l2 = std::max(l2, shape<R, V>(panel, a, 512, int64_t(2e9) / (512 * R * V * 16)));
  }
  std::printf("%2d rows x %d zmm: panel in L1 %6.1f   512 inputs (%3d KB) %6.1f GMAC/s\n", R, V, l1, 512 * V * 64 / 1024,
              l2);
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
  std::vector<float> buf((1 << 19) + 16, 1e-3f);
  float* panel = reinterpret_cast<float*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t(63));
  std::vector<float> a(512 * 16, 0.5f);
  show<6, 2>(panel, a.data());
  show<8, 2>(panel, a.data());
  show<12, 2>(panel, a.data());
  show<14, 2>(panel, a.data());
  show<4, 3>(panel, a.data());
  show<8, 3>(panel, a.data());
  show<6, 4>(panel, a.data());
  show<5, 4>(panel, a.data());
}

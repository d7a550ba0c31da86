// fp32 mode's prefill by panel, for tables whose fp32 unpacking is dear (S::kPrefillPanel:
// AVX2, without a 16-entry vpermps: two shifts and a convert per code vector; AVX-512,
// where a shift and a vpermps per 16 weights compete with the FMAs for ports 0 and 5 on
// Intel cores). Internal linkage, for the reason tile_kernels.h gives.
//
// Per block of kPanelK inputs: A's rows are packed input by input (R floats per input for
// each block of R rows); the 4-bit codes of kPanelTiles tiles are unpacked once into
// panels of floats c - 8 (16 per input, with the groups' scales; on AVX-512 by the first
// block of rows as it runs, kMakeInRows); then each block of R rows runs over the panels
// one after the other, its packed A staying in L1 while the panels come from L2 (the
// blocking of a float GEMM). The row loop is a float GEMM's: a panel load per vector, a
// broadcast per row, FMAs, and no unpacking per block of rows after the first.
// Every output gets the portable kernel's arithmetic (tile_kernels.h's header): per group
// t = fma(a_k, c_k - 8, t) for k in order, then acc = fma(t, scale, acc); partial sums wait
// in Y between blocks of K, exactly.
//
// Measured (docs/benchmarks.md): on an AVX2-only Zen 3 1.14-1.45x prefill by block
// (prefill_kernels.h) at M = 128 (with one tile per panel pass and 256 inputs, no faster);
// on an Intel Xeon (AVX-512) 1.05x at M = 32, 1.22x at 128, 1.27x at 512 with the panels
// made in a pass of their own (kMakeInRows adds 1.11-1.13x at 32, 1.02-1.03x at 128); on a
// Zen 4 a similar 6 x 2-zmm form was level with prefill by block.
#pragma once

#include <cstdint>
#include <cstdlib>

#include "kernels/kernel.h"
#include "kernels/simd_util.h"
#include "kernels/tile_kernels.h"

namespace cim {
namespace {

template <class S>
struct PanelKernels {
  using T = TileKernels<S>;
  using F = typename S::F;
  using I = typename S::I;
  static constexpr int kVecs = T::kVecs;
  static constexpr int kRows = S::kPrefillRowsFp32;  // R

  // The first block of rows makes the panels as it runs, each code row unpacked into
  // registers, stored and used at once, where a pass before the rows made them (AVX-512,
  // 32 registers; Intel Xeon, M = 32 / 64 / 128: 1.11-1.13x / 1.05x / 1.02-1.03x the
  // pass, level at 512). AVX2 (16 registers) keeps the pass: the other form ran 0.97x at
  // M = 128 there, level at 32.
  static constexpr bool kMakeInRows = kVecs == 1;
  static constexpr int64_t kPanelK = 512;  // inputs per panel: 512 x 16 floats = 32 KB
  // Panels made at once: 64 KB (AVX-512, two per pass: 1.01x four on the Intel Xeon) or
  // 128 KB, in L2.
  static constexpr int64_t kPanelTiles = kMakeInRows ? 2 : 4;
  // Tiles per pass of a block of rows: two vectors of channels per row (AVX2: one tile of
  // 2 ymm; AVX-512: two tiles of 1 zmm), so 6 rows keep 12 independent FMA chains. With
  // one zmm per row (6 chains) the AVX-512 loop ran at 0.8x this on an Intel Xeon.
  static constexpr int kPassTiles = kVecs >= 2 ? 1 : 2;
  static constexpr int64_t kMaxRows = 192;    // rows of A packed at once: at most 384 KB, in L2
  static constexpr int64_t kMinRows = 24;     // fewer rows: prefill by block (level at 16 rows, ahead from 32)

  // Floats per tile of a panel, and of its groups' scales (group sizes >= 16).
  static constexpr int64_t kPanelFloats = kPanelK * kTileN;
  static constexpr int64_t kScaleFloats = kPanelK / 16 * kTileN;

  struct Scratch {
    float* panels = nullptr;  // [kPanelTiles][kPanelFloats], then [kPanelTiles][kScaleFloats]
    float* a = nullptr;       // [row blocks][kPanelK][R]
    bool make(int64_t rows) {
      const int64_t floats = kPanelTiles * (kPanelFloats + kScaleFloats) + (rows + kRows - 1) / kRows * kRows * kPanelK;
      panels = static_cast<float*>(std::aligned_alloc(64, static_cast<size_t>((floats * 4 + 63) / 64 * 64)));
      a = panels == nullptr ? nullptr : panels + kPanelTiles * (kPanelFloats + kScaleFloats);
      return panels != nullptr;
    }
    // Tile i's (0 .. kPanelTiles - 1) panel and scales.
    float* panel(int64_t i) const { return panels + i * kPanelFloats; }
    float* scales(int64_t i) const { return panels + kPanelTiles * kPanelFloats + i * kScaleFloats; }
    ~Scratch() { std::free(panels); }
  };

  // One tile's groups [g0, g1): the floats c - 8 per input and channel, and the groups' scales.
  template <int kSc>
  static void make_panel(const PackedWeights& w, int64_t t0, int64_t g0, int64_t g1, float* panel, float* scales) {
    for (int64_t g = g0; g < g1; ++g) {
      const uint8_t* blk[1] = {w.block(t0, g)};
      const uint8_t* scl[1] = {w.scales(t0, g)};
      float* p = panel + (g - g0) * w.group_size * kTileN;
      for (int64_t v = 0; v < w.group_size / 8; ++v) {
        for (int x = 0; x < kVecs; ++x) {
          const I row = S::fp32_codes(T::template code_row<1>(blk, v, x));
          static_for<8>([&](auto jc) CIM_INLINE_LAMBDA {
            constexpr int j = decltype(jc)::value;
            S::store(p + (8 * v + j) * kTileN + x * S::kLanes, S::template code_minus_8<j>(row));
          });
        }
      }
      for (int x = 0; x < kVecs; ++x) {
        S::store(scales + (g - g0) * kTileN + x * S::kLanes, T::template scales_of<1, kSc>(w, scl, t0, g, x));
      }
    }
  }

  // Vector x of a row of NP tiles' panels (tile x / kVecs, lanes (x % kVecs) * kLanes
  // onwards): its offset in the panels, and in their scales.
  static constexpr int64_t at(int x) { return (x / kVecs) * kPanelFloats + (x % kVecs) * S::kLanes; }
  static constexpr int64_t scale_at(int x) { return (x / kVecs) * kScaleFloats + (x % kVecs) * S::kLanes; }

  // Group g of tiles t0 .. t0 + NP - 1 made as make_panel makes it (tile i's floats at
  // p + i * kPanelFloats, its scales at sc + i * kScaleFloats) while R rows of packed A
  // (ag) run against it into t: each code row unpacked once, stored and used.
  template <int R, int NP, int kSc>
  static CIM_INLINE void make_group(const PackedWeights& w, int64_t t0, int64_t g, float* p, float* sc,
                                    const float* ag, F (&t)[R][NP * kVecs]) {
    constexpr int V = NP * kVecs;
    const uint8_t* blk[NP];
    const uint8_t* scl[NP];
    T::template blocks_of<NP>(w, t0, g, blk, scl);
    for (int64_t v = 0; v < w.group_size / 8; ++v) {
      I row[V];
      for (int x = 0; x < V; ++x) row[x] = S::fp32_codes(T::template code_row<NP>(blk, v, x));
      static_for<8>([&](auto jc) CIM_INLINE_LAMBDA {
        constexpr int j = decltype(jc)::value;
        F wv[V];
        for (int x = 0; x < V; ++x) {
          wv[x] = S::template code_minus_8<j>(row[x]);
          S::store(p + at(x) + (8 * v + j) * kTileN, wv[x]);
        }
        for (int r = 0; r < R; ++r) {
          const F av = S::set1(ag[(8 * v + j) * kRows + r]);
          for (int x = 0; x < V; ++x) t[r][x] = S::fma(av, wv[x], t[r][x]);
        }
      });
    }
    for (int x = 0; x < V; ++x) {
      S::store(sc + scale_at(x), T::template scales_of<NP, kSc>(w, scl, t0, g, x));
    }
  }

  // Rows m0 .. m0 + R - 1 against the panels of NP tiles t0 .. t0 + NP - 1, groups [g0, g1)
  // (tile t0 + i's panel at panel + i * kPanelFloats, its scales at scales + i *
  // kScaleFloats); `a` is the rows' packed A (input k0 + j of row r at a[j * kRows + r], k0
  // the panel's first input). With kMake, these rows make the panels' groups as they go.
  template <int R, int NP, bool kMake, int kSc>
  static void rows(const MatMulArgs& args, float* panel, float* scales, const float* a, int64_t t0, int64_t m0,
                   int64_t g0, int64_t g1) {
    const PackedWeights& w = *args.W;
    constexpr int V = NP * kVecs;  // vectors of channels per row
    F init[R][V];
    T::template load_acc<NP, R>(args, t0, m0, g0, init);
    alignas(64) float acc[R * V * S::kLanes];  // the running sums wait in L1 between groups
    for (int r = 0; r < R; ++r)
      for (int x = 0; x < V; ++x) S::store(acc + (r * V + x) * S::kLanes, init[r][x]);
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t k0 = g * w.group_size;
      const int64_t valid = w.K - k0 < w.group_size ? w.K - k0 : w.group_size;  // only k < K is read
      float* p = panel + (g - g0) * w.group_size * kTileN;
      const float* ag = a + (g - g0) * w.group_size * kRows;
      F t[R][V];
      for (int r = 0; r < R; ++r)
        for (int x = 0; x < V; ++x) t[r][x] = S::zero();
      auto step = [&](int64_t j) CIM_INLINE_LAMBDA {
        F wv[V];
        for (int x = 0; x < V; ++x) wv[x] = S::load(p + at(x) + j * kTileN);
        for (int r = 0; r < R; ++r) {
          const F av = S::set1(ag[j * kRows + r]);
          for (int x = 0; x < V; ++x) t[r][x] = S::fma(av, wv[x], t[r][x]);
        }
      };
      bool made = false;  // made and run by make_group
      if constexpr (kMake) {
        if (valid == w.group_size) {
          make_group<R, NP, kSc>(w, t0, g, p, scales + (g - g0) * kTileN, ag, t);
          made = true;
        } else {  // a last, partial group: its panel made first, then run as the others run
          for (int i = 0; i < NP; ++i) {
            make_panel<kSc>(w, t0 + i, g, g + 1, p + i * kPanelFloats, scales + i * kScaleFloats + (g - g0) * kTileN);
          }
        }
      }
      if (!made) {
        if (valid == w.group_size) {  // group sizes are multiples of 8
          for (int64_t j = 0; j < valid; j += 8) static_for<8>([&](auto jc) CIM_INLINE_LAMBDA { step(j + jc); });
        } else {
          for (int64_t j = 0; j < valid; ++j) step(j);
        }
      }
      for (int x = 0; x < V; ++x) {
        const F s = S::load(scales + scale_at(x) + (g - g0) * kTileN);
        for (int r = 0; r < R; ++r) {
          float* c = acc + (r * V + x) * S::kLanes;
          S::store(c, S::fma(t[r][x], s, S::load(c)));
        }
      }
    }
    F out[R][V];
    for (int r = 0; r < R; ++r)
      for (int x = 0; x < V; ++x) out[r][x] = S::load(acc + (r * V + x) * S::kLanes);
    T::template store_acc<NP, R>(args, t0, m0, g1, out);
  }

  // 1 <= n <= kRows rows.
  template <int NP, bool kMake, int kSc, int R = kRows>
  static void rows_n(const MatMulArgs& args, float* panel, float* scales, const float* a, int64_t t0,
                     int64_t m0, int64_t n, int64_t g0, int64_t g1) {
    if constexpr (R >= 1) {
      if (n == R) {
        rows<R, NP, kMake, kSc>(args, panel, scales, a, t0, m0, g0, g1);
      } else {
        rows_n<NP, kMake, kSc, R - 1>(args, panel, scales, a, t0, m0, n, g0, g1);
      }
    }
  }

  // A block of n rows (packed at a) against the panels of tiles [n0, n1), kPassTiles at a time.
  template <bool kMake, int kSc>
  static void tiles(const MatMulArgs& args, const Scratch& s, int64_t n0, int64_t n1, const float* a, int64_t m0,
                    int64_t n, int64_t g0, int64_t g1) {
    int64_t t = n0;
    for (; t + kPassTiles <= n1; t += kPassTiles) {
      rows_n<kPassTiles, kMake, kSc>(args, s.panel(t - n0), s.scales(t - n0), a, t, m0, n, g0, g1);
    }
    for (; t < n1; ++t) rows_n<1, kMake, kSc>(args, s.panel(t - n0), s.scales(t - n0), a, t, m0, n, g0, g1);
  }

  // Rows [m0, m1) go in row_blocks(m0, m1) blocks of at most kRows rows, as even as they go:
  // block b holds rows [row_of(m0, m1, b), row_of(m0, m1, b + 1)). (128 rows as 21 x 6 + 2
  // left a last block whose 2 rows keep only 4 FMA chains in flight.)
  static int64_t row_blocks(int64_t m0, int64_t m1) { return (m1 - m0 + kRows - 1) / kRows; }
  static int64_t row_of(int64_t m0, int64_t m1, int64_t b) { return m0 + b * (m1 - m0) / row_blocks(m0, m1); }

  // Rows [m0, m1) of A, inputs [k0, k0 + len): block b's rows at a + b * kPanelK * kRows,
  // input by input (kRows floats per input, the first of them used).
  static void pack_a(const MatMulArgs& args, int64_t m0, int64_t m1, int64_t k0, int64_t len, float* a) {
    for (int64_t b = 0; b < row_blocks(m0, m1); ++b) {
      const int64_t first = row_of(m0, m1, b);
      for (int64_t m = first; m < row_of(m0, m1, b + 1); ++m) {
        float* dst = a + b * kPanelK * kRows + (m - first);
        const float* src = args.A + m * args.lda + k0;
        for (int64_t j = 0; j < len; ++j) dst[j * kRows] = src[j];
      }
    }
  }

  // Tiles [n0, n1)'s codes and scales of groups [g0, g1), fetched into L2 while the rows
  // run over the panels before theirs: the block of rows that makes their panels then
  // reads them from L2, not from DRAM, where in a model's chain of layers they lie. On a
  // Zen 4, 16 x 4096^2 chain through ORT (docs/benchmarks.md): 1.10x / 1.07x at M = 32 (1 /
  // 2 threads), level at 128. The prefetches are asm statements: GCC deleted a loop of
  // nothing but _mm_prefetch calls as a loop without side effects.
  static void prefetch_tiles(const PackedWeights& w, int64_t n0, int64_t n1, int64_t g0, int64_t g1) {
    const auto to_l2 = [](const uint8_t* p) { asm volatile("prefetcht1 %0" : : "m"(*p)); };
    for (int64_t t = n0; t < n1; ++t) {
      for (int64_t g = g0; g < g1; ++g) {
        const uint8_t* codes = w.block(t, g);
        for (int64_t off = 0; off < w.code_bytes(); off += 64) to_l2(codes + off);
        to_l2(w.scales(t, g));
        if (w.super_bytes > 0 && (g == g0 || g % kSuperGroups == 0)) to_l2(w.super_of(t, g));
      }
    }
  }

  // False when it did nothing (too few rows, or no memory for its scratch): the caller
  // then runs prefill by block.
  template <int kSc>
  static bool prefill(const MatMulArgs& args, int64_t tile_begin, int64_t tile_end) {
    const PackedWeights& w = *args.W;
    if (args.M < kMinRows || w.group_size < 16 || w.group_size > kPanelK) return false;  // scales: >= 16
    const int64_t supers = (args.M + kMaxRows - 1) / kMaxRows;
    const int64_t super_rows = ((args.M + supers - 1) / supers + kRows - 1) / kRows * kRows;
    Scratch s;
    if (!s.make(super_rows)) return false;
    const int64_t k_groups = kPanelK / w.group_size;
    for (int64_t g0 = 0; g0 < w.groups; g0 += k_groups) {
      const int64_t g1 = g0 + k_groups < w.groups ? g0 + k_groups : w.groups;
      const int64_t k0 = g0 * w.group_size;
      const int64_t len = (g1 * w.group_size < w.K ? g1 * w.group_size : w.K) - k0;
      for (int64_t s0 = 0; s0 < args.M; s0 += super_rows) {
        const int64_t s1 = s0 + super_rows < args.M ? s0 + super_rows : args.M;
        pack_a(args, s0, s1, k0, len, s.a);
        for (int64_t n0 = tile_begin; n0 < tile_end; n0 += kPanelTiles) {
          const int64_t n1 = n0 + kPanelTiles < tile_end ? n0 + kPanelTiles : tile_end;
          if constexpr (!kMakeInRows) {
            for (int64_t t = n0; t < n1; ++t) make_panel<kSc>(w, t, g0, g1, s.panel(t - n0), s.scales(t - n0));
          }
          for (int64_t b = 0; b < row_blocks(s0, s1); ++b) {
            if (b == 1 && n1 < tile_end) {  // the next pass's tiles, behind the block that made these panels
              prefetch_tiles(w, n1, n1 + kPanelTiles < tile_end ? n1 + kPanelTiles : tile_end, g0, g1);
            }
            const int64_t m0 = row_of(s0, s1, b);
            const int64_t n = row_of(s0, s1, b + 1) - m0;
            const float* a = s.a + b * kPanelK * kRows;
            if constexpr (kMakeInRows) {
              if (b == 0) {
                tiles<true, kSc>(args, s, n0, n1, a, m0, n, g0, g1);
                continue;
              }
            }
            tiles<false, kSc>(args, s, n0, n1, a, m0, n, g0, g1);
          }
        }
      }
    }
    return true;
  }
};

}  // namespace
}  // namespace cim

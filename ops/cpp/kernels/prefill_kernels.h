// Prefill (M > 1) over the traits S of tile_kernels.h, in each instruction set's own
// translation unit (internal linkage, for the reason tile_kernels.h gives): blocks of
// kPrefillK codes (A's part stays in L2), of kPrefillTilesL2 tiles (their weights stay in
// L2), of kPrefillRows* rows of A (in L1), then chunks of kPrefillTiles tiles: each code
// row is unpacked once per block of rows, in registers (TileKernels::block), and partial
// sums wait in Y between blocks of K. Every output gets the arithmetic of the portable
// kernel (tile_kernels.h's header), so prefill gives the same bits as decode and the oracle.
// fp32 mode with 4-bit codes on tables whose unpacking is dear (S::kPrefillPanel) runs
// panel_kernels.h's float-GEMM form instead, from its kMinRows rows on.
#pragma once

#include <cstdint>

#include "kernels/kernel.h"
#include "kernels/panel_kernels.h"
#include "kernels/tile_kernels.h"

namespace cim {
namespace {

template <class S>
struct PrefillKernels {
  using T = TileKernels<S>;

  // int8 mode's 4-bit codes through int16 pair sums (pair_kernels.h): its
  // own block shape, and no software prefetch (the weights are in L2 here; 2-4% faster
  // without on a Zen 4).
  template <class Fm>
  static constexpr bool kPairs = Fm::kInt8 && Fm::kBits == 4 && S::kPairDot;
  // Rows and tiles per prefill block, per form (the traits measure each).
  template <class Fm>
  static constexpr int kPrefillRows =
      !Fm::kInt8 ? S::kPrefillRowsFp32 : kPairs<Fm> ? S::kPrefillRowsPairs : S::kPrefillRowsInt8;
  template <class Fm>
  static constexpr int kPrefillTiles = kPairs<Fm> ? S::kPrefillTilesPairs : S::kPrefillTiles;

  // Rows m0 .. m0 + rows - 1 (1 <= rows <= kPrefillRows) against tiles t0 .. t0 + NT - 1.
  template <class Fm, int NT, int R = kPrefillRows<Fm>>
  static void rows_block(const MatMulArgs& args, int64_t t0, int64_t m0, int64_t rows, int64_t g0, int64_t g1) {
    if constexpr (R >= 1) {
      if (rows == R) {
        if constexpr (kPairs<Fm>) {
          T::template block<Fm, NT, R, 0>(args, t0, m0, g0, g1);
        } else {
          T::template block<Fm, NT, R>(args, t0, m0, g0, g1);
        }
      } else {
        rows_block<Fm, NT, R - 1>(args, t0, m0, rows, g0, g1);
      }
    }
  }

  // A block of kPrefillK codes of every row of A is reused by all tiles of the range;
  // within it, each block of rows (6 x 512 floats = 12 KB) stays in L1 while the weights
  // of kPrefillTilesL2 tiles (32 x 16 groups x 320 B = 160 KB, L2) pass under it, chunk
  // by chunk.
  static constexpr int64_t kPrefillK = 512;
  static constexpr int64_t kPrefillTilesL2 = 32;

  // M > 1 (M = 1 works too, at prefill's pace).
  template <class Fm>
  static void prefill(const MatMulArgs& args, int64_t tile_begin, int64_t tile_end) {
    if constexpr (S::kPrefillPanel && !Fm::kInt8 && Fm::kBits == 4) {
      if (PanelKernels<S>::template prefill<Fm::kSc>(args, tile_begin, tile_end)) return;
    }
    const PackedWeights& w = *args.W;
    constexpr int NT = kPrefillTiles<Fm>;
    constexpr int R = kPrefillRows<Fm>;
    const int64_t k_groups = kPrefillK / w.group_size > 0 ? kPrefillK / w.group_size : 1;
    for (int64_t g0 = 0; g0 < w.groups; g0 += k_groups) {
      const int64_t g1 = g0 + k_groups < w.groups ? g0 + k_groups : w.groups;
      for (int64_t n0 = tile_begin; n0 < tile_end; n0 += kPrefillTilesL2) {
        const int64_t n1 = n0 + kPrefillTilesL2 < tile_end ? n0 + kPrefillTilesL2 : tile_end;
        for (int64_t m0 = 0; m0 < args.M; m0 += R) {
          const int64_t rows = args.M - m0 < R ? args.M - m0 : R;
          int64_t t = n0;
          for (; t + NT <= n1; t += NT) rows_block<Fm, NT>(args, t, m0, rows, g0, g1);
          for (; t < n1; ++t) rows_block<Fm, 1>(args, t, m0, rows, g0, g1);
        }
      }
    }
  }
};

}  // namespace
}  // namespace cim

// int8 mode without VNNI (int16 pair sums: S::kPairDot), 4-bit codes, for TileKernels
// (tile_kernels.h, whose helpers it uses: T = TileKernels<S>), in each instruction set's
// own translation unit (internal linkage, for the reason tile_kernels.h gives). Every
// output gets the portable kernel's arithmetic (tile_kernels.h's header), so these loops
// give the same bits as every other path.
#pragma once

#include <xmmintrin.h>

#include <cstdint>
#include <type_traits>

#include "kernels/kernel.h"
#include "kernels/simd_util.h"

namespace cim {
namespace {

template <class S, class T>
struct PairKernels {
  using F = typename S::F;
  using I = typename S::I;
  static constexpr int kVecs = T::kVecs;

  // int8 mode without VNNI, 4-bit codes (TileKernels::block sends them here; int8_block
  // runs the other tables and widths): a chunk's products (up to 32 codes, 8 dot4 steps:
  // pair_steps) in int16 pair sums, one vpmaddwd flush per chunk.
  // Only the pair sums live in registers through a chunk (R x NT * kVecs of them); the
  // group's int32 sums and the float sums wait in L1 (`partial`, `sums`) and are touched
  // once per chunk and group. Keeping all three in registers, as int8_block does with VNNI,
  // needs 24 ymm at R = 4, NT = 1 with AVX2's 16, and GCC spilled them inside the chunk
  // (prefill 80 GMAC/s on a Zen 4 with the avx2 table). Each output gets int8_block's
  // arithmetic in its order: d = z + the chunks' exact sums, acc = fma(d, a_scale * scale, acc).
  template <int kSc, int NT, int R, int64_t kAhead, int kHint>
  static void block(const MatMulArgs& args, int64_t t0, int64_t m0, int64_t g0, int64_t g1) {
    constexpr int X = NT * kVecs;
    const PackedWeights& w = *args.W;
    const QuantizedA& qa = *args.QA;
    const int64_t k_padded = w.groups * w.group_size;
    alignas(64) float sums[R][X * S::kLanes];
    alignas(64) int32_t partial[R][X * S::kLanes];
    {
      F acc[R][X];
      T::template load_acc<NT, R>(args, t0, m0, g0, acc);
      for (int r = 0; r < R; ++r)
        for (int x = 0; x < X; ++x) S::store(sums[r] + x * S::kLanes, acc[r][x]);
    }
    const int8_t* q[R];
    for (int r = 0; r < R; ++r) q[r] = qa.q + (m0 + r) * k_padded;
    alignas(64) float run[NT * kTileN];  // int8 scales: the run's super-scales / 128
    if constexpr (kSc == kScaleI8) T::template super_steps<NT>(w, t0, g0, run);
    const float* run_or_null = kSc == kScaleI8 ? run : nullptr;
    const int64_t chunks = w.group_size / 32;  // 0: group size 16, one chunk of two code rows
    for (int64_t g = g0; g < g1; ++g) {
      const uint8_t* blk[NT];
      const uint8_t* scl[NT];
      T::template enter_group<NT, kSc, kAhead, kHint>(w, t0, g, g0, blk, scl, run);
      const int64_t k0 = g * w.group_size;
      // kRows code rows from row v0; the first chunk of a group starts from z, the last
      // one's sums go through the scales into `sums` (compile-time flags: group size 32
      // is one chunk, first and last).
      auto chunk = [&](auto rows_c, int64_t v0, auto first_c, auto last_c) CIM_INLINE_LAMBDA {
        constexpr int kRows = decltype(rows_c)::value;
        static_assert(2 * kRows <= pair_steps(4), "int16 pair sums could saturate");
        I p[R][X];
        for (int r = 0; r < R; ++r)
          for (int x = 0; x < X; ++x) p[r][x] = S::zero_i();
        static_for<kRows>([&](auto vc) CIM_INLINE_LAMBDA {
          const int64_t v = v0 + decltype(vc)::value;
          static_for<X>([&](auto xc) CIM_INLINE_LAMBDA {
            constexpr int x = decltype(xc)::value;
            const I row = T::template code_row<NT>(blk, v, x);
            const I lo = S::low_nibbles(row), hi = S::high_nibbles(row);
            static_for<R>([&](auto rc) CIM_INLINE_LAMBDA {
              constexpr int r = decltype(rc)::value;
              p[r][x] = S::pair_dot(p[r][x], lo, S::set1_i32(load_i32(q[r] + k0 + 8 * v)));
              p[r][x] = S::pair_dot(p[r][x], hi, S::set1_i32(load_i32(q[r] + k0 + 8 * v + 4)));
              // A register barrier: integer adds reassociate, and GCC turned the chunk's
              // steps into trees of products held in (spilled) temporaries.
              asm("" : "+v"(p[r][x]));
            });
          });
        });
        F s[X];
        if constexpr (decltype(last_c)::value) {
          for (int x = 0; x < X; ++x) s[x] = T::template scales_of<NT, kSc>(w, scl, t0, g, x, run_or_null);
        }
        for (int r = 0; r < R; ++r) {
          const I z = S::set1_i32(-8 * qa.qsum[(m0 + r) * w.groups + g]);
          const F a_scale = S::set1(qa.scale[(m0 + r) * w.groups + g]);
          for (int x = 0; x < X; ++x) {
            uint8_t* part = reinterpret_cast<uint8_t*>(partial[r] + x * S::kLanes);
            const I d = S::pair_flush(decltype(first_c)::value ? z : S::loadi(part), p[r][x]);
            if constexpr (decltype(last_c)::value) {
              float* sum = sums[r] + x * S::kLanes;
              S::store(sum, S::fma(S::cvt(d), S::mul(a_scale, s[x]), S::load(sum)));
            } else {
              S::storei(part, d);
            }
          }
        }
      };
      using Yes = std::true_type;
      using No = std::false_type;
      if (chunks == 0) {  // group size 16: two code rows
        chunk(std::integral_constant<int, 2>{}, 0, Yes{}, Yes{});
      } else if (chunks == 1) {
        chunk(std::integral_constant<int, 4>{}, 0, Yes{}, Yes{});
      } else {
        using Four = std::integral_constant<int, 4>;
        chunk(Four{}, 0, Yes{}, No{});
        for (int64_t c = 1; c + 1 < chunks; ++c) chunk(Four{}, 4 * c, No{}, No{});
        chunk(Four{}, 4 * (chunks - 1), No{}, Yes{});
      }
    }
    F acc[R][X];
    for (int r = 0; r < R; ++r)
      for (int x = 0; x < X; ++x) acc[r][x] = S::load(sums[r] + x * S::kLanes);
    T::template store_acc<NT, R>(args, t0, m0, g1, acc);
  }
};

}  // namespace
}  // namespace cim

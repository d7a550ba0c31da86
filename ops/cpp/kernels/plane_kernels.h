// The inner loops of one group for code widths other than 4 (2, 3, 5, 6, 8): the planes
// of kernel.h's layout unpacked a quad of codes at a time (lane c, byte b: the code of
// k = 4Q + b of a chunk), then the same arithmetic as the 4-bit loops of tile_kernels.h:
//   fp32: t = fma(a_k, q_k, t) for k < K in order (q = c - 2^(bits-1), or the level of c;
//         widths up to kLevelBits take it from the node's levels as floats by one vpermps);
//   int8: d += sum qa_k u_k, four codes per vpdpbusd (u8 x s8 activations, exact).
// A non-uniform grid (widths up to kLevelBits) looks each code up in the node's level table
// (kernel.h's CodeLevels: one byte shuffle per vector) in the same loops; with_planes picks
// the form per group, so uniform codes run without it (the table cost int8 decode 9% at 3 bits).
// Without VNNI, vpmaddubsw adds u8 x s8 pairs into int16 with saturation: exact for codes
// up to 127 (2 * 127 * 127 < 32768) but not for 8-bit codes, which go in as two nibbles
// (dot4_u8). Internal linkage only, for the reason tile_kernels.h gives.
#pragma once

#include <cstdint>

#include "kernels/kernel.h"
#include "kernels/simd_util.h"

namespace cim {
namespace {

template <class S, int kBits, bool kTable = false>
struct PlaneKernels {
  static_assert(!kTable || kBits <= kLevelBits, "level tables hold 16 codes");
  using F = typename S::F;
  using I = typename S::I;
  static constexpr int kVecs = int(kTileN) / S::kLanes;
  static constexpr int kVecBytes = S::kLanes * 4;
  static constexpr Planes kP = planes_of(kBits);
  static constexpr int kOffset = 1 << (kBits - 1);
  // fp32 mode: widths up to kLevelBits look each code's level up as a float (a shift and a
  // vpermps a code, where sign extension took a shift, a shift and a convert: 3-bit fp32
  // decode of a 16 x 4096^2 chain 22.2 -> 17.5 ms on a Zen 4); wider codes sign-extend their kBits.
  static constexpr bool kPermute = kBits <= kLevelBits;

  // int8 mode: a quad's codes to the u8 values vpdpbusd multiplies (q + zero).
  static CIM_INLINE I unsigned_u(const PackedWeights& w, I codes) {
    if constexpr (kTable) {
      return S::lookup16(S::table16(w.levels.u), codes);
    } else {
      return codes;
    }
  }

  // Codes k = 4Q .. 4Q+3 of the chunk at `chunk` as u8, vector x of its tile; the high
  // plane starts `high` bytes into the chunk. Shifts are on 16-bit lanes: the byte mask
  // after each keeps only bits that came from the same byte.
  template <int Q>
  static CIM_INLINE I quad(const uint8_t* chunk, int64_t high, int x) {
    constexpr int lo_row = Q * kP.lo / 8, lo_shift = kP.lo * (Q % (8 / kP.lo));
    I code = S::loadi(chunk + lo_row * kCodeRowBytes + x * kVecBytes);
    if constexpr (lo_shift > 0) code = S::template shr16<lo_shift>(code);
    if constexpr (kP.lo < 8) code = S::and_(code, S::set1_i8(static_cast<char>((1 << kP.lo) - 1)));
    if constexpr (kP.hi > 0) {
      constexpr int hi_row = Q * kP.hi / 8, hi_shift = kP.hi * (Q % (8 / kP.hi));
      I top = S::loadi(chunk + high + hi_row * kCodeRowBytes + x * kVecBytes);
      if constexpr (hi_shift < kP.lo) {
        top = S::template shl16<kP.lo - hi_shift>(top);
      } else if constexpr (hi_shift > kP.lo) {
        top = S::template shr16<hi_shift - kP.lo>(top);
      }
      code = S::or_(code, S::and_(top, S::set1_i8(static_cast<char>(((1 << kP.hi) - 1) << kP.lo))));
    }
    return code;
  }

  // The one walk over a group's planes. for_each_chunk calls f(ch, j, n) for each chunk ch
  // of the group's first `count` codes: its first code is code j of the group, n of them in
  // it (chunk_codes, 16 or 32, but for a last chunk that `count` cuts short); for_each_quad
  // calls f(Q) (a std::integral_constant) for the quads of a chunk's n codes (n a multiple of
  // 4 here; a loop-invariant test once a quad); quad_of reads quad Q of chunk ch, vector x of
  // the NT tiles.
  // Every f here is CIM_INLINE_LAMBDA: without it GCC called fp32_group's per-quad body out
  // of line once a quad, the running sums through memory each time (fp32-mode decode at 2
  // and 3 bits 1.5x slower on a Zen 4, docs/widths.md).
  template <typename Fn>
  static CIM_INLINE void for_each_chunk(const PackedWeights& w, int64_t count, Fn&& f) {
    const int64_t per_chunk = chunk_codes(w.group_size);
    for (int64_t ch = 0, j = 0; j < count; ++ch, j += per_chunk) {
      f(ch, j, count - j < per_chunk ? count - j : per_chunk);
    }
  }
  template <typename Fn>
  static CIM_INLINE void for_each_quad(int64_t n, Fn&& f) {
    static_for<8>([&](auto qc) CIM_INLINE_LAMBDA {
      if (4 * decltype(qc)::value < n) f(qc);
    });
  }
  template <int Q, int NT>
  static CIM_INLINE I quad_of(const PackedWeights& w, const uint8_t* const (&blk)[NT], int64_t ch, int x) {
    return quad<Q>(blk[x / kVecs] + ch * chunk_bytes(kBits, w.group_size),
                   low_rows(kBits, w.group_size) * kCodeRowBytes, x % kVecs);
  }

  // fp32 mode: the group's codes k0 .. k0 + valid - 1 into the group sums t. A chunk past
  // the end of K reads A from a copy padded with zeros: every code's level is finite, so a
  // code past K adds 0 * level = +-0 to a sum, which keeps its bits (a sum that starts at +0
  // is never -0 under round-to-nearest; with flush-to-zero set, a sum flushed to -0 could
  // turn +0, which reaches an output only if its accumulator is zero too), and every chunk
  // runs the same inlined body. (A tested copy of the quads inlined beside it, a switch on the
  // codes left, took a kernel object's build from 108 s / 1.2 GB to 395 s / 3.2 GB,
  // docs/widths.md.)
  template <int NT, int R>
  static CIM_INLINE void fp32_group(const PackedWeights& w, const uint8_t* const (&blk)[NT],
                                    const float* const (&a)[R], int64_t k0, int64_t valid, F (&t)[R][NT * kVecs]) {
    F levels = S::zero();
    if constexpr (kPermute) levels = S::level_table(w.levels.q);
    const int64_t per_chunk = chunk_codes(w.group_size);
    for_each_chunk(w, valid, [&](int64_t ch, int64_t j, int64_t n) CIM_INLINE_LAMBDA {
      const float* ak[R];
      alignas(64) float pad[R][32];
      for (int r = 0; r < R; ++r) {
        ak[r] = a[r] + k0 + j;
        if (n < per_chunk) {
          for (int64_t i = 0; i < 32; ++i) pad[r][i] = i < n ? ak[r][i] : 0.0f;
          ak[r] = pad[r];
        }
      }
      for_each_quad(per_chunk, [&](auto qc) CIM_INLINE_LAMBDA {
        constexpr int Q = decltype(qc)::value;
        I codes[NT * kVecs];
        fp32_codes<Q, NT>(w, blk, ch, codes);
        fp32_quad<NT, R>(codes, levels, ak, 4 * Q, t);
      });
    });
  }

  // Quad Q of chunk ch as fp32_quad takes it: kPermute, the codes; else XOR o turns each
  // code c into the kBits-bit two's complement of c - o.
  template <int Q, int NT>
  static CIM_INLINE void fp32_codes(const PackedWeights& w, const uint8_t* const (&blk)[NT], int64_t ch,
                                    I (&codes)[NT * kVecs]) {
    for (int x = 0; x < NT * kVecs; ++x) {
      codes[x] = quad_of<Q>(w, blk, ch, x);
      if constexpr (!kPermute) codes[x] = S::xor_(codes[x], S::set1_i8(static_cast<char>(kOffset)));
    }
  }

  // A quad's codes (k = k .. k + 3): kPermute, byte B shifted to the bottom of the lane
  // indexes the levels (its bits above the code are zero); else byte B shifted to the top,
  // an arithmetic shift down sign-extends its kBits to q, convert (all exact).
  template <int NT, int R>
  static CIM_INLINE void fp32_quad(const I (&codes)[NT * kVecs], F levels, const float* const (&a)[R], int64_t k,
                                   F (&t)[R][NT * kVecs]) {
    static_for<4>([&](auto bc) CIM_INLINE_LAMBDA {
      constexpr int B = decltype(bc)::value;
      constexpr int up = 32 - 8 * B - kBits;
      F wv[NT * kVecs];
      for (int x = 0; x < NT * kVecs; ++x) {
        I c = codes[x];
        if constexpr (kPermute) {
          if constexpr (B > 0) c = S::template shr32<8 * B>(c);
          wv[x] = S::level_of(c, levels);
        } else {
          if constexpr (up > 0) c = S::template shl32<up>(c);
          wv[x] = S::cvt(S::template sar32<32 - kBits>(c));
        }
      }
      for (int r = 0; r < R; ++r) {
        const F av = S::set1(a[r][k + B]);
        for (int x = 0; x < NT * kVecs; ++x) t[r][x] = S::fma(av, wv[x], t[r][x]);
      }
    });
  }

  // int8 mode at M = 1, vector x of the NT tiles alone (tile_kernels.h's int8_narrow):
  // the whole group into d, the quads' int16 pair sums flushed every kFlush quads
  // (pair_steps: never saturating), 8-bit codes one dot4_u8 per quad.
  static constexpr int kFlush = pair_steps(kBits) < 8 ? pair_steps(kBits) : 8;  // 8, 4 or 2 (0: 8-bit, unused)
  template <int NT>
  static CIM_INLINE I int8_vector(const PackedWeights& w, const uint8_t* const (&blk)[NT], const int8_t* q, int x,
                                  I d) {
    for_each_chunk(w, w.group_size, [&](int64_t ch, int64_t j, int64_t n) CIM_INLINE_LAMBDA {
      I s = S::zero_i();
      for_each_quad(n, [&](auto qc) CIM_INLINE_LAMBDA {
        constexpr int Q = decltype(qc)::value;
        const I codes = unsigned_u(w, quad_of<Q>(w, blk, ch, x));
        const I qv = S::set1_i32(load_i32(q + j + 4 * Q));
        if constexpr (kBits == 8) {
          d = S::dot4_u8(d, codes, qv);
        } else {
          s = S::pair_dot(s, codes, qv);
          if constexpr ((Q + 1) % kFlush == 0) {
            d = S::pair_flush(d, s);
            s = S::zero_i();
          }
        }
      });
      if constexpr (kBits != 8) {
        if (n < 4 * kFlush) d = S::pair_flush(d, s);  // a short chunk (group size 16)
      }
    });
    return d;
  }

  // int8 mode: the whole group (A's int8 copy is 0 past K, whatever the codes there) into d,
  // chunk by chunk: each chunk's quads into sums of their own, started at zero and added to
  // d once (integer sums: the same bits). Against quads added into d one by one: 2- and
  // 3-bit decode with float32 / float16 scales faster on a Zen 4, int8 scales level
  // (docs/widths.md).
  template <int NT, int R>
  static CIM_INLINE void int8_group(const PackedWeights& w, const uint8_t* const (&blk)[NT],
                                    const int8_t* const (&q)[R], int64_t k0, I (&d)[R][NT * kVecs]) {
    constexpr int V = NT * kVecs;
    for_each_chunk(w, w.group_size, [&](int64_t ch, int64_t j, int64_t n) CIM_INLINE_LAMBDA {
      I s[R][V];
      for (int r = 0; r < R; ++r)
        for (int x = 0; x < V; ++x) s[r][x] = S::zero_i();
      for_each_quad(n, [&](auto qc) CIM_INLINE_LAMBDA {
        constexpr int Q = decltype(qc)::value;
        I codes[V];
        for (int x = 0; x < V; ++x) codes[x] = unsigned_u(w, quad_of<Q>(w, blk, ch, x));
        for (int r = 0; r < R; ++r) {
          const I qv = S::set1_i32(load_i32(q[r] + k0 + j + 4 * Q));
          for (int x = 0; x < V; ++x) {
            if constexpr (kBits == 8) {
              s[r][x] = S::dot4_u8(s[r][x], codes[x], qv);
            } else {
              s[r][x] = S::dot4(s[r][x], codes[x], qv);
            }
          }
        }
      });
      for (int r = 0; r < R; ++r)
        for (int x = 0; x < V; ++x) d[r][x] = S::add_i32(d[r][x], s[r][x]);
    });
  }
};

// f(PlaneKernels<S, kBits, table>{}): with the level table where the node's grid needs one.
template <class S, int kBits, class Fn>
CIM_INLINE void with_planes(const PackedWeights& w, Fn&& f) {
  if constexpr (kBits <= kLevelBits) {
    if (!w.levels.uniform) {
      f(PlaneKernels<S, kBits, true>{});
      return;
    }
  }
  f(PlaneKernels<S, kBits, false>{});
}

}  // namespace
}  // namespace cim

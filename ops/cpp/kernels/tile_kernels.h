// The SIMD kernel skeleton, written once over a small traits type S (simd_avx2.h,
// simd_avx512.h) and instantiated in each instruction set's own translation unit.
//
// Everything here has internal linkage (an unnamed namespace): each translation unit is
// compiled with its own -m flags, and an inline function or template with external
// linkage would be merged by the linker into one copy, possibly the AVX-512 one, then
// called on a CPU without AVX-512.
//
// Layout (kernel.h): channels in the vector lanes, 16 per tile (S::kLanes per vector,
// kVecs = 16 / S::kLanes vectors per tile). Both compute modes perform, per output, the
// arithmetic of the portable kernel and ops/reference.py's `emulate`, so every path,
// block shape, M and N split gives the same bits (o = 2^(bits-1), 8 for 4-bit codes;
// float16 scales are converted exactly, vcvtph2ps; int8 ones, vpmovsxbd + vcvtdq2ps, times
// their float32 super-scale / 128, an exact product: scales_of):
//   fp32: per group  t = fma(a_k, c_k - o, t) for k in order;  acc = fma(t, scale, acc)
//   int8: per group  d = -o * sum q_k + sum q_k c_k (vpdpbusd, exact);  acc = fma(d, a_scale * scale, acc)
// (widths up to kLevelBits: the codes' levels from the node's table, plane_kernels.h)
// 4-bit codes run the loops below, tuned per core (variants.h); the other widths unpack
// their planes (kernel.h) a quad of codes at a time (plane_kernels.h) in the same skeleton.
// Loops, outer to inner:
//   decode (M = 1): the 4 tiles of a strip side by side (independent FMA / vpdpbusd
//     chains hide their latency), the stream read once, front to back.
//   prefill (M > 1): prefill_kernels.h, over `block` below or its own panel loops.
#pragma once

#include <xmmintrin.h>  // _mm_prefetch (SSE, in every x86-64 baseline)

#include <cstdint>
#include <cstring>

#include "kernels/kernel.h"
#include "kernels/pair_kernels.h"
#include "kernels/plane_kernels.h"
#include "kernels/simd_util.h"

namespace cim {
namespace {

// A prefetch hint of ours beside _MM_HINT_T0 / _MM_HINT_NTA: T0 at the loop's distance
// and T1 (L2) kL2Ahead ahead as well (TileKernels::prefetch_ahead).
constexpr int kHintT0L2 = 0x100;

template <class S>
struct TileKernels {
  using F = typename S::F;
  using I = typename S::I;
  static constexpr int kVecs = int(kTileN) / S::kLanes;
  static constexpr int kVecBytes = S::kLanes * 4;

  // Pointers to the first code row of group g of tiles t0 .. t0 + NT - 1.
  template <int NT>
  static CIM_INLINE void blocks_of(const PackedWeights& w, int64_t t0, int64_t g, const uint8_t* (&blk)[NT],
                                   const uint8_t* (&scl)[NT]) {
    for (int i = 0; i < NT; ++i) {
      blk[i] = w.block(t0 + i, g);
      scl[i] = w.scales(t0 + i, g);
    }
  }

  // Software prefetch `ahead` bytes ahead in the stream (none for 0), the span of the NT
  // blocks just read, with `hint` (_MM_HINT_T0, _MM_HINT_NTA or kHintT0L2). The loops do
  // several operations per byte, so the out-of-order window alone may hold too few cache
  // misses to stream from DRAM at full speed; how far ahead is best differs by core, so decode
  // takes it as a parameter (variants.h) and prefill keeps these distances, measured on
  // Zen 5 (A/B in one interleaved run, 16 cold 4096x4096 layers, M = 1): fp32 mode 12 KiB
  // (13-15% faster than 6 KiB); int8 mode 6 KiB. Past the end of the stream a prefetch
  // touches nothing (prefetches never fault).
  // kHintT0L2 (defined above; the widths' 4-tile int8 loops take it, variants.h) prefetches
  // kL2Ahead bytes ahead into L2 (_MM_HINT_T1) first, then `ahead` bytes ahead with
  // _MM_HINT_T0 (far first ran faster; with `ahead` 0, neither). Those loops read each
  // group's planes with dozens of loads a group (a quad of each tile, each plane), and on a
  // Zen 4 their speed from DRAM hung on where their code sat (6-bit codes: about 0.47 or 0.82
  // of the read probe as 16-byte shifts of the code moved it; docs/widths.md), which points at
  // the core's per-instruction (IP-indexed) stride prefetcher; a prefetch into L2 does not
  // depend on it.
  static constexpr int64_t kPrefetchFp32 = 12288;
  static constexpr int64_t kPrefetchInt8 = 6144;
  static constexpr int64_t kL2Ahead = 32768;
  template <int NT, int64_t ahead, int hint>
  static CIM_INLINE void prefetch_ahead(const PackedWeights& w, const uint8_t* const (&blk)[NT]) {
    if constexpr (ahead > 0) {
      if constexpr (hint == kHintT0L2) prefetch_span<NT, _MM_HINT_T1>(w, blk, kL2Ahead);
      prefetch_span<NT, hint == kHintT0L2 ? int(_MM_HINT_T0) : hint>(w, blk, ahead);
    }
  }
  template <int NT, int hint>
  static CIM_INLINE void prefetch_span(const PackedWeights& w, const uint8_t* const (&blk)[NT], int64_t ahead) {
    static_assert(hint >= _MM_HINT_NTA && hint <= _MM_HINT_T0, "a hint _mm_prefetch takes (not kHintT0L2)");
    const uintptr_t base = reinterpret_cast<uintptr_t>(blk[0]) + static_cast<uintptr_t>(ahead);
    for (int64_t off = 0; off < NT * w.block_bytes; off += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(base + static_cast<uintptr_t>(off)), static_cast<_mm_hint>(hint));
    }
  }

  // Group g (of a pass from group g0) of tiles t0 .. t0 + NT - 1: its codes and scales
  // (blocks_of), the prefetch kAhead bytes ahead, and with int8 scales the run's
  // super-scales into `run` when g starts a run (the pass's first run is the caller's).
  template <int NT, int kSc, int64_t kAhead, int kHint>
  static CIM_INLINE void enter_group(const PackedWeights& w, int64_t t0, int64_t g, int64_t g0,
                                     const uint8_t* (&blk)[NT], const uint8_t* (&scl)[NT], float* run) {
    blocks_of<NT>(w, t0, g, blk, scl);
    prefetch_ahead<NT, kAhead, kHint>(w, blk);
    if constexpr (kSc == kScaleI8) {
      if (g != g0 && g % kSuperGroups == 0) super_steps<NT>(w, t0, g, run);
    }
  }

  // int8 scales: the super-scales / 128 (exact) of group g's run, vector x of tiles t0 ...
  static CIM_INLINE F super_step(const PackedWeights& w, int64_t t0, int64_t g, int x) {
    return S::mul(S::load_f16(w.super_of(t0 + x / kVecs, g) + (x % kVecs) * S::kLanes * 2),
                  S::set1(1.0f / kInt8ScaleOne));
  }
  // ... and all NT * kVecs vectors of them into `run`, once per run of kSuperGroups groups.
  template <int NT>
  static CIM_INLINE void super_steps(const PackedWeights& w, int64_t t0, int64_t g, float* run) {
    for (int x = 0; x < NT * kVecs; ++x) S::store(run + x * S::kLanes, super_step(w, t0, g, x));
  }

  // The scales of group g of tiles t0 .. t0 + NT - 1, vector x of NT * kVecs (float16 and
  // int8 ones converted in registers; an int8 scale times its super-scale / 128 is exact).
  // `run` (int8 scales, optional): the super-scales / 128 of g's run, as super_steps wrote them.
  // `scl`: the NT tiles' scales of group g (blocks_of).
  template <int NT, int kSc>
  static CIM_INLINE F scales_of(const PackedWeights& w, const uint8_t* const (&scl)[NT], int64_t t0, int64_t g, int x,
                                const float* run = nullptr) {
    const uint8_t* s = scl[x / kVecs];
    if constexpr (kSc == kScaleI8) {
      const F d = run != nullptr ? S::load(run + x * S::kLanes) : super_step(w, t0, g, x);
      return S::mul(S::load_i8(s + (x % kVecs) * S::kLanes), d);
    } else if constexpr (kSc == kScaleF16) {
      return S::load_f16(s + (x % kVecs) * S::kLanes * 2);
    } else {
      return S::load(reinterpret_cast<const float*>(s) + (x % kVecs) * S::kLanes);
    }
  }

  template <int NT>
  static CIM_INLINE I code_row(const uint8_t* const (&blk)[NT], int64_t v, int x) {
    return S::loadi(blk[x / kVecs] + v * kCodeRowBytes + (x % kVecs) * kVecBytes);
  }

  // How many of the NT * 16 channels from n0 on exist (the last tile may be partial).
  template <int NT>
  static CIM_INLINE int64_t channels_below_n(const PackedWeights& w, int64_t n0) {
    return w.N - n0 < NT * kTileN ? w.N - n0 : NT * kTileN;
  }

  // Groups [g0, g1) of one block: the accumulators start at zero for the first groups,
  // else from the partial sums an earlier K block left in Y (stored and reloaded
  // exactly, so the arithmetic is that of one pass over K); after the last groups the
  // bias is added. Y is only touched for the channels of tiles t0 .. t0 + NT - 1 below N.
  template <int NT, int R>
  static CIM_INLINE void load_acc(const MatMulArgs& args, int64_t t0, int64_t m0, int64_t g0,
                                  F (&acc)[R][NT * kVecs]) {
    const int64_t n0 = t0 * kTileN;
    const int64_t valid = channels_below_n<NT>(*args.W, n0);
    for (int r = 0; r < R; ++r) {
      const float* y = args.Y + (m0 + r) * args.ldy + n0;
      if (g0 == 0) {
        for (int x = 0; x < NT * kVecs; ++x) acc[r][x] = S::zero();
      } else if (valid == NT * kTileN) {
        for (int x = 0; x < NT * kVecs; ++x) acc[r][x] = S::load(y + x * S::kLanes);
      } else {
        alignas(64) float tmp[NT * kTileN] = {};
        std::memcpy(tmp, y, static_cast<size_t>(valid) * sizeof(float));
        for (int x = 0; x < NT * kVecs; ++x) acc[r][x] = S::load(tmp + x * S::kLanes);
      }
    }
  }

  template <int NT, int R>
  static CIM_INLINE void store_acc(const MatMulArgs& args, int64_t t0, int64_t m0, int64_t g1,
                                   F (&acc)[R][NT * kVecs]) {
    const PackedWeights& w = *args.W;
    const int64_t n0 = t0 * kTileN;
    const int64_t valid = channels_below_n<NT>(w, n0);
    const bool add_bias = w.bias != nullptr && g1 == w.groups;
    for (int r = 0; r < R; ++r) {
      float* y = args.Y + (m0 + r) * args.ldy + n0;
      alignas(64) float tmp[NT * kTileN];
      float* out = valid == NT * kTileN ? y : tmp;
      for (int x = 0; x < NT * kVecs; ++x) {
        F v = acc[r][x];
        if (add_bias) v = S::add(v, S::load(w.bias + n0 + x * S::kLanes));
        S::store(out + x * S::kLanes, v);
      }
      if (out == tmp) std::memcpy(y, tmp, static_cast<size_t>(valid) * sizeof(float));
    }
  }

  // ---- fp32 mode ---------------------------------------------------------------------

  // The first J codes of code row v (k = k0 .. k0 + J - 1) into the group sums.
  template <int NT, int R, int J>
  static CIM_INLINE void fp32_row(const uint8_t* const (&blk)[NT], int64_t v, const float* const (&a)[R], int64_t k0,
                                  F (&t)[R][NT * kVecs]) {
    I row[NT * kVecs];
    for (int x = 0; x < NT * kVecs; ++x) row[x] = S::fp32_codes(code_row<NT>(blk, v, x));
    static_for<J>([&](auto jc) CIM_INLINE_LAMBDA {
      constexpr int j = decltype(jc)::value;
      F wv[NT * kVecs];
      for (int x = 0; x < NT * kVecs; ++x) wv[x] = S::template code_minus_8<j>(row[x]);
      for (int r = 0; r < R; ++r) {
        const F av = S::set1(a[r][k0 + j]);
        for (int x = 0; x < NT * kVecs; ++x) t[r][x] = S::fma(av, wv[x], t[r][x]);
      }
    });
  }

  // Group g's sums t (zeroed here) of NT tiles' code rows against R rows of A, k0 = g's first k.
  template <int kBits, int NT, int R>
  static CIM_INLINE void fp32_group(const PackedWeights& w, const uint8_t* const (&blk)[NT], const float* const (&a)[R],
                                    int64_t g, F (&t)[R][NT * kVecs]) {
    for (int r = 0; r < R; ++r)
      for (int x = 0; x < NT * kVecs; ++x) t[r][x] = S::zero();
    const int64_t k0 = g * w.group_size;
    const int64_t valid = w.K - k0 < w.group_size ? w.K - k0 : w.group_size;  // only k < K is read
    if constexpr (kBits == 4) {
      int64_t v = 0;
      for (; 8 * v + 8 <= valid; ++v) fp32_row<NT, R, 8>(blk, v, a, k0 + 8 * v, t);
      switch (valid - 8 * v) {  // the tail of K: codes past it are 8 (q = 0), A has no values there
        case 7: fp32_row<NT, R, 7>(blk, v, a, k0 + 8 * v, t); break;
        case 6: fp32_row<NT, R, 6>(blk, v, a, k0 + 8 * v, t); break;
        case 5: fp32_row<NT, R, 5>(blk, v, a, k0 + 8 * v, t); break;
        case 4: fp32_row<NT, R, 4>(blk, v, a, k0 + 8 * v, t); break;
        case 3: fp32_row<NT, R, 3>(blk, v, a, k0 + 8 * v, t); break;
        case 2: fp32_row<NT, R, 2>(blk, v, a, k0 + 8 * v, t); break;
        case 1: fp32_row<NT, R, 1>(blk, v, a, k0 + 8 * v, t); break;
        default: break;
      }
    } else {
      with_planes<S, kBits>(w, [&](auto p) CIM_INLINE_LAMBDA {
        decltype(p)::template fp32_group<NT, R>(w, blk, a, k0, valid, t);
      });
    }
  }

  template <int kBits, int kSc, int NT, int R, int64_t kAhead = kPrefetchFp32, int kHint = _MM_HINT_T0>
  static void fp32_block(const MatMulArgs& args, int64_t t0, int64_t m0, int64_t g0, int64_t g1) {
    const PackedWeights& w = *args.W;
    F acc[R][NT * kVecs];
    load_acc<NT, R>(args, t0, m0, g0, acc);
    const float* a[R];
    for (int r = 0; r < R; ++r) a[r] = args.A + (m0 + r) * args.lda;
    alignas(64) float run[NT * kTileN];  // int8 scales: the run's super-scales / 128
    if constexpr (kSc == kScaleI8) super_steps<NT>(w, t0, g0, run);
    const float* run_or_null = kSc == kScaleI8 ? run : nullptr;
    for (int64_t g = g0; g < g1; ++g) {
      const uint8_t* blk[NT];
      const uint8_t* scl[NT];
      enter_group<NT, kSc, kAhead, kHint>(w, t0, g, g0, blk, scl, run);
      F t[R][NT * kVecs];
      fp32_group<kBits, NT, R>(w, blk, a, g, t);
      for (int x = 0; x < NT * kVecs; ++x) {
        const F s = scales_of<NT, kSc>(w, scl, t0, g, x, run_or_null);
        for (int r = 0; r < R; ++r) acc[r][x] = S::fma(t[r][x], s, acc[r][x]);
      }
    }
    store_acc<NT, R>(args, t0, m0, g1, acc);
  }

  // M = 1, kStrips whole strips of NT tiles at once (tiles t0, t0 + stride, ...), a group of
  // each in turn: as many streams in flight (int8_narrow's kStrips in fp32 mode); each output
  // gets fp32_block's float operations in the same order.
  template <int kBits, int kSc, int NT, int64_t kAhead, int kHint, int kStrips>
  static void fp32_strips(const MatMulArgs& args, int64_t t0, int64_t stride) {
    const PackedWeights& w = *args.W;
    F acc[kStrips][1][NT * kVecs];
    alignas(64) float run[kStrips][NT * kTileN];  // int8 scales: each strip's run's super-scales / 128
    for (int s = 0; s < kStrips; ++s) {
      load_acc<NT, 1>(args, t0 + s * stride, 0, 0, acc[s]);
      if constexpr (kSc == kScaleI8) super_steps<NT>(w, t0 + s * stride, 0, run[s]);
    }
    const float* const a[1] = {args.A};
    for (int64_t g = 0; g < w.groups; ++g) {
      for (int s = 0; s < kStrips; ++s) {
        const int64_t ts = t0 + s * stride;
        const uint8_t* blk[NT];
        const uint8_t* scl[NT];
        enter_group<NT, kSc, kAhead, kHint>(w, ts, g, 0, blk, scl, run[s]);
        F t[1][NT * kVecs];
        fp32_group<kBits, NT, 1>(w, blk, a, g, t);
        for (int x = 0; x < NT * kVecs; ++x) {
          const F sc = scales_of<NT, kSc>(w, scl, ts, g, x, kSc == kScaleI8 ? run[s] : nullptr);
          acc[s][0][x] = S::fma(t[0][x], sc, acc[s][0][x]);
        }
      }
    }
    for (int s = 0; s < kStrips; ++s) store_acc<NT, 1>(args, t0 + s * stride, 0, w.groups, acc[s]);
  }

  // ---- int8 mode ---------------------------------------------------------------------

  // What a group's integer dot starts from, per unit of sum(qa): the u8 value of q = 0
  // (2^(bits-1); a level table's own, kernel.h's CodeLevels).
  template <int kBits>
  static CIM_INLINE int32_t int8_zero(const PackedWeights& w) {
    if constexpr (kBits <= kLevelBits) {
      return w.levels.zero;
    } else {
      return int32_t(1) << (kBits - 1);
    }
  }

  // Code row v (codes k0 + 8v .. k0 + 8v + 7) of the NT blocks against R rows of int8 A:
  // f(r, x, lo, q_lo, hi, q_hi) per row r and vector x, where lane c of lo / hi holds codes
  // 8v .. 8v + 3 / 8v + 4 .. 8v + 7 of channel c and q_lo / q_hi the four activations of each.
  template <int NT, int R, class Fn>
  static CIM_INLINE void int8_row(const uint8_t* const (&blk)[NT], int64_t v, const int8_t* const (&q)[R], int64_t k0,
                                  Fn&& f) {
    I lo[NT * kVecs], hi[NT * kVecs];
    for (int x = 0; x < NT * kVecs; ++x) {
      const I row = code_row<NT>(blk, v, x);
      lo[x] = S::low_nibbles(row);
      hi[x] = S::high_nibbles(row);
    }
    for (int r = 0; r < R; ++r) {
      const I q_lo = S::set1_i32(load_i32(q[r] + k0 + 8 * v));
      const I q_hi = S::set1_i32(load_i32(q[r] + k0 + 8 * v + 4));
      for (int x = 0; x < NT * kVecs; ++x) f(r, x, lo[x], q_lo, hi[x], q_hi);
    }
  }

  template <int kBits, int kSc, int NT, int R, int64_t kAhead = kPrefetchInt8, int kHint = _MM_HINT_T0>
  static void int8_block(const MatMulArgs& args, int64_t t0, int64_t m0, int64_t g0, int64_t g1) {
    const PackedWeights& w = *args.W;
    const QuantizedA& qa = *args.QA;
    const int64_t k_padded = w.groups * w.group_size;
    F acc[R][NT * kVecs];
    load_acc<NT, R>(args, t0, m0, g0, acc);
    const int8_t* q[R];
    for (int r = 0; r < R; ++r) q[r] = qa.q + (m0 + r) * k_padded;
    alignas(64) float run[NT * kTileN];  // int8 scales: the run's super-scales / 128
    if constexpr (kSc == kScaleI8) super_steps<NT>(w, t0, g0, run);
    const float* run_or_null = kSc == kScaleI8 ? run : nullptr;
    for (int64_t g = g0; g < g1; ++g) {
      const uint8_t* blk[NT];
      const uint8_t* scl[NT];
      enter_group<NT, kSc, kAhead, kHint>(w, t0, g, g0, blk, scl, run);
      I d[R][NT * kVecs];
      for (int r = 0; r < R; ++r) {
        const I z = S::set1_i32(-int8_zero<kBits>(w) * qa.qsum[(m0 + r) * w.groups + g]);
        for (int x = 0; x < NT * kVecs; ++x) d[r][x] = z;
      }
      const int64_t k0 = g * w.group_size;
      if constexpr (kBits == 4) {
        for (int64_t v = 0; v < w.group_size / 8; ++v) {
          int8_row<NT, R>(blk, v, q, k0, [&](int r, int x, I lo, I q_lo, I hi, I q_hi) CIM_INLINE_LAMBDA {
            d[r][x] = S::dot4(S::dot4(d[r][x], lo, q_lo), hi, q_hi);
          });
        }
      } else {
        with_planes<S, kBits>(w, [&](auto p) CIM_INLINE_LAMBDA {
          decltype(p)::template int8_group<NT, R>(w, blk, q, k0, d);
        });
      }
      for (int x = 0; x < NT * kVecs; ++x) {
        const F s = scales_of<NT, kSc>(w, scl, t0, g, x, run_or_null);
        for (int r = 0; r < R; ++r) {
          const F scale = S::mul(S::set1(qa.scale[(m0 + r) * w.groups + g]), s);
          acc[r][x] = S::fma(S::cvt(d[r][x]), scale, acc[r][x]);
        }
      }
    }
    store_acc<NT, R>(args, t0, m0, g1, acc);
  }

  // int8 mode, M = 1, one vector of channels at a time ("n" variants): for each group,
  // each vector of the NT tiles runs through the group's code rows alone and its sum
  // waits in L1 (`sums`) between groups. The NT * kVecs accumulators of int8_block then
  // need no registers: with 16 (AVX2) they and the group's int32 sums do not fit and spill
  // inside the loop. Without VNNI the products go through int16 pair sums (pair_dot). The
  // integer sums are exact in any order, and each output gets the same float operations
  // in the same order as in int8_block.
  template <int kBits, int kSc, int NT, int64_t kAhead, int kHint, int kStrips = 1>
  static void int8_narrow(const MatMulArgs& args, int64_t t0, int64_t stride = NT) {
    const PackedWeights& w = *args.W;
    const QuantizedA& qa = *args.QA;
    // Per strip s (tiles t0 + s * stride ..): its sums, its chunks' partial sums (4-bit codes,
    // group sizes over 32) and, with int8 scales, its run's super-scales / 128.
    alignas(64) float sums[kStrips][NT * kTileN] = {};
    alignas(64) int32_t partial[kStrips][NT * kTileN];
    alignas(64) float run[kStrips][NT * kTileN];
    if constexpr (kSc == kScaleI8) {
      for (int s = 0; s < kStrips; ++s) super_steps<NT>(w, t0 + s * stride, 0, run[s]);
    }
    const int64_t chunks = w.group_size / 32;
    for (int64_t g = 0; g < w.groups; ++g) {
      const int8_t* q = qa.q + g * w.group_size;
      const I z = S::set1_i32(-int8_zero<kBits>(w) * qa.qsum[g]);
      const F a_scale = S::set1(qa.scale[g]);
      for (int s = 0; s < kStrips; ++s) {  // kStrips streams in flight, a group of each in turn
        const int64_t ts = t0 + s * stride;
        const float* run_or_null = kSc == kScaleI8 ? run[s] : nullptr;
        const uint8_t* blk[NT];
        const uint8_t* scl[NT];
        enter_group<NT, kSc, kAhead, kHint>(w, ts, g, 0, blk, scl, run[s]);
        if constexpr (kBits == 4) {
          if (chunks == 0) {  // group size 16: two code rows
            narrow_chunk<kSc, NT, 2>(w, blk, scl, ts, g, run_or_null, q, 0, z, a_scale, true, true, partial[s],
                                     sums[s]);
          } else {
            for (int64_t c = 0; c < chunks; ++c) {
              narrow_chunk<kSc, NT, 4>(w, blk, scl, ts, g, run_or_null, q + 32 * c, 4 * c, z, a_scale, c == 0,
                                       c == chunks - 1, partial[s], sums[s]);
            }
          }
        } else {
          with_planes<S, kBits>(w, [&](auto p) CIM_INLINE_LAMBDA {
            static_for<NT * kVecs>([&](auto xc) CIM_INLINE_LAMBDA {
              constexpr int x = decltype(xc)::value;
              const I d = decltype(p)::template int8_vector<NT>(w, blk, q, x, z);
              narrow_store<kSc, NT>(w, scl, ts, g, run_or_null, x, d, a_scale, sums[s]);
            });
          });
        }
      }
    }
    for (int s = 0; s < kStrips; ++s) {
      F acc[1][NT * kVecs];
      for (int x = 0; x < NT * kVecs; ++x) acc[0][x] = S::load(sums[s] + x * S::kLanes);
      store_acc<NT, 1>(args, t0 + s * stride, 0, w.groups, acc);
    }
  }

  // A group's integer sums d of vector x through the scales into `sums`.
  template <int kSc, int NT>
  static CIM_INLINE void narrow_store(const PackedWeights& w, const uint8_t* const (&scl)[NT], int64_t t0, int64_t g,
                                      const float* run, int x, I d, F a_scale, float* sums) {
    const F scale = S::mul(a_scale, scales_of<NT, kSc>(w, scl, t0, g, x, run));
    S::store(sums + x * S::kLanes, S::fma(S::cvt(d), scale, S::load(sums + x * S::kLanes)));
  }

  // kRows code rows (8 * kRows codes, at most pair_steps(4) / 2 rows per flush) from row v0
  // of the NT blocks, activations q; the first chunk of a group starts from z, the last
  // one's sums go through the scales into `sums`.
  template <int kSc, int NT, int kRows>
  static CIM_INLINE void narrow_chunk(const PackedWeights& w, const uint8_t* const (&blk)[NT],
                                      const uint8_t* const (&scl)[NT], int64_t t0, int64_t g,
                                      const float* run, const int8_t* q, int64_t v0, I z, F a_scale, bool first,
                                      bool last, int32_t* partial, float* sums) {
    static_assert(2 * kRows <= pair_steps(4), "int16 pair sums could saturate");
    I qv[2 * kRows];
    for (int r = 0; r < 2 * kRows; ++r) qv[r] = S::set1_i32(load_i32(q + 4 * r));
    static_for<NT * kVecs>([&](auto xc) CIM_INLINE_LAMBDA {
      constexpr int x = decltype(xc)::value;
      I s = S::zero_i();
      for (int r = 0; r < kRows; ++r) {
        const I row = code_row<NT>(blk, v0 + r, x);
        s = S::pair_dot(s, S::low_nibbles(row), qv[2 * r]);
        s = S::pair_dot(s, S::high_nibbles(row), qv[2 * r + 1]);
      }
      int32_t* p = partial + x * S::kLanes;
      const I d = S::pair_flush(first ? z : S::loadi(reinterpret_cast<const uint8_t*>(p)), s);
      if (last) {
        narrow_store<kSc, NT>(w, scl, t0, g, run, x, d, a_scale, sums);
      } else {
        S::storei(reinterpret_cast<uint8_t*>(p), d);
      }
    });
  }

  // ---- drivers -----------------------------------------------------------------------

  // The compile-time choices of one call: code width, scale type (ScaleType), compute mode.
  template <int kBitsArg, int kScArg, bool kInt8Arg>
  struct Form {
    static constexpr int kBits = kBitsArg;
    static constexpr int kSc = kScArg;
    static constexpr bool kInt8 = kInt8Arg;
  };

  template <class Fm, int NT, int R, int64_t kAhead = Fm::kInt8 ? kPrefetchInt8 : kPrefetchFp32,
            int kHint = _MM_HINT_T0>
  static CIM_INLINE void block(const MatMulArgs& args, int64_t t0, int64_t m0, int64_t g0, int64_t g1) {
    if constexpr (Fm::kInt8 && Fm::kBits == 4 && S::kPairDot) {
      PairKernels<S, TileKernels>::template block<Fm::kSc, NT, R, kAhead, kHint>(args, t0, m0, g0, g1);
    } else if constexpr (Fm::kInt8) {
      int8_block<Fm::kBits, Fm::kSc, NT, R, kAhead, kHint>(args, t0, m0, g0, g1);
    } else {
      fp32_block<Fm::kBits, Fm::kSc, NT, R, kAhead, kHint>(args, t0, m0, g0, g1);
    }
  }

  // M = 1: NT tiles side by side (NT = 4: a whole strip, its part of the stream read
  // once, front to back; NT = 2: each strip in two passes, the second from L2), with
  // software prefetch kAhead bytes ahead (0: none) and hint kHint (variants.h). The tiles
  // of a short last strip go one at a time: with the default prefetch, or with kNarrow
  // (int8 mode runs int8_narrow; fp32 mode ignores it) the variant's. kStrips = 2 (int8
  // mode with kNarrow, fp32 mode): two whole strips at once, a group of each in turn
  // (strip_pairs), while the range holds them; a strip left runs alone.
  template <class Fm, int NT, int64_t kAhead, int kHint, bool kNarrow = false, int kStrips = 1>
  static void decode(const MatMulArgs& args, int64_t tile_begin, int64_t tile_end) {
    const PackedWeights& w = *args.W;
    constexpr bool kNarrowInt8 = kNarrow && Fm::kInt8;
    auto strip = [&](int64_t t0) {
      if constexpr (kNarrowInt8) {
        int8_narrow<Fm::kBits, Fm::kSc, NT, kAhead, kHint>(args, t0);
      } else {
        block<Fm, NT, 1, kAhead, kHint>(args, t0, 0, 0, w.groups);
      }
    };
    int64_t t = tile_begin;
    if constexpr (kStrips > 1) {
      static_assert(kStrips == 2, "strips run in pairs");
      static_assert(kNarrowInt8 || !Fm::kInt8, "int8 mode pairs strips in its narrow loop only");
      t = strip_pairs<NT>(w, t, tile_end, strip, [&](int64_t t0, int64_t stride) {
        if constexpr (kNarrowInt8) {
          int8_narrow<Fm::kBits, Fm::kSc, NT, kAhead, kHint, 2>(args, t0, stride);
        } else {
          fp32_strips<Fm::kBits, Fm::kSc, NT, kAhead, kHint, 2>(args, t0, stride);
        }
      });
    }
    for (; t + NT <= tile_end; t += NT) strip(t);
    for (; t < tile_end; ++t) {  // a short last strip
      if constexpr (kNarrowInt8) {
        int8_narrow<Fm::kBits, Fm::kSc, 1, kAhead, kHint>(args, t);
      } else {
        block<Fm, 1, 1>(args, t, 0, 0, w.groups);
      }
    }
  }

  // The whole strips of tiles [t, tile_end) in pairs: pair(t0, stride) runs the strips at t0
  // and t0 + stride together, single(t0) one alone; returns the first tile after them. Long
  // strips pair with their neighbour. Short ones (a strip of at most kShortStrip bytes: K up
  // to 2048 at 4 bits, 2560 with int8 scales) pair across a window of up to kPairWindow
  // strips, strip i with strip i + half, so that each of the two streams runs on into the
  // strip after its last one: on an Intel Xeon (family 6 model 167) a neighbour pair of 18
  // KiB strips restarted both streams every 36 KiB, and SmolLM2's layers (K = 576, 1536)
  // decoded 1.09-1.13x faster paired across (kernel-only), K = 2048 1.03-1.05x, while strips
  // of K = 3072 and 4096 (104-139 KiB) ran 0.90-0.95x so (docs/tuning.md).
  static constexpr int64_t kShortStrip = 96 * 1024;
  static constexpr int64_t kPairWindow = 8;
  template <int NT, class Single, class Pair>
  static CIM_INLINE int64_t strip_pairs(const PackedWeights& w, int64_t t, int64_t tile_end, Single&& single,
                                        Pair&& pair) {
    const int64_t window = NT * w.block_bytes * w.groups <= kShortStrip ? kPairWindow : 2;
    for (int64_t n = (tile_end - t) / NT; n >= 2;) {
      const int64_t m = n < window ? n : window, half = (m + 1) / 2;
      for (int64_t i = 0; i + half < m; ++i) pair(t + i * NT, half * NT);
      if (m % 2 == 1) single(t + (half - 1) * NT);
      t += m * NT;
      n -= m;
    }
    return t;
  }

  // int8 mode's A, the same bits as quantize_a_portable: |a| maxima are exact in any
  // order, q = cvtps2dq(a * inv) rounds half to even like nearbyint (ORT keeps MXCSR's
  // default). Groups that are short, hold a NaN or an inf, or are all zero or tiny take
  // the portable routine.
  static void quantize_a(const float* A, int64_t M, int64_t lda, int64_t K, int64_t group_size, int8_t* q,
                         float* scale, int32_t* qsum) {
    const int64_t groups = (K + group_size - 1) / group_size;
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t g = 0; g < groups; ++g) {
        const float* a = A + m * lda + g * group_size;
        const int64_t len = g * group_size + group_size <= K ? group_size : K - g * group_size;
        int8_t* qg = q + (m * groups + g) * group_size;
        float* sg = scale + m * groups + g;
        int32_t* zg = qsum + m * groups + g;
        if (len == group_size && quantize_group(a, group_size, qg, sg, zg)) continue;
        quantize_group_portable(a, len, group_size, qg, sg, zg);
      }
    }
  }

  // One full group (a multiple of the vector width); false when the portable routine must decide.
  static CIM_INLINE bool quantize_group(const float* a, int64_t len, int8_t* q, float* scale, int32_t* qsum) {
    F amax_v = S::zero();
    bool finite = true;
    for (int64_t j = 0; j < len; j += S::kLanes) {
      const F x = S::load(a + j);
      finite = finite && S::all_finite(x);
      amax_v = S::max(amax_v, S::abs(x));
    }
    if (!finite) return false;
    const float amax = S::reduce_max(amax_v);
    const float inv = 127.0f / amax;
    if (amax == 0.0f || !(inv <= 3.4e38f)) return false;
    const F inv_v = S::set1(inv);
    I sum = S::set1_i32(0);
    for (int64_t j = 0; j < len; j += S::kLanes) {
      const I qi = S::round_i32(S::mul(S::load(a + j), inv_v));
      S::store_i8(q + j, qi);
      sum = S::add_i32(sum, qi);
    }
    *scale = amax / 127.0f;
    *qsum = S::reduce_add_i32(sum);
    return true;
  }

};

}  // namespace
}  // namespace cim

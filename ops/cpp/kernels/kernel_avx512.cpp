// AVX-512 kernels (F/BW/VL/DQ + FMA): FP32 activations times 4-bit weights.
//
// Only this file is compiled with the AVX-512 -m flags; dispatch.cpp calls in here only
// after CPUID and XCR0 say the CPU and OS run AVX-512, so no AVX-512 instruction is
// reached on a CPU without it.
//
// Three paths, by the number M of rows of A:
//   M = 1                 decode: each weight row streamed once, unpacked in registers
//   1 < M < kPanelMinM    the same per block of 4 rows of A
//   M >= kPanelMinM       each weight unpacked once per call into a small L1-resident
//                         panel that FP32 tiles of rows of A share (simd_common.h)
//
// Each output is computed by the same sequence of operations whatever the path and block
// shape, so results do not depend on how N is split into tasks, nor on M:
//   w_k = table_g[code_k]              table_g[c] = (c - 8) * scale_g, rounded once
//   acc = fma(a_k, w_k, acc)           16 lanes (lane = k mod 16), k ascending
//   y   = sum_lanes(acc) (+ bias)      a fixed tree
// Rounding each weight once adds at most 2^-24 |a_k w_k| per term to the usual
// dot-product bound, which keeps |y - exact| within (K + 2) 2^-24 sum_k |a_k w_k|.

// GCC 12's AVX-512 headers initialise "undefined" vectors as `__m512 __Y = __Y;`, which
// -Wmaybe-uninitialized reports at every use once inlined (GCC PR 105593, fixed in 13).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

#include <cstdint>
#include <cstring>

#include "kernels/kernel.h"
#include "kernels/simd_common.h"

namespace cim {
namespace {

#define CIM_INLINE inline __attribute__((always_inline))

// Register block for small prefill: each decoded weight vector feeds kRowsA rows of A
// and each A vector kRowsW weight rows. 4 x 4 keeps 16 accumulators, 8 weight vectors,
// 4 tables and 2 A vectors in the 32 zmm registers. (8 x 2 needs fewer unpacking uops
// on paper but measured no faster on Sapphire Rapids.)
constexpr int kRowsA = 4;
constexpr int kRowsW = 4;
// Decode (M = 1) has one row of A; more weight rows in flight hide the FMA latency of
// each row's single accumulator chain.
constexpr int kDecodeRowsW = 4;

// The 16 weights of one group for codes 0..15: (code - 8) * scale.
CIM_INLINE __m512 group_table(float scale) {
  const __m512 q = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
  return _mm512_mul_ps(q, _mm512_set1_ps(scale));
}

// 16 bytes of a 32-code unit -> its 32 weights. vpermps reads only bits 3:0 of each
// index, so the low nibble needs no mask.
//   idx (vpmovzxbd):  lane j = byte j          (j = 0..15)
//   lo  = table[idx]:      lane j = code j       (low nibble)
//   hi  = table[idx >> 4]: lane j = code j + 16  (high nibble)
CIM_INLINE void decode_unit32(const uint8_t* bytes, __m512 table, __m512& lo, __m512& hi) {
  const __m512i idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
  lo = _mm512_permutexvar_ps(idx, table);
  hi = _mm512_permutexvar_ps(_mm512_srli_epi32(idx, 4), table);
}

// 8 bytes of a 16-code unit -> its 16 weights.
//   the 8 bytes broadcast to both qwords:  [b0..b7 b0..b7]
//   idx (vpmovzxbd, then vpsrlvd by 0 | 4): lanes 0..7 = b_j, lanes 8..15 = b_j >> 4
//   table[idx]: lane j = code j (low nibbles, then high nibbles)
CIM_INLINE __m512 decode_unit16(const uint8_t* bytes, __m512 table) {
  uint64_t b;
  std::memcpy(&b, bytes, sizeof b);
  const __m512i shift = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 4, 4, 4, 4, 4, 4, 4, 4);
  const __m512i idx = _mm512_srlv_epi32(_mm512_cvtepu8_epi32(_mm_set1_epi64x(static_cast<long long>(b))), shift);
  return _mm512_permutexvar_ps(idx, table);
}

// Lanes 0..valid-1 set (valid <= 16).
CIM_INLINE __mmask16 first_lanes(int64_t valid) {
  return static_cast<__mmask16>((1u << valid) - 1u);
}

// acc[i][r] += A row i . W row r over the unit at k. For the tail unit only the first
// `valid` codes exist in A: masked loads keep reads inside A (and never fault), and
// masked FMAs leave the lanes past K untouched.
template <int kUnit, int RA, int RW, bool kTail>
CIM_INLINE void accumulate_unit(const float* const (&a)[RA], const uint8_t* const (&row)[RW],
                                const __m512 (&table)[RW], int64_t k, int64_t valid,
                                __m512 (&acc)[RA][RW]) {
  if constexpr (kUnit == 32) {
    __m512 lo[RW], hi[RW];
    for (int r = 0; r < RW; ++r) decode_unit32(row[r] + k / 2, table[r], lo[r], hi[r]);
    if constexpr (!kTail) {
      for (int i = 0; i < RA; ++i) {
        const __m512 a_lo = _mm512_loadu_ps(a[i] + k);
        const __m512 a_hi = _mm512_loadu_ps(a[i] + k + 16);
        for (int r = 0; r < RW; ++r) {
          acc[i][r] = _mm512_fmadd_ps(a_lo, lo[r], acc[i][r]);
          acc[i][r] = _mm512_fmadd_ps(a_hi, hi[r], acc[i][r]);
        }
      }
    } else {
      const __mmask16 m_lo = first_lanes(valid < 16 ? valid : 16);
      for (int i = 0; i < RA; ++i) {
        const __m512 a_lo = _mm512_maskz_loadu_ps(m_lo, a[i] + k);
        for (int r = 0; r < RW; ++r) acc[i][r] = _mm512_mask3_fmadd_ps(a_lo, lo[r], acc[i][r], m_lo);
      }
      if (valid > 16) {  // else the high half lies wholly past K: no pointer into it
        const __mmask16 m_hi = first_lanes(valid - 16);
        for (int i = 0; i < RA; ++i) {
          const __m512 a_hi = _mm512_maskz_loadu_ps(m_hi, a[i] + k + 16);
          for (int r = 0; r < RW; ++r) acc[i][r] = _mm512_mask3_fmadd_ps(a_hi, hi[r], acc[i][r], m_hi);
        }
      }
    }
  } else {
    static_assert(kUnit == 16, "units are 16 or 32 codes");
    __m512 wv[RW];
    for (int r = 0; r < RW; ++r) wv[r] = decode_unit16(row[r] + k / 2, table[r]);
    for (int i = 0; i < RA; ++i) {
      if constexpr (!kTail) {
        const __m512 av = _mm512_loadu_ps(a[i] + k);
        for (int r = 0; r < RW; ++r) acc[i][r] = _mm512_fmadd_ps(av, wv[r], acc[i][r]);
      } else {
        const __mmask16 m = first_lanes(valid);
        const __m512 av = _mm512_maskz_loadu_ps(m, a[i] + k);
        for (int r = 0; r < RW; ++r) acc[i][r] = _mm512_mask3_fmadd_ps(av, wv[r], acc[i][r], m);
      }
    }
  }
}

// Sum of the 16 lanes, always folding the upper half onto the lower one.
//   16 -> 8:  lanes j + (j + 8);  8 -> 4: j + (j + 4);  4 -> 2: j + (j + 2);  2 -> 1
CIM_INLINE float sum_lanes(__m512 v) {
  const __m256 s8 = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(s8), _mm256_extractf128_ps(s8, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

// Decode reads each weight byte once, from DRAM when the model outgrows the caches, and
// the hardware prefetcher alone keeps too few lines in flight (measured: 8 GB/s of 14
// available on one core). So while one block of 4 rows is computed, the next block is
// requested, one line per row each time a row of this block starts a new 64-byte line
// of codes (every 4 units of 32 codes, 8 units of 16), and likewise a line of scales in
// 4 of every 16 units.
struct NextBlock {
  const uint8_t* codes;  // row 0 of the next block
  const float* scales;   // its scales
  int64_t row_bytes;
  int64_t groups;
};

template <int kUnit>
CIM_INLINE void prefetch_next_block(const NextBlock& next, int64_t u, int64_t g) {
  constexpr int64_t kStep = 32 / kUnit;  // units between two code prefetches: 4 rows per line
  if (u % kStep == 0) {
    const int64_t r = (u / kStep) & 3;
    const int64_t line = (u * (kUnit / 2)) & ~int64_t{63};
    _mm_prefetch(reinterpret_cast<const char*>(next.codes + r * next.row_bytes + line), _MM_HINT_T0);
  }
  if ((u & 15) < 4) {
    _mm_prefetch(reinterpret_cast<const char*>(next.scales + (u & 3) * next.groups + (g & ~int64_t{15})),
                 _MM_HINT_T0);
  }
}

// acc[i][r] += A[m0 + i, k) . W[n0 + r, k) over k in [k_begin, k_end): k_begin is a
// multiple of the group size, k_end one too or K. `next`, if given, is prefetched.
template <int kUnit, int RA, int RW>
CIM_INLINE void accumulate_range(const MatMulArgs& args, int64_t m0, int64_t n0, int64_t k_begin, int64_t k_end,
                                 const NextBlock* next, __m512 (&acc)[RA][RW]) {
  const PackedWeights& w = *args.W;
  const float* a[RA];
  for (int i = 0; i < RA; ++i) a[i] = args.A + (m0 + i) * args.lda;
  const uint8_t* row[RW];
  const float* scale[RW];
  for (int r = 0; r < RW; ++r) {
    row[r] = w.nibbles + (n0 + r) * w.row_bytes;
    scale[r] = w.scales + (n0 + r) * w.groups;
  }
  __m512 table[RW];
  const int64_t units_per_group = w.group_size / kUnit;
  const int64_t full_end = k_end / kUnit;  // units wholly inside the range end here
  int64_t u = k_begin / kUnit;
  for (int64_t g = k_begin / w.group_size; u < full_end; ++g) {
    for (int r = 0; r < RW; ++r) table[r] = group_table(scale[r][g]);
    const int64_t group_end = u + units_per_group < full_end ? u + units_per_group : full_end;
    for (; u < group_end; ++u) {
      if (next != nullptr) prefetch_next_block<kUnit>(*next, u, g);
      accumulate_unit<kUnit, RA, RW, false>(a, row, table, u * kUnit, kUnit, acc);
    }
  }
  const int64_t tail = k_end - full_end * kUnit;
  if (tail > 0) {
    for (int r = 0; r < RW; ++r) table[r] = group_table(scale[r][full_end / units_per_group]);
    accumulate_unit<kUnit, RA, RW, true>(a, row, table, full_end * kUnit, tail, acc);
  }
}

// Y[m0 + i, n0 + r] = sum_lanes(acc[i][r]) (+ bias).
template <int RA, int RW>
CIM_INLINE void store_outputs(const MatMulArgs& args, int64_t m0, int64_t n0, const __m512 (&acc)[RA][RW]) {
  const float* bias = args.W->bias;
  for (int i = 0; i < RA; ++i) {
    float* y = args.Y + (m0 + i) * args.ldy + n0;
    for (int r = 0; r < RW; ++r) {
      float v = sum_lanes(acc[i][r]);
      if (bias != nullptr) v += bias[n0 + r];
      y[r] = v;
    }
  }
}

// Decode (M = 1): kDecodeRowsW weight rows side by side, each streamed once from start
// to end (the pattern hardware prefetchers follow best); the row of A stays in L1.
template <int kUnit, int RW>
void decode_block(const MatMulArgs& args, int64_t n0) {
  const PackedWeights& w = *args.W;
  NextBlock next{};
  const bool has_next = RW == 4 && n0 + 2 * RW <= w.N;  // prefetch_next_block assumes 4 rows
  if (has_next) {
    next = {w.nibbles + (n0 + RW) * w.row_bytes, w.scales + (n0 + RW) * w.groups, w.row_bytes, w.groups};
  }
  __m512 acc[1][RW];
  for (int r = 0; r < RW; ++r) acc[0][r] = _mm512_setzero_ps();
  accumulate_range<kUnit, 1, RW>(args, 0, n0, 0, w.K, has_next ? &next : nullptr, acc);
  store_outputs<1, RW>(args, 0, n0, acc);
}

template <int kUnit>
void matmul_decode(const MatMulArgs& args, int64_t n_begin, int64_t n_end) {
  static_assert(kDecodeRowsW == 4, "prefetch_next_block walks blocks of 4 rows");
  int64_t n = n_begin;
  for (; n + kDecodeRowsW <= n_end; n += kDecodeRowsW) decode_block<kUnit, kDecodeRowsW>(args, n);
  for (; n < n_end; ++n) decode_block<kUnit, 1>(args, n);
}

// Small prefill (1 < M < kPanelMinM): rows of A in blocks of kRowsA, K in chunks of
// kChunkK, so that a block's chunk of A (4 x 1024 floats = 16 KB) stays in L1 while
// every weight row of a panel of up to kPanelW rows passes over it. Between chunks a
// block's partial sums wait in `partial`, stored and reloaded exactly: each output
// still sees the operations of a single pass, in the same order.
constexpr int64_t kChunkK = 1024;  // a multiple of every group size
constexpr int64_t kPanelW = 32;
static_assert(kChunkK % 256 == 0, "chunks must not split a group");

template <int kUnit, int RA, int RW>
CIM_INLINE void prefill_block(const MatMulArgs& args, int64_t m0, int64_t n0, int64_t k_begin, int64_t k_end,
                              __m512 (*partial)[kRowsA]) {
  __m512 acc[RA][RW];
  for (int i = 0; i < RA; ++i) {
    for (int r = 0; r < RW; ++r) acc[i][r] = k_begin == 0 ? _mm512_setzero_ps() : partial[r][i];
  }
  accumulate_range<kUnit, RA, RW>(args, m0, n0, k_begin, k_end, nullptr, acc);
  if (k_end == args.W->K) {
    store_outputs<RA, RW>(args, m0, n0, acc);
  } else {
    for (int i = 0; i < RA; ++i) {
      for (int r = 0; r < RW; ++r) partial[r][i] = acc[i][r];
    }
  }
}

// A rows [m0, m0 + RA) against weight rows [p_begin, p_end), p_end - p_begin <= kPanelW.
template <int kUnit, int RA>
void prefill_panel(const MatMulArgs& args, int64_t m0, int64_t p_begin, int64_t p_end) {
  __m512 partial[kPanelW][kRowsA];
  const int64_t K = args.W->K;
  for (int64_t kc = 0; kc < K; kc += kChunkK) {
    const int64_t kc_end = kc + kChunkK < K ? kc + kChunkK : K;
    int64_t n = p_begin;
    for (; n + kRowsW <= p_end; n += kRowsW) {
      prefill_block<kUnit, RA, kRowsW>(args, m0, n, kc, kc_end, partial + (n - p_begin));
    }
    for (; n < p_end; ++n) prefill_block<kUnit, RA, 1>(args, m0, n, kc, kc_end, partial + (n - p_begin));
  }
}

template <int kUnit>
void matmul_prefill(const MatMulArgs& args, int64_t n_begin, int64_t n_end) {
  static_assert(kRowsA == 4, "the rows left after the blocks of 4 go as blocks of 2 and 1");
  for (int64_t p = n_begin; p < n_end; p += kPanelW) {
    const int64_t p_end = p + kPanelW < n_end ? p + kPanelW : n_end;
    int64_t m = 0;
    for (; m + kRowsA <= args.M; m += kRowsA) prefill_panel<kUnit, kRowsA>(args, m, p, p_end);
    if (args.M - m >= 2) {
      prefill_panel<kUnit, 2>(args, m, p, p_end);
      m += 2;
    }
    if (args.M - m >= 1) prefill_panel<kUnit, 1>(args, m, p, p_end);
  }
}

// Prefill (M >= kPanelMinM): the driver in simd_common.h, with each weight dequantized
// to its table value and tiles whose every output sees exactly the operations of decode:
// fma into lane k mod 16 in ascending k, the same lane sum.
// Below kPanelMinM the blocks above win: unpacking the weights into memory once costs
// about what 2 blocks of 4 rows of A unpacking them in registers do (measured on
// Sapphire Rapids: even at M = 8, 3.0 ms against 2.8 ms, K = N = 4096).
constexpr int64_t kPanelMinM = 10;
static_assert(kPanelMinM >= 4, "plan_tiles then gives tiles of 3 to 6 rows");

struct Avx512Prefill {
  static constexpr int kLanes = 16;
  static constexpr int kTileRows = 4;  // panel rows per tile kernel, for 4..6 rows of A
  static constexpr bool kShiftsChunks = true;

  // Not inlined: the driver's loops would take the registers this loop needs.
  template <int kUnit>
  __attribute__((noinline)) static void dequantize_panel(const PackedWeights& w, const PanelChunk& c,
                                                         float* panel) {
    // Group sizes are powers of two (is_supported_group_size), so are units per group.
    const int group_shift = __builtin_ctzll(static_cast<unsigned long long>(w.group_size / kUnit));
    const int64_t u_begin = (c.k_begin > 0 ? c.k_begin : 0) / kUnit;
    const int64_t u_end = (c.k_end + kUnit - 1) / kUnit;
    for (int64_t r = 0; r < c.rows; ++r) {
      const uint8_t* codes = w.nibbles + (c.n0 + r) * w.row_bytes;
      const float* scales = w.scales + (c.n0 + r) * w.groups;
      float* out = panel + r * kPanelLd;
      for (int64_t u = u_begin; u < u_end; ++u) {
        // A table per unit: one multiply, cheaper than a loop per group when groups are
        // one unit long (the common group size 32).
        const __m512 table = group_table(scales[u >> group_shift]);
        float* dst = out + (u * kUnit - c.k_begin);  // unaligned when the chunks are shifted
        if constexpr (kUnit == 32) {
          __m512 lo, hi;
          decode_unit32(codes + u * 16, table, lo, hi);
          _mm512_storeu_ps(dst, lo);
          _mm512_storeu_ps(dst + 16, hi);
        } else {
          _mm512_storeu_ps(dst, decode_unit16(codes + u * 8, table));
        }
      }
    }
  }

  // acc[i][r] += A row i . panel row r over the lanes of `m` of the vector at k.
  template <int RA, int RW>
  CIM_INLINE static void masked_step(const Tile& t, int64_t k, __mmask16 m, __m512 (&acc)[RA][RW]) {
    __m512 wv[RW];
#pragma GCC unroll 8
    for (int r = 0; r < RW; ++r) wv[r] = _mm512_load_ps(t.panel + r * kPanelLd + k);
#pragma GCC unroll 8
    for (int i = 0; i < RA; ++i) {
      const __m512 av = _mm512_maskz_loadu_ps(m, t.a + i * t.lda + k);
#pragma GCC unroll 8
      for (int r = 0; r < RW; ++r) acc[i][r] = _mm512_mask3_fmadd_ps(av, wv[r], acc[i][r], m);
    }
  }

  // RA rows of A x RW panel rows. The first vector of a shifted first chunk begins
  // before A's rows (t.head lanes, masked); kTail: the last chunk ends inside a vector.
  // Both are handled apart so that the main loop keeps every accumulator in a register.
  // (GCC keeps acc[][] in registers only when every loop over it is unrolled, hence the
  // pragmas.)
  template <int RA, int RW, bool kTail>
  CIM_INLINE static void tile(const Tile& t) {
    const __mmask16 resume = t.first ? 0 : 0xFFFF;  // a masked-off load gives exact zeros
    __m512 acc[RA][RW];
#pragma GCC unroll 8
    for (int i = 0; i < RA; ++i) {
#pragma GCC unroll 8
      for (int r = 0; r < RW; ++r) acc[i][r] = _mm512_maskz_load_ps(resume, t.partial + (i * kPanelRows + r) * 16);
    }
    int64_t k = 0;
    if (t.head > 0) {
      masked_step<RA, RW>(t, 0, first_lanes(t.len < 16 ? t.len : 16) & ~first_lanes(t.head), acc);
      k = 16;
    }
    const int64_t full = kTail ? t.len & ~int64_t{15} : t.len;
    for (; k < full; k += 16) {
      __m512 wv[RW];
#pragma GCC unroll 8
      for (int r = 0; r < RW; ++r) wv[r] = _mm512_load_ps(t.panel + r * kPanelLd + k);
#pragma GCC unroll 8
      for (int i = 0; i < RA; ++i) {
        const __m512 av = _mm512_loadu_ps(t.a + i * t.lda + k);
#pragma GCC unroll 8
        for (int r = 0; r < RW; ++r) acc[i][r] = _mm512_fmadd_ps(av, wv[r], acc[i][r]);
      }
    }
    if constexpr (kTail) {
      if (k < t.len) masked_step<RA, RW>(t, k, first_lanes(t.len - k), acc);
    }
    if (t.last) {
#pragma GCC unroll 8
      for (int i = 0; i < RA; ++i) {
#pragma GCC unroll 8
        for (int r = 0; r < RW; ++r) {
          float v = sum_lanes(acc[i][r]);
          if (t.bias != nullptr) v += t.bias[r];
          t.y[i * t.ldy + r] = v;
        }
      }
    } else {
#pragma GCC unroll 8
      for (int i = 0; i < RA; ++i) {
#pragma GCC unroll 8
        for (int r = 0; r < RW; ++r) _mm512_store_ps(t.partial + (i * kPanelRows + r) * 16, acc[i][r]);
      }
    }
  }

  // RA rows of A against all `rows` panel rows: tiles of 4 panel rows (8 for 3 rows of
  // A, to keep enough accumulators), then the rest one at a time.
  template <int RA, bool kTail>
  static void tile_row(Tile t, int64_t rows, ChunkPrefetch& prefetch) {
    constexpr int RW = RA >= 4 ? 4 : 8;
    int64_t r = 0;
    for (; r + RW <= rows; r += RW) {
      tile<RA, RW, kTail>(t);
      prefetch.step();
      t.panel += RW * kPanelLd;
      t.partial += RW * 16;
      t.y += RW;
      if (t.bias != nullptr) t.bias += RW;
    }
    for (; r < rows; ++r) {
      tile<RA, 1, kTail>(t);
      t.panel += kPanelLd;
      t.partial += 16;
      t.y += 1;
      if (t.bias != nullptr) t.bias += 1;
    }
  }

  template <bool kTail>
  static void run_tiles_of(int64_t rows_a, const Tile& t, int64_t rows, ChunkPrefetch& prefetch) {
    static_assert(kTileA == 6, "tile_row is instantiated for 3..6 rows of A");
    switch (rows_a) {
      case 6: tile_row<6, kTail>(t, rows, prefetch); break;
      case 5: tile_row<5, kTail>(t, rows, prefetch); break;
      case 4: tile_row<4, kTail>(t, rows, prefetch); break;
      default: tile_row<3, kTail>(t, rows, prefetch); break;
    }
  }

  // Vectors are 16 consecutive codes whatever the unit: only K's end makes a tail.
  template <int kUnit>
  static void run_tiles(int64_t rows_a, const Tile& t, int64_t rows, ChunkPrefetch& prefetch) {
    if (t.len % 16 == 0) {
      run_tiles_of<false>(rows_a, t, rows, prefetch);
    } else {
      run_tiles_of<true>(rows_a, t, rows, prefetch);
    }
  }
};

template <int kUnit>
void matmul_unit(const MatMulArgs& args, int64_t n_begin, int64_t n_end) {
  if (args.M == 1) {
    matmul_decode<kUnit>(args, n_begin, n_end);
  } else if (args.M < kPanelMinM) {
    matmul_prefill<kUnit>(args, n_begin, n_end);
  } else {
    prefill_panels<Avx512Prefill, kUnit>(args, n_begin, n_end);
  }
}

void matmul_fp32_avx512(const MatMulArgs& args, int64_t n_begin, int64_t n_end) {
  if (args.W->unit == 16) {
    matmul_unit<16>(args, n_begin, n_end);
  } else {
    matmul_unit<32>(args, n_begin, n_end);
  }
}

}  // namespace

const KernelTable& avx512_kernels() {
  static const KernelTable table{"avx512", matmul_fp32_avx512};
  return table;
}

}  // namespace cim

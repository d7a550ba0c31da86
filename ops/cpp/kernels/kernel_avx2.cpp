// AVX2 kernels (AVX2 + FMA): FP32 activations times 4-bit weights.
//
// Only this file is compiled with -mavx2 -mfma -mf16c; dispatch.cpp calls in here only
// after CPUID and XCR0 say the CPU and OS run AVX2, FMA and F16C.
//
// Three paths, by the number M of rows of A:
//   M = 1                 decode: each weight row streamed once, unpacked in registers
//   1 < M < kPanelMinM    the same per block of 4 rows of A
//   M >= kPanelMinM       each weight unpacked once per call into a small L1-resident
//                         panel that FP32 tiles of rows of A share (simd_common.h)
//
// Each output is computed by the same sequence of operations whatever the path and block
// shape, so results do not depend on how N is split into tasks, nor on M:
//   w_k = fma(code_k, scale_g, -8 scale_g)   = (code_k - 8) * scale_g, rounded once
//   acc = fma(a_k, w_k, acc)                 8 lanes, units in k order (Piece below)
//   y   = sum_lanes(acc) (+ bias)            a fixed tree
// -8 * scale is exact, so each weight is rounded once (the same value as the AVX-512
// table); that adds at most 2^-24 |a_k w_k| per term to the usual dot-product bound,
// which keeps |y - exact| within (K + 2) 2^-24 sum_k |a_k w_k|.
#include <immintrin.h>

#include <cstdint>

#include "kernels/kernel.h"
#include "kernels/simd_common.h"

namespace cim {
namespace {

#define CIM_INLINE inline __attribute__((always_inline))

// Register block for small prefill, sized for the 16 ymm registers: 4 x 2
// accumulators, a scale and -8 * scale per weight row, and the codes and weights of the
// row being used.
constexpr int kRowsA = 4;
constexpr int kRowsW = 2;
// Decode (M = 1): more weight rows in flight hide the FMA latency of each row's
// single accumulator chain.
constexpr int kDecodeRowsW = 4;

// Dequantization constants of one group of one weight row.
struct GroupScale {
  __m256 scale;
  __m256 minus8_scale;  // exact: a power-of-two multiple
};

CIM_INLINE GroupScale group_scale(float s) {
  return {_mm256_set1_ps(s), _mm256_set1_ps(-8.0f * s)};
}

// Codes (0..15, one per int32 lane) -> weights (code - 8) * scale.
CIM_INLINE __m256 dequantize(__m256i codes, const GroupScale& gs) {
  return _mm256_fmadd_ps(_mm256_cvtepi32_ps(codes), gs.scale, gs.minus8_scale);
}

// A unit is handled in pieces of 8 packed bytes = 16 codes. Piece p of a unit of U codes:
//   vpmovzxbd:   lane j = byte 8p + j  (j = 0..7)
//   byte & 15:   lane j = code 8p + j          -> pairs with A[k + 8p + j]
//   byte >> 4:   lane j = code 8p + j + U/2    -> pairs with A[k + U/2 + 8p + j]
// The low nibbles of a piece are accumulated before its high nibbles.
template <int kUnit>
struct Piece {
  static constexpr int kCount = kUnit / 16;
  static constexpr int64_t lo_offset(int p) { return 8 * p; }
  static constexpr int64_t hi_offset(int p) { return kUnit / 2 + 8 * p; }
};

CIM_INLINE __m256i load_piece(const uint8_t* bytes) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(bytes)));
}

// Lanes j < valid set (all ones), the others zero.
CIM_INLINE __m256i first_lanes(int64_t valid) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(valid)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// acc[i][r] += A[i][k, k + 8) . w for every row i of A; for a tail piece only `valid`
// (1..7) lanes exist: the masked load never reads A past K and the weight is zeroed so
// that the lanes past K add exactly 0.
template <int RA, int RW, bool kTail>
CIM_INLINE void fma_weight_row(const float* const (&a)[RA], int64_t k, int64_t valid, __m256 w, int r,
                               __m256 (&acc)[RA][RW]) {
  if constexpr (!kTail) {
    for (int i = 0; i < RA; ++i) acc[i][r] = _mm256_fmadd_ps(_mm256_loadu_ps(a[i] + k), w, acc[i][r]);
  } else {
    const __m256i mask = first_lanes(valid);
    w = _mm256_and_ps(w, _mm256_castsi256_ps(mask));
    for (int i = 0; i < RA; ++i) acc[i][r] = _mm256_fmadd_ps(_mm256_maskload_ps(a[i] + k, mask), w, acc[i][r]);
  }
}

// Codes [k + off, +8) of weight row r times A for every row of A, where the unit's
// tail (valid < kUnit) may end inside or before these 8 codes.
template <int RA, int RW, bool kTail>
CIM_INLINE void fma_piece_half(const float* const (&a)[RA], int64_t k, int64_t off, int64_t valid, __m256 w, int r,
                               __m256 (&acc)[RA][RW]) {
  if (!kTail || valid - off >= 8) {
    fma_weight_row<RA, RW, false>(a, k + off, 8, w, r, acc);
  } else if (valid > off) {  // else wholly past K: no pointer into it
    fma_weight_row<RA, RW, true>(a, k + off, valid - off, w, r, acc);
  }
}

// The unit of codes [k, k + kUnit); for the tail unit only the first `valid` codes are
// inside K. One weight row at a time keeps few values live in the 16 ymm registers; A
// is reloaded per row from L1 (loads are cheap, spills are not).
template <int kUnit, int RA, int RW, bool kTail>
CIM_INLINE void accumulate_unit(const float* const (&a)[RA], const uint8_t* const (&row)[RW],
                                const GroupScale (&gs)[RW], int64_t k, int64_t valid, __m256 (&acc)[RA][RW]) {
  using P = Piece<kUnit>;
  const __m256i low_nibble = _mm256_set1_epi32(15);
  for (int p = 0; p < P::kCount; ++p) {
    for (int r = 0; r < RW; ++r) {
      const __m256i bytes = load_piece(row[r] + k / 2 + 8 * p);
      const __m256 w_lo = dequantize(_mm256_and_si256(bytes, low_nibble), gs[r]);
      fma_piece_half<RA, RW, kTail>(a, k, P::lo_offset(p), valid, w_lo, r, acc);
      const __m256 w_hi = dequantize(_mm256_srli_epi32(bytes, 4), gs[r]);
      fma_piece_half<RA, RW, kTail>(a, k, P::hi_offset(p), valid, w_hi, r, acc);
    }
  }
}

// Sum of the 8 lanes, always folding the upper half onto the lower one.
//   8 -> 4: lanes j + (j + 4);  4 -> 2: j + (j + 2);  2 -> 1
CIM_INLINE float sum_lanes(__m256 v) {
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_movehdup_ps(s2)));
}

// Decode reads each weight byte once, from DRAM when the model outgrows the caches, and
// the hardware prefetcher alone keeps too few lines in flight. So while one block of 4
// rows is computed, the next block is requested, one line per row each time a row of
// this block starts a new 64-byte line of codes (every 4 units of 32 codes, 8 units of
// 16), and likewise a line of scales in 4 of every 16 units.
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
                                 const NextBlock* next, __m256 (&acc)[RA][RW]) {
  const PackedWeights& w = *args.W;
  const float* a[RA];
  for (int i = 0; i < RA; ++i) a[i] = args.A + (m0 + i) * args.lda;
  const uint8_t* row[RW];
  const float* scale[RW];
  for (int r = 0; r < RW; ++r) {
    row[r] = w.nibbles + (n0 + r) * w.row_bytes;
    scale[r] = w.scales + (n0 + r) * w.groups;
  }
  GroupScale gs[RW];
  const int64_t units_per_group = w.group_size / kUnit;
  const int64_t full_end = k_end / kUnit;  // units wholly inside the range end here
  int64_t u = k_begin / kUnit;
  for (int64_t g = k_begin / w.group_size; u < full_end; ++g) {
    for (int r = 0; r < RW; ++r) gs[r] = group_scale(scale[r][g]);
    const int64_t group_end = u + units_per_group < full_end ? u + units_per_group : full_end;
    for (; u < group_end; ++u) {
      if (next != nullptr) prefetch_next_block<kUnit>(*next, u, g);
      accumulate_unit<kUnit, RA, RW, false>(a, row, gs, u * kUnit, kUnit, acc);
    }
  }
  const int64_t tail = k_end - full_end * kUnit;
  if (tail > 0) {
    for (int r = 0; r < RW; ++r) gs[r] = group_scale(scale[r][full_end / units_per_group]);
    accumulate_unit<kUnit, RA, RW, true>(a, row, gs, full_end * kUnit, tail, acc);
  }
}

// Y[m0 + i, n0 + r] = sum_lanes(acc[i][r]) (+ bias).
template <int RA, int RW>
CIM_INLINE void store_outputs(const MatMulArgs& args, int64_t m0, int64_t n0, const __m256 (&acc)[RA][RW]) {
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
// to end; the row of A stays in L1.
template <int kUnit, int RW>
void decode_block(const MatMulArgs& args, int64_t n0) {
  const PackedWeights& w = *args.W;
  NextBlock next{};
  const bool has_next = RW == 4 && n0 + 2 * RW <= w.N;  // prefetch_next_block assumes 4 rows
  if (has_next) {
    next = {w.nibbles + (n0 + RW) * w.row_bytes, w.scales + (n0 + RW) * w.groups, w.row_bytes, w.groups};
  }
  __m256 acc[1][RW];
  for (int r = 0; r < RW; ++r) acc[0][r] = _mm256_setzero_ps();
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
                              __m256 (*partial)[kRowsA]) {
  __m256 acc[RA][RW];
  for (int i = 0; i < RA; ++i) {
    for (int r = 0; r < RW; ++r) acc[i][r] = k_begin == 0 ? _mm256_setzero_ps() : partial[r][i];
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
  __m256 partial[kPanelW][kRowsA];
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
// as above and tiles whose every output sees exactly the operations of decode: fma into
// lane k mod 8, units in k order, within a unit the order of Piece, the same lane sum.
// Below kPanelMinM the blocks above win (measured on Sapphire Rapids, K = N = 4096:
// 4.3 ms against 4.6 ms at M = 6, 3.2 ms against 2.8 ms at M = 4).
constexpr int64_t kPanelMinM = 6;
static_assert(kPanelMinM >= 4, "plan_tiles then gives tiles of 3 to 6 rows");

struct Avx2Prefill {
  static constexpr int kLanes = 8;
  static constexpr int kTileRows = 2;  // panel rows per tile kernel, for 4..6 rows of A
  // Lanes follow Piece within each unit, so chunks start on units (t.head is 0).
  static constexpr bool kShiftsChunks = false;

  // Not inlined: the driver's loops would take the registers this loop needs.
  template <int kUnit>
  __attribute__((noinline)) static void dequantize_panel(const PackedWeights& w, const PanelChunk& c,
                                                         float* panel) {
    using P = Piece<kUnit>;
    const __m256i low_nibble = _mm256_set1_epi32(15);
    // Group sizes are powers of two (is_supported_group_size), so are units per group.
    const int group_shift = __builtin_ctzll(static_cast<unsigned long long>(w.group_size / kUnit));
    const int64_t u_begin = c.k_begin / kUnit;
    const int64_t u_end = (c.k_end + kUnit - 1) / kUnit;
    for (int64_t r = 0; r < c.rows; ++r) {
      const uint8_t* codes = w.nibbles + (c.n0 + r) * w.row_bytes;
      const float* scales = w.scales + (c.n0 + r) * w.groups;
      float* out = panel + r * kPanelLd;
      for (int64_t u = u_begin; u < u_end; ++u) {
        const GroupScale gs = group_scale(scales[u >> group_shift]);
        float* dst = out + (u - u_begin) * kUnit;
        for (int p = 0; p < P::kCount; ++p) {
          const __m256i bytes = load_piece(codes + u * (kUnit / 2) + 8 * p);
          _mm256_store_ps(dst + P::lo_offset(p), dequantize(_mm256_and_si256(bytes, low_nibble), gs));
          _mm256_store_ps(dst + P::hi_offset(p), dequantize(_mm256_srli_epi32(bytes, 4), gs));
        }
      }
    }
  }

  // acc[i][r] += A row i . panel row r over the 8 codes at k, of which only the first
  // `valid` exist in A when kMasked (as fma_weight_row: masked load, weight zeroed).
  template <int RA, int RW, bool kMasked>
  CIM_INLINE static void step(const Tile& t, int64_t k, int64_t valid, __m256 (&acc)[RA][RW]) {
    const __m256i mask = kMasked ? first_lanes(valid) : _mm256_setzero_si256();
    __m256 wv[RW];
#pragma GCC unroll 8
    for (int r = 0; r < RW; ++r) {
      wv[r] = _mm256_load_ps(t.panel + r * kPanelLd + k);
      if constexpr (kMasked) wv[r] = _mm256_and_ps(wv[r], _mm256_castsi256_ps(mask));
    }
#pragma GCC unroll 8
    for (int i = 0; i < RA; ++i) {
      const __m256 av = kMasked ? _mm256_maskload_ps(t.a + i * t.lda + k, mask) : _mm256_loadu_ps(t.a + i * t.lda + k);
#pragma GCC unroll 8
      for (int r = 0; r < RW; ++r) acc[i][r] = _mm256_fmadd_ps(av, wv[r], acc[i][r]);
    }
  }

  // RA rows of A x RW panel rows. kTail: K ends inside the chunk's last unit (last chunk
  // only), handled apart so that the main loop keeps every accumulator in a register.
  // (GCC keeps acc[][] in registers only when every loop over it is unrolled, hence the
  // pragmas.)
  template <int kUnit, int RA, int RW, bool kTail>
  CIM_INLINE static void tile(const Tile& t) {
    using P = Piece<kUnit>;
    const __m256i resume = _mm256_set1_epi32(t.first ? 0 : -1);  // a masked-off load gives zeros
    __m256 acc[RA][RW];
#pragma GCC unroll 8
    for (int i = 0; i < RA; ++i) {
#pragma GCC unroll 8
      for (int r = 0; r < RW; ++r) acc[i][r] = _mm256_maskload_ps(t.partial + (i * kPanelRows + r) * 8, resume);
    }
    const int64_t full = kTail ? t.len / kUnit * kUnit : t.len;
    for (int64_t k = 0; k < full; k += kUnit) {
#pragma GCC unroll 4
      for (int p = 0; p < P::kCount; ++p) {
        step<RA, RW, false>(t, k + P::lo_offset(p), 8, acc);
        step<RA, RW, false>(t, k + P::hi_offset(p), 8, acc);
      }
    }
    if constexpr (kTail) {  // as fma_piece_half: the part of each half inside K
      const int64_t valid = t.len - full;
      for (int p = 0; p < P::kCount; ++p) {
        const int64_t halves[2] = {P::lo_offset(p), P::hi_offset(p)};
        for (const int64_t off : halves) {
          if (valid - off >= 8) {
            step<RA, RW, false>(t, full + off, 8, acc);
          } else if (valid > off) {  // else wholly past K: no pointer into it
            step<RA, RW, true>(t, full + off, valid - off, acc);
          }
        }
      }
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
        for (int r = 0; r < RW; ++r) _mm256_store_ps(t.partial + (i * kPanelRows + r) * 8, acc[i][r]);
      }
    }
  }

  // RA rows of A against all `rows` panel rows: tiles of 2 panel rows (4 for 3 rows of
  // A, to keep enough accumulators), then the rest one at a time.
  template <int kUnit, int RA, bool kTail>
  static void tile_row(Tile t, int64_t rows, ChunkPrefetch& prefetch) {
    constexpr int RW = RA >= 4 ? 2 : 4;
    int64_t r = 0;
    for (; r + RW <= rows; r += RW) {
      tile<kUnit, RA, RW, kTail>(t);
      prefetch.step();
      t.panel += RW * kPanelLd;
      t.partial += RW * 8;
      t.y += RW;
      if (t.bias != nullptr) t.bias += RW;
    }
    for (; r < rows; ++r) {
      tile<kUnit, RA, 1, kTail>(t);
      t.panel += kPanelLd;
      t.partial += 8;
      t.y += 1;
      if (t.bias != nullptr) t.bias += 1;
    }
  }

  template <int kUnit, bool kTail>
  static void run_tiles_of(int64_t rows_a, const Tile& t, int64_t rows, ChunkPrefetch& prefetch) {
    static_assert(kTileA == 6, "tile_row is instantiated for 3..6 rows of A");
    switch (rows_a) {
      case 6: tile_row<kUnit, 6, kTail>(t, rows, prefetch); break;
      case 5: tile_row<kUnit, 5, kTail>(t, rows, prefetch); break;
      case 4: tile_row<kUnit, 4, kTail>(t, rows, prefetch); break;
      default: tile_row<kUnit, 3, kTail>(t, rows, prefetch); break;
    }
  }

  template <int kUnit>
  static void run_tiles(int64_t rows_a, const Tile& t, int64_t rows, ChunkPrefetch& prefetch) {
    if (t.len % kUnit == 0) {
      run_tiles_of<kUnit, false>(rows_a, t, rows, prefetch);
    } else {
      run_tiles_of<kUnit, true>(rows_a, t, rows, prefetch);
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
    prefill_panels<Avx2Prefill, kUnit>(args, n_begin, n_end);
  }
}

void matmul_fp32_avx2(const MatMulArgs& args, int64_t n_begin, int64_t n_end) {
  if (args.W->unit == 16) {
    matmul_unit<16>(args, n_begin, n_end);
  } else {
    matmul_unit<32>(args, n_begin, n_end);
  }
}

}  // namespace

const KernelTable& avx2_kernels() {
  static const KernelTable table{"avx2", matmul_fp32_avx2};
  return table;
}

}  // namespace cim

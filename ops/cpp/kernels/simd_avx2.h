// SIMD traits for tile_kernels.h: AVX2 + FMA, with or without AVX-VNNI; also the 256-bit
// form of the AVX-512 paths (AVX-512 VL, VNNI on ymm), for cores that split zmm work in two.
// Include only from a translation unit compiled with the matching -m flags.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace cim {
namespace {

// How the int8 dot product of 4 u8 x s8 pairs per lane is formed on ymm.
enum class Dot {
  kMaddubs,     // vpmaddubsw + vpmaddwd (AVX2)
  kAvxVnni,     // vpdpbusd, VEX (AVX-VNNI)
  kAvx512Vnni,  // vpdpbusd, EVEX (AVX-512 VNNI + VL)
};

template <Dot kDot>
struct Avx2 {
  static constexpr int kLanes = 8;  // a tile of 16 channels is two vectors
  using F = __m256;
  using I = __m256i;
  // Prefill: blocks of rows x 1 tile; the row count measured per mode (4 x 4096x4096,
  // M = 128, 1 thread; rows 2 / 3 / 4 / 6): fp32 38.6 / 46.8 / 51.7 / 57.9 GMAC/s,
  // int8 (AVX-VNNI) 140 / 155 / 150 / 137, more row sums than registers costing less in
  // fp32 mode (8 FMAs per unpacked vector) than in int8 mode.
  static constexpr int kPrefillTiles = 1;
  static constexpr int kPrefillRowsFp32 = 6;
  static constexpr int kPrefillRowsInt8 = 4;
  // int8 mode with int16 pair sums (kPairDot, 4-bit codes: pair_kernels.h), where only
  // the pair sums take registers: 2 tiles x 3 rows = 12 of 16 (Zen 4, avx2 table, M = 128,
  // 4096^2, 1 thread, GMAC/s: 1 x 3 93.5, 1 x 4 93.3, 1 x 5 88-92, 1 x 6 75, 2 x 2 97,
  // 2 x 3 99-100; the form before, 1 x 4 with every sum in registers: 78-80).
  static constexpr int kPrefillTilesPairs = 2;
  static constexpr int kPrefillRowsPairs = 3;
  // Products in int16 pair sums (pair_dot) where that saves work: without VNNI.
  static constexpr bool kPairDot = kDot == Dot::kMaddubs;
  // fp32 mode's prefill from panels of unpacked floats (panel_kernels.h).
  static constexpr bool kPrefillPanel = true;

  static F zero() { return _mm256_setzero_ps(); }
  static F set1(float x) { return _mm256_set1_ps(x); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F cvt(I x) { return _mm256_cvtepi32_ps(x); }
  static I loadi(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static void storei(uint8_t* p, I x) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), x); }
  static I set1_i32(int32_t x) { return _mm256_set1_epi32(x); }

  // For int8 mode's quantization of A.
  static F abs(F x) { return _mm256_andnot_ps(_mm256_set1_ps(-0.0f), x); }
  static F max(F a, F b) { return _mm256_max_ps(a, b); }
  static bool all_finite(F x) {  // no inf, no NaN: |x| <= FLT_MAX (false for NaN)
    return _mm256_movemask_ps(_mm256_cmp_ps(abs(x), _mm256_set1_ps(3.40282347e38f), _CMP_LE_OQ)) == 0xFF;
  }
  static float reduce_max(F x) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
  }
  static I round_i32(F x) { return _mm256_cvtps_epi32(x); }
  static void store_i8(int8_t* p, I x) {  // |x| <= 127: the saturating packs are exact
    const __m128i w = _mm_packs_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(p), _mm_packs_epi16(w, w));
  }
  static I add_i32(I a, I b) { return _mm256_add_epi32(a, b); }
  static int32_t reduce_add_i32(I x) {
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(x), _mm256_extracti128_si256(x, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
    return _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1)));
  }

  // fp32 mode's codes: a row of code bytes as code_minus_8 reads it. XOR 8 turns each
  // nibble c into the 4-bit two's complement of c - 8 (0 -> -8, 15 -> 7), once per row.
  static I fp32_codes(I row) { return _mm256_xor_si256(row, _mm256_set1_epi8(static_cast<char>(0x88))); }

  // Code j (0..7) of each lane as the float c - 8 (no 16-entry vpermps on AVX2): the
  // nibble shifted to the top of the lane, then an arithmetic shift down sign-extends
  // it; convert (all exact). Two shifts and a convert, one shift fewer for j = 7.
  template <int J>
  static F code_minus_8(I row) {
    constexpr int shift = J < 4 ? 8 * J : 8 * (J - 4) + 4;
    I c = row;
    if constexpr (shift != 28) c = _mm256_slli_epi32(row, 28 - shift);
    return _mm256_cvtepi32_ps(_mm256_srai_epi32(c, 28));
  }

  static I low_nibbles(I row) { return _mm256_and_si256(row, _mm256_set1_epi8(0x0F)); }
  static I high_nibbles(I row) { return _mm256_and_si256(_mm256_srli_epi16(row, 4), _mm256_set1_epi8(0x0F)); }

  // float16 scales of one vector, converted exactly (F16C's vcvtph2ps).
  static F load_f16(const uint8_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  // int8 scales of one vector as floats (exact: vpmovsxbd, vcvtdq2ps).
  static F load_i8(const uint8_t* p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  }

  // Byte-plane unpacking for the widths other than 4 (plane_kernels.h).
  static I and_(I a, I b) { return _mm256_and_si256(a, b); }
  static I or_(I a, I b) { return _mm256_or_si256(a, b); }
  static I xor_(I a, I b) { return _mm256_xor_si256(a, b); }
  static I set1_i8(char x) { return _mm256_set1_epi8(x); }
  // A 16-byte table in each 128-bit half, and the table's byte at each byte's index (0 .. 15).
  static I table16(const void* p) { return _mm256_broadcastsi128_si256(_mm_loadu_si128(static_cast<const __m128i*>(p))); }
  static I lookup16(I table, I idx) { return _mm256_shuffle_epi8(table, idx); }
  template <int N> static I shl16(I x) { return _mm256_slli_epi16(x, N); }
  template <int N> static I shr16(I x) { return _mm256_srli_epi16(x, N); }
  template <int N> static I shl32(I x) { return _mm256_slli_epi32(x, N); }
  template <int N> static I sar32(I x) { return _mm256_srai_epi32(x, N); }
  template <int N> static I shr32(I x) { return _mm256_srli_epi32(x, N); }
  // Up to 8 int8 levels as floats, and the level at bits 2:0 of each lane (vpermps).
  static F level_table(const int8_t* q) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q))));
  }
  static F level_of(I idx, F table) { return _mm256_permutevar8x32_ps(table, idx); }

  // dot4 for codes up to 255 (see simd_avx512.h): two nibbles without VNNI.
  static I dot4_u8(I acc, I u8, I s8) {
    if constexpr (kDot == Dot::kMaddubs) {
      const I ones = _mm256_set1_epi16(1);
      const I lo = _mm256_madd_epi16(_mm256_maddubs_epi16(low_nibbles(u8), s8), ones);
      const I hi = _mm256_madd_epi16(_mm256_maddubs_epi16(high_nibbles(u8), s8), ones);
      return _mm256_add_epi32(acc, _mm256_add_epi32(lo, _mm256_slli_epi32(hi, 4)));
    } else {
      return dot4(acc, u8, s8);
    }
  }

  // dot4 steps summed in a cheaper form (start at zero_i(), then pair_flush into an int32
  // sum): without VNNI, int16 pair sums, one vpmaddubsw + vpaddw per step and one vpmaddwd
  // per flush instead of vpmaddubsw + vpmaddwd + vpaddd per step. The caller flushes
  // before a pair sum could pass 32767 (pair_steps in kernel.h: 8 steps of 4-bit codes,
  // 8 x 2 x 15 x 127 = 30480), so the sum is exact; with VNNI, vpdpbusd as in dot4.
  static I zero_i() { return _mm256_setzero_si256(); }
  static I pair_dot(I s, I u8, I s8) {
    if constexpr (kDot == Dot::kMaddubs) {
      return _mm256_add_epi16(s, _mm256_maddubs_epi16(u8, s8));
    } else {
      return dot4(s, u8, s8);
    }
  }
  static I pair_flush(I acc, I s) {
    if constexpr (kDot == Dot::kMaddubs) s = _mm256_madd_epi16(s, _mm256_set1_epi16(1));
    return _mm256_add_epi32(acc, s);
  }

  // acc + sum of 4 products u8 x s8 per 32-bit lane (see simd_avx512.h for the bounds).
  static I dot4(I acc, I u8, I s8) {
    if constexpr (kDot == Dot::kAvxVnni) {
      return _mm256_dpbusd_avx_epi32(acc, u8, s8);
    } else if constexpr (kDot == Dot::kAvx512Vnni) {
      return _mm256_dpbusd_epi32(acc, u8, s8);
    } else {
      const I pairs = _mm256_maddubs_epi16(u8, s8);
      return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
    }
  }
};

}  // namespace
}  // namespace cim

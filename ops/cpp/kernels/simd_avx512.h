// SIMD traits for tile_kernels.h: AVX-512 F/BW/VL/DQ, with or without VNNI.
// Include only from a translation unit compiled with the matching -m flags.
#pragma once

// GCC 12's AVX-512 headers initialise "undefined" vectors as `__m512 __Y = __Y;`, which
// -Wmaybe-uninitialized (and, in some inlining contexts, -Wuninitialized) reports at every
// use once inlined (GCC PR 105593, fixed in 13).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wuninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop

#include <cstdint>

namespace cim {
namespace {

template <bool kVnni>
struct Avx512 {
  static constexpr int kLanes = 16;  // one tile of 16 channels per vector
  using F = __m512;
  using I = __m512i;
  // Prefill blocks of 6 rows x 2 tiles: 12 group sums + 12 accumulators + 4 code vectors
  // fit 32 registers. (Decode's tiles in flight are a variant parameter: variants.h.)
  static constexpr int kPrefillTiles = 2;
  static constexpr int kPrefillRowsFp32 = 6;
  static constexpr int kPrefillRowsInt8 = 6;
  static constexpr int kPrefillTilesPairs = 2;  // without VNNI (simd_avx2.h says what these are)
  static constexpr int kPrefillRowsPairs = 6;
  // Products in int16 pair sums (pair_dot) where that saves work: without VNNI.
  static constexpr bool kPairDot = !kVnni;
  // fp32 mode's prefill from panels of unpacked floats (panel_kernels.h): vpermps unpacks
  // a vector in one step, but with its shift it takes ports 0 and 5 from the FMAs on
  // Intel cores (1.22x prefill by block at M = 128 on an Intel Xeon; level on a Zen 4).
  static constexpr bool kPrefillPanel = true;

  static F zero() { return _mm512_setzero_ps(); }
  static F set1(float x) { return _mm512_set1_ps(x); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, F v) { _mm512_storeu_ps(p, v); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F cvt(I x) { return _mm512_cvtepi32_ps(x); }
  static I loadi(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static void storei(uint8_t* p, I x) { _mm512_storeu_si512(p, x); }
  static I set1_i32(int32_t x) { return _mm512_set1_epi32(x); }

  // For int8 mode's quantization of A.
  static F abs(F x) { return _mm512_abs_ps(x); }
  static F max(F a, F b) { return _mm512_max_ps(a, b); }
  static bool all_finite(F x) {  // no inf, no NaN: |x| <= FLT_MAX (false for NaN)
    return _mm512_cmp_ps_mask(_mm512_abs_ps(x), _mm512_set1_ps(3.40282347e38f), _CMP_LE_OQ) == 0xFFFF;
  }
  static float reduce_max(F x) { return _mm512_reduce_max_ps(x); }
  static I round_i32(F x) { return _mm512_cvtps_epi32(x); }
  static void store_i8(int8_t* p, I x) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(x)); }
  static I add_i32(I a, I b) { return _mm512_add_epi32(a, b); }
  static int32_t reduce_add_i32(I x) { return _mm512_reduce_add_epi32(x); }

  // fp32 mode's codes: used as they are.
  static I fp32_codes(I row) { return row; }

  // Code j (0..7) of each lane's 8 as the float c - 8: the nibble at bit 8j (j < 4) or
  // 8(j-4) + 4 shifted down, then vpermps, which reads only bits 3:0 of each index,
  // looks it up in the table {-8, ..., 7}: no mask, no convert.
  template <int J>
  static F code_minus_8(I row) {
    constexpr int shift = J < 4 ? 8 * J : 8 * (J - 4) + 4;
    const F table = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    if constexpr (shift == 0) {
      return _mm512_permutexvar_ps(row, table);
    } else {
      return _mm512_permutexvar_ps(_mm512_srli_epi32(row, shift), table);
    }
  }

  // Per byte: the low nibble, and the high nibble (u8 0..15, vpdpbusd's unsigned side).
  static I low_nibbles(I row) { return _mm512_and_si512(row, _mm512_set1_epi8(0x0F)); }
  static I high_nibbles(I row) { return _mm512_and_si512(_mm512_srli_epi16(row, 4), _mm512_set1_epi8(0x0F)); }

  // float16 scales of one vector, converted exactly (AVX-512F's vcvtph2ps).
  static F load_f16(const uint8_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  // int8 scales of one vector as floats (exact: vpmovsxbd, vcvtdq2ps).
  static F load_i8(const uint8_t* p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
  }

  // Byte-plane unpacking for the widths other than 4 (plane_kernels.h).
  static I and_(I a, I b) { return _mm512_and_si512(a, b); }
  static I or_(I a, I b) { return _mm512_or_si512(a, b); }
  static I xor_(I a, I b) { return _mm512_xor_si512(a, b); }
  static I set1_i8(char x) { return _mm512_set1_epi8(x); }
  // A 16-byte table in each 128-bit lane, and the table's byte at each byte's index (0 .. 15).
  static I table16(const void* p) { return _mm512_broadcast_i32x4(_mm_loadu_si128(static_cast<const __m128i*>(p))); }
  static I lookup16(I table, I idx) { return _mm512_shuffle_epi8(table, idx); }
  template <int N> static I shl16(I x) { return _mm512_slli_epi16(x, N); }
  template <int N> static I shr16(I x) { return _mm512_srli_epi16(x, N); }
  template <int N> static I shl32(I x) { return _mm512_slli_epi32(x, N); }
  template <int N> static I sar32(I x) { return _mm512_srai_epi32(x, N); }
  template <int N> static I shr32(I x) { return _mm512_srli_epi32(x, N); }
  // Up to 16 int8 levels as floats, and the level at bits 3:0 of each lane (vpermps).
  static F level_table(const int8_t* q) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
  }
  static F level_of(I idx, F table) { return _mm512_permutexvar_ps(idx, table); }

  // dot4 for codes up to 255: vpdpbusd as is; vpmaddubsw would saturate (2 * 255 * 127
  // > 32767), so without VNNI the codes go in as two nibbles, the high one's sum times 16.
  static I dot4_u8(I acc, I u8, I s8) {
    if constexpr (kVnni) {
      return _mm512_dpbusd_epi32(acc, u8, s8);
    } else {
      const I ones = _mm512_set1_epi16(1);
      const I lo = _mm512_madd_epi16(_mm512_maddubs_epi16(low_nibbles(u8), s8), ones);
      const I hi = _mm512_madd_epi16(_mm512_maddubs_epi16(high_nibbles(u8), s8), ones);
      return _mm512_add_epi32(acc, _mm512_add_epi32(lo, _mm512_slli_epi32(hi, 4)));
    }
  }

  // dot4 steps summed in a cheaper form (see simd_avx2.h): int16 pair sums without VNNI,
  // vpdpbusd with it.
  static I zero_i() { return _mm512_setzero_si512(); }
  static I pair_dot(I s, I u8, I s8) {
    if constexpr (kVnni) {
      return _mm512_dpbusd_epi32(s, u8, s8);
    } else {
      return _mm512_add_epi16(s, _mm512_maddubs_epi16(u8, s8));
    }
  }
  static I pair_flush(I acc, I s) {
    if constexpr (!kVnni) s = _mm512_madd_epi16(s, _mm512_set1_epi16(1));
    return _mm512_add_epi32(acc, s);
  }

  // acc + sum of 4 products u8 x s8 per 32-bit lane. Without VNNI: vpmaddubsw (pairs to
  // int16: |15 * 127 * 2| = 3810 never saturates) and vpmaddwd by 1 (pairs to int32).
  static I dot4(I acc, I u8, I s8) {
    if constexpr (kVnni) {
      return _mm512_dpbusd_epi32(acc, u8, s8);
    } else {
      const I pairs = _mm512_maddubs_epi16(u8, s8);
      return _mm512_add_epi32(acc, _mm512_madd_epi16(pairs, _mm512_set1_epi16(1)));
    }
  }
};

}  // namespace
}  // namespace cim

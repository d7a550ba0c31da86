// SIMD traits for tile_kernels.h: AVX2 + FMA, with or without AVX-VNNI.
// Include only from a translation unit compiled with the matching -m flags.
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace cim {
namespace {

template <bool kVnni>
struct Avx2 {
  static constexpr int kLanes = 8;  // a tile of 16 channels is two vectors
  using F = __m256;
  using I = __m256i;
  // 16 ymm registers: 2 tiles (4 chains) at M = 1; prefill blocks of 2 rows x 1 tile.
  static constexpr int kDecodeTiles = 2;
  static constexpr int kPrefillTiles = 1;
  static constexpr int kPrefillRows = 2;

  static F zero() { return _mm256_setzero_ps(); }
  static F set1(float x) { return _mm256_set1_ps(x); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, F v) { _mm256_storeu_ps(p, v); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F fma(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F cvt(I x) { return _mm256_cvtepi32_ps(x); }
  static I loadi(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static I set1_i32(int32_t x) { return _mm256_set1_epi32(x); }

  // Code j (0..7) of each lane as the float c - 8 (no 16-entry vpermps on AVX2:
  // shift, mask, convert, subtract; all exact).
  template <int J>
  static F code_minus_8(I row) {
    constexpr int shift = J < 4 ? 8 * J : 8 * (J - 4) + 4;
    I c = row;
    if constexpr (shift != 0) c = _mm256_srli_epi32(row, shift);
    c = _mm256_and_si256(c, _mm256_set1_epi32(0x0F));
    return _mm256_sub_ps(_mm256_cvtepi32_ps(c), _mm256_set1_ps(8.0f));
  }

  static I low_nibbles(I row) { return _mm256_and_si256(row, _mm256_set1_epi8(0x0F)); }
  static I high_nibbles(I row) { return _mm256_and_si256(_mm256_srli_epi16(row, 4), _mm256_set1_epi8(0x0F)); }

  // acc + sum of 4 products u8 x s8 per 32-bit lane (see simd_avx512.h for the bounds).
  static I dot4(I acc, I u8, I s8) {
    if constexpr (kVnni) {
      return _mm256_dpbusd_avx_epi32(acc, u8, s8);
    } else {
      const I pairs = _mm256_maddubs_epi16(u8, s8);
      return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
    }
  }
};

}  // namespace
}  // namespace cim

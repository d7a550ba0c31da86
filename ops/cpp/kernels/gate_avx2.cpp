// gate_avx2 (gate.h): built with -mavx2 -mfma, called only where an x86 table was selected.
#include <immintrin.h>

#include "kernels/gate.h"

namespace cim {
namespace {

// exp(x) for x clamped to [-87.3, 88.3] (so 2^n stays a normal float): n = round(x log2 e),
// r = x - n ln 2 in two parts (Cephes), exp(r) by Cephes' degree-6 polynomial, times 2^n.
// A NaN x becomes the lower clamp; callers multiply by g, which keeps the NaN.
inline __m256 exp_ps(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.3f)), _mm256_set1_ps(88.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

template <Gate kind>
void run(float* gate, const float* up, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i);
    __m256 t = g;
    if (kind == Gate::kGeluTanh) {
      const __m256 g3 = _mm256_mul_ps(_mm256_mul_ps(g, g), g);
      t = _mm256_mul_ps(_mm256_set1_ps(1.5957691216f), _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), g3, g));
    }
    const __m256 minus_t = _mm256_sub_ps(_mm256_setzero_ps(), t);
    __m256 d = _mm256_add_ps(_mm256_set1_ps(1.0f), exp_ps(minus_t));
    // Where exp(-t) overflows (clamped above), the denominator is inf as in gate_portable:
    // g / inf = -0 for a finite g, NaN for g = -inf.
    d = _mm256_blendv_ps(d, _mm256_set1_ps(__builtin_inff()), _mm256_cmp_ps(minus_t, _mm256_set1_ps(88.3f), _CMP_GT_OQ));
    _mm256_storeu_ps(gate + i, _mm256_mul_ps(_mm256_div_ps(g, d), _mm256_loadu_ps(up + i)));
  }
  if (i < n) gate_portable(kind, gate + i, up + i, n - i);
}

}  // namespace

void gate_avx2(Gate kind, float* gate, const float* up, int64_t n) {
  if (kind == Gate::kSilu) {
    run<Gate::kSilu>(gate, up, n);
  } else {
    run<Gate::kGeluTanh>(gate, up, n);
  }
}

}  // namespace cim

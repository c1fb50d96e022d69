// Vectorized float32 math the kernels share (AVX-512 where the build targets it).
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>

namespace tandem_cpu {

// e^x for 16 lanes: x = n ln2 + r with |r| <= ln2 / 2, e^r by its degree-6 Taylor
// polynomial (relative error < 2e-7, about one float32 ulp), times 2^n by scalef.
// Saturates at e^88 (finite: -ffast-math may turn a division by the result into a
// reciprocal whose refinement makes NaN of infinity); e^x underflows to 0 below -104;
// NaN gives NaN.
inline __m512 exp512(__m512 x) {
  const __m512 log2e = _mm512_set1_ps(1.44269504088896341f);
  const __m512 ln2_hi = _mm512_set1_ps(0.693145751953125f);
  const __m512 ln2_lo = _mm512_set1_ps(1.428606765330187e-06f);
  // Operand order: max/min return their second operand when either is NaN, so NaN stays.
  x = _mm512_max_ps(_mm512_set1_ps(-104.f), x);  // below: e^x is 0 in float32 anyway
  x = _mm512_min_ps(_mm512_set1_ps(88.f), x);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, log2e), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, ln2_hi, x);
  r = _mm512_fnmadd_ps(n, ln2_lo, r);
  __m512 p = _mm512_set1_ps(1.f / 720.f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}

}  // namespace tandem_cpu

#endif

namespace tandem_cpu {

// max(init, p[0..n)): sixteen lanes at a time (a scalar max is one serial chain).
inline float max_of(const float* p, int64_t n, float init) {
#if defined(__AVX512F__)
  __m512 m = _mm512_set1_ps(init);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) m = _mm512_max_ps(m, _mm512_loadu_ps(p + i));
  if (i < n) m = _mm512_mask_max_ps(m, static_cast<__mmask16>((1u << (n - i)) - 1), m, _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << (n - i)) - 1), p + i));
  return _mm512_reduce_max_ps(m);
#else
  float m = init;
#pragma omp simd reduction(max : m)
  for (int64_t i = 0; i < n; ++i) m = p[i] > m ? p[i] : m;
  return m;
#endif
}

// p[i] = e^(p[i] - m) for i < n; returns their sum.
inline float exp_shift_sum(float* p, int64_t n, float m) {
#if defined(__AVX512F__)
  const __m512 mv = _mm512_set1_ps(m);
  __m512 s = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 e = exp512(_mm512_sub_ps(_mm512_loadu_ps(p + i), mv));
    _mm512_storeu_ps(p + i, e);
    s = _mm512_add_ps(s, e);
  }
  if (i < n) {
    const __mmask16 k = static_cast<__mmask16>((1u << (n - i)) - 1);
    const __m512 e = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, p + i), mv));
    _mm512_mask_storeu_ps(p + i, k, e);
    s = _mm512_mask_add_ps(s, k, s, e);
  }
  return _mm512_reduce_add_ps(s);
#else
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) {
    p[i] = std::exp(p[i] - m);
    s += p[i];
  }
  return s;
#endif
}

}  // namespace tandem_cpu

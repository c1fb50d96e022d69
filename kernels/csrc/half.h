// float16 -> float32 for the kernels that keep scales in float16 (panel_linear_cpu.cpp's
// grouped int8 panels, int4_linear_cpu.cpp's 4-bit panels).
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace tandem_cpu {

// float16 bits -> float32, exactly (subnormals, inf and NaN included): the portable loops'
// conversion (F16C / AVX-512 convert 8 or 16 at a time in registers).
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exponent = (h >> 10) & 0x1Fu, mantissa = h & 0x3FFu;
  if (exponent == 0) {  // zero or subnormal: mantissa x 2^-24 (a normal float32)
    const float f = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    return sign ? -f : f;
  }
  const uint32_t bits =
      sign | (exponent == 0x1F ? 0x7F800000u | (mantissa << 13) : ((exponent + 112) << 23) | (mantissa << 13));
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

#if defined(__AVX2__)
// 8 float16 -> 8 float32 (F16C's vcvtph2ps; the scalar conversion without it).
inline __m256 load_half8(const uint16_t* p) {
#if defined(__F16C__)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#else
  return _mm256_setr_ps(half_to_float(p[0]), half_to_float(p[1]), half_to_float(p[2]), half_to_float(p[3]),
                        half_to_float(p[4]), half_to_float(p[5]), half_to_float(p[6]), half_to_float(p[7]));
#endif
}
#endif

}  // namespace tandem_cpu

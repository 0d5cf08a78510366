// Activations as int8, as our integer kernels (w4a8.cpp, gguf_int8.cpp) and llama.cpp's Q8 activations take them:
// per span of inputs, scale = amax / 127 and q = round-half-even(x / scale) clamped to +-127 (0 where x / scale is NaN).
#pragma once

#include "simd.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace {

// n inputs (a multiple of 8) -> their scale amax / 127 and q
inline float quantize_span(const float* x, int64_t n, int8_t* q) {
#if defined(__AVX2__)
  __m256 amax = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v));
    nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  }
  alignas(32) float l[8];
  _mm256_store_ps(l, amax);
  float m = l[0];
  for (int i = 1; i < 8; ++i) m = std::max(m, l[i]);
  if (!_mm256_testz_ps(nan, nan)) m = std::numeric_limits<float>::quiet_NaN();  // as torch's amax
  const float s = m / 127.f;
  if (!(s > 0.f)) {  // all zeros, NaN, or an underflowed scale of zero
    std::memset(q, 0, n);
    return s;
  }
  const __m256 sv = _mm256_set1_ps(s), hi = _mm256_set1_ps(127.f), lo = _mm256_set1_ps(-127.f);
  for (int64_t i = 0; i < n; i += 32) {  // n is a multiple of 32 here (blocks and super-blocks)
    __m256i v[4];
    for (int j = 0; j < 4; ++j) {
      const __m256 r = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(x + i + 8 * j), sv),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      const __m256 c = _mm256_min_ps(hi, _mm256_max_ps(lo, r));
      v[j] = _mm256_cvtps_epi32(_mm256_andnot_ps(_mm256_cmp_ps(r, r, _CMP_UNORD_Q), c));  // NaN (inf / inf) -> 0
    }
    const __m256i w = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
    // the packs work per 128-bit half: dword j holds v[j % 4] elements 0..3 (j < 4) or 4..7; put them in order
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + i),
                        _mm256_permutevar8x32_epi32(w, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
  }
  return s;
#else
  float amax = 0.f;  // NaN if any input is NaN, as torch's amax
  for (int64_t i = 0; i < n; ++i) {
    const float a = std::fabs(x[i]);
    if (!(a <= amax) && !std::isnan(amax)) amax = a;  // a NaN, once seen, stays
  }
  const float s = amax / 127.f;
  for (int64_t i = 0; i < n; ++i) {
    float v = s > 0.f ? std::nearbyint(x[i] / s) : 0.f;
    v = std::isnan(v) ? 0.f : std::min(127.f, std::max(-127.f, v));  // inf / inf; a denormal scale
    q[i] = static_cast<int8_t>(v);
  }
  return s;
#endif
}

}  // namespace

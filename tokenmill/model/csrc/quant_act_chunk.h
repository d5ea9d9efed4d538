// One chunk of quantize_row (quant_act.h) without AVX-512: the largest |x| of a span, and a chunk of
// 32 activations to int8 codes (and residual codes with `fine`). With AVX2 eight lanes run the scalar
// loop's own operations (round half to even, the same multiply, clamp and integer sums), so the codes
// and sums are the same bits either way; the scalar loop had been ~3% of a Qwen-1.5B prefill.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace TM_QUANT_NS {

#if defined(__AVX2__)
template <typename T>  // 8 activations as floats (T: float, or bf16 as its 16 bits)
inline __m256 load8(const T* x) {
  if constexpr (sizeof(T) == 2) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  } else {
    return _mm256_loadu_ps(reinterpret_cast<const float*>(x));
  }
}

inline int hsum8(__m256i v) {
  const __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  const __m128i t = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1)));
}

// 32 int32 lanes (each within int8) as 32 bytes in order
inline void store_bytes32(int8_t* dst, const __m256i v[4]) {
  const __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]), _mm256_packs_epi32(v[2], v[3]));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm256_permutevar8x32_epi32(b, order));
}
#endif

template <typename T>
inline float abs_max(const T* x, int n) {
#if defined(__AVX2__)
  const __m256 sign = _mm256_set1_ps(-0.f);
  __m256 m = _mm256_setzero_ps();
  // |x| first: max_ps returns its second operand for a NaN, as std::max(amax, NaN) keeps amax
  for (int i = 0; i < n; i += 8) m = _mm256_max_ps(_mm256_andnot_ps(sign, load8(x + i)), m);
  const __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  const __m128 g = _mm_max_ps(h, _mm_movehl_ps(h, h));
  return _mm_cvtss_f32(_mm_max_ss(g, _mm_shuffle_ps(g, g, 1)));
#else
  float a = 0.f;
  for (int i = 0; i < n; ++i) a = std::max(a, std::fabs(static_cast<float>(x[i])));
  return a;
#endif
}

// x[0..32) * inv rounded to codes q (|q| <= 127: never -128), with `fine` the residual codes qr
// (and q16 = 256 q + qr where q16 is not null); s: the sums of q over each half, r: of qr.
template <typename T>
inline void quantize_chunk(const T* x, float inv, bool fine, int8_t* q, int8_t* qr, int16_t* q16, int s[2], int r[2]) {
#if defined(__AVX2__)
  constexpr int kNear = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
  r[0] = r[1] = 0;
  const __m256 vinv = _mm256_set1_ps(inv);
  __m256 y[4];
  __m256i v[4], w[4];
  for (int j = 0; j < 4; ++j) {
    y[j] = _mm256_mul_ps(load8(x + 8 * j), vinv);
    v[j] = _mm256_cvtps_epi32(_mm256_round_ps(y[j], kNear));
  }
  store_bytes32(q, v);
  s[0] = hsum8(_mm256_add_epi32(v[0], v[1]));
  s[1] = hsum8(_mm256_add_epi32(v[2], v[3]));
  if (!fine) return;
  const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
  for (int j = 0; j < 4; ++j) {
    const __m256 e = _mm256_mul_ps(_mm256_sub_ps(y[j], _mm256_cvtepi32_ps(v[j])), _mm256_set1_ps(256.f));
    w[j] = _mm256_min_epi32(_mm256_max_epi32(_mm256_cvtps_epi32(_mm256_round_ps(e, kNear)), lo), hi);
  }
  store_bytes32(qr, w);
  r[0] = hsum8(_mm256_add_epi32(w[0], w[1]));
  r[1] = hsum8(_mm256_add_epi32(w[2], w[3]));
  if (q16) {
    for (int j = 0; j < 4; j += 2) {
      const __m256i a = _mm256_add_epi32(_mm256_slli_epi32(v[j], 8), w[j]);
      const __m256i b = _mm256_add_epi32(_mm256_slli_epi32(v[j + 1], 8), w[j + 1]);
      const __m256i p = _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q16 + 8 * j), p);
    }
  }
#else
  s[0] = s[1] = r[0] = r[1] = 0;
  for (int i = 0; i < 32; ++i) {
    const float y = static_cast<float>(x[i]) * inv;
    const int v = static_cast<int>(std::nearbyint(y));
    q[i] = static_cast<int8_t>(v);
    s[i / 16] += v;
    if (fine) {
      const int w = std::clamp(static_cast<int>(std::nearbyint((y - v) * 256.f)), -127, 127);
      qr[i] = static_cast<int8_t>(w);
      if (q16) q16[i] = static_cast<int16_t>(256 * v + w);
      r[i / 16] += w;
    }
  }
#endif
}

}  // namespace TM_QUANT_NS

// AVX2 pieces of the x8 layout (quant_x8.h) that the 8-lane kernels share (quant_x8_dot.h, and
// dequantization in quant_dequant.h): a chunk body decoded into 8 ymm of bytes (lane = row) and its
// per-row scales as float vectors.
#pragma once


#include "quant_act.h"

namespace TM_QUANT_NS {

#if defined(__AVX2__)
// ymm j of a chunk: lanes = rows 0-7, bytes = weights 4j..4j+3 of each row.
template <int BITS>
inline void decode_ymm(const uint8_t* body, __m256i u[8]) {
  auto ld = [](const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); };
  if constexpr (BITS == 8) {
    for (int j = 0; j < 8; ++j) u[j] = ld(body + 32 * j);
  } else {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    for (int j = 0; j < 4; ++j) {  // bytes 32j.. hold U(j/2) half j%2 (low nibbles), U(j/2 + 2) (high)
      const __m256i h = ld(body + 32 * j);
      u[j] = _mm256_and_si256(h, m4);
      u[j + 4] = _mm256_and_si256(_mm256_srli_epi16(h, 4), m4);
    }
    if constexpr (BITS == 5) add_plane<4>(u, ld(body + 128), std::make_integer_sequence<int, 8>{});
    if constexpr (BITS == 6) add_plane_pairs(u, ld(body + 128), ld(body + 160), std::make_integer_sequence<int, 8>{});
  }
}
#endif

// Scales of a chunk as 8-row vectors (AVX2+): w = d * u + off, per half when two_scales.
#if defined(__AVX2__)
struct ChunkVec {
  __m256 da, db, oa, ob;
};

inline __m256 ld_ph8(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256 ld_u8x8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 ld_i8x8(const uint8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}

template <int QT>
inline void chunk_vec(const uint8_t* group, const uint8_t* h, int k, ChunkVec& v) {
  if constexpr (QT == Q4_0 || QT == Q5_0 || QT == Q8_0) {
    v.da = ld_ph8(h);
    v.oa = _mm256_mul_ps(v.da, _mm256_set1_ps(QT == Q4_0 ? -8.f : QT == Q5_0 ? -16.f : 0.f));
  } else if constexpr (QT == Q4_1 || QT == Q5_1 || QT == I4_G128) {
    v.da = ld_ph8(h);
    v.oa = ld_ph8(h + 16);
  } else if constexpr (QT == I8_ROW) {
    v.da = _mm256_loadu_ps(reinterpret_cast<const float*>(group));
    v.oa = _mm256_setzero_ps();
  } else if constexpr (QT == Q4_K || QT == Q5_K) {
    v.da = _mm256_mul_ps(ld_ph8(h), ld_u8x8(h + 32 + 8 * k));
    v.oa = _mm256_mul_ps(ld_ph8(h + 16), _mm256_mul_ps(ld_u8x8(h + 96 + 8 * k), _mm256_set1_ps(-1.f)));
  } else {  // Q6_K
    const __m256 d = ld_ph8(h);
    v.da = _mm256_mul_ps(d, ld_i8x8(h + 16 + 16 * k));
    v.db = _mm256_mul_ps(d, ld_i8x8(h + 24 + 16 * k));
    v.oa = _mm256_mul_ps(v.da, _mm256_set1_ps(-32.f));
    v.ob = _mm256_mul_ps(v.db, _mm256_set1_ps(-32.f));
  }
  if constexpr (QT != Q6_K) {
    v.db = v.da;
    v.ob = v.oa;
  }
}
#endif

}  // namespace TM_QUANT_NS

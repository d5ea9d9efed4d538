// AVX-512 pieces the many-row kernels share (quant_gemm_rows.cpp: activation scales per 32;
// quant_gemm_sb.cpp: per 256-value super-block): decoding two x8 chunk bodies into 16-lane zmm
// vectors (lane = output row), loading their scales, and the integer dot product.
#pragma once

#include <cstring>
#include <utility>

#include "quant_act.h"

namespace TM_QUANT_NS {

#if defined(__AVX512F__) && defined(__AVX512BW__)
namespace zmm {

inline __m512 join(__m256 lo, __m256 hi) {
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1));
}

// decode_ymm of two chunk bodies at once: zmm j = ymm j of b0 (rows 0-7), then of b1 (rows 8-15);
// the 5th and 6th bits come from the two groups' bit planes side by side.
template <int BITS>
inline void decode_zmm(const uint8_t* b0, const uint8_t* b1, __m512i W[8]) {
  auto ld2 = [](const uint8_t* p, const uint8_t* q) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))),
                              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)), 1);
  };
  if constexpr (BITS == 8) {
    for (int j = 0; j < 8; ++j) W[j] = ld2(b0 + 32 * j, b1 + 32 * j);
  } else {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    for (int j = 0; j < 4; ++j) {
      const __m512i h = ld2(b0 + 32 * j, b1 + 32 * j);
      W[j] = _mm512_and_si512(h, m4);
      W[j + 4] = _mm512_and_si512(_mm512_srli_epi16(h, 4), m4);
    }
    if constexpr (BITS == 5) add_plane<4>(W, ld2(b0 + 128, b1 + 128), std::make_integer_sequence<int, 8>{});
    if constexpr (BITS == 6)
      add_plane_pairs(W, ld2(b0 + 128, b1 + 128), ld2(b0 + 160, b1 + 160), std::make_integer_sequence<int, 8>{});
  }
}

inline __m128i ld16(const uint8_t* p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p)); }
inline __m128i ld8(const uint8_t* p) { return _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)); }
// 8 fp16 at p, then 8 at q, as floats; 8 bytes at p, then 8 at q, as floats
inline __m512 ld_ph16(const uint8_t* p, const uint8_t* q) {
  return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(ld16(p)), ld16(q), 1));
}
inline __m512 ld_u8x16(const uint8_t* p, const uint8_t* q) {
  return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi64(ld8(p), ld8(q))));
}
inline __m512 ld_i8x16(const uint8_t* p, const uint8_t* q) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_unpacklo_epi64(ld8(p), ld8(q))));
}

// chunk_vec (quant_act.h) of groups 0 and 1 as 16-lane vectors: the same per-lane operations
template <int QT>
inline void chunk_vec16(const uint8_t* g0, const uint8_t* h0, const uint8_t* g1, const uint8_t* h1, int k,
                        __m512& da, __m512& db, __m512& oa, __m512& ob) {
  if constexpr (QT == Q4_0 || QT == Q5_0 || QT == Q8_0) {
    da = ld_ph16(h0, h1);
    oa = _mm512_mul_ps(da, _mm512_set1_ps(QT == Q4_0 ? -8.f : QT == Q5_0 ? -16.f : 0.f));
  } else if constexpr (QT == Q4_1 || QT == Q5_1 || QT == I4_G128) {
    da = ld_ph16(h0, h1);
    oa = ld_ph16(h0 + 16, h1 + 16);
  } else if constexpr (QT == I8_ROW) {
    da = join(_mm256_loadu_ps(reinterpret_cast<const float*>(g0)), _mm256_loadu_ps(reinterpret_cast<const float*>(g1)));
    oa = _mm512_setzero_ps();
  } else if constexpr (QT == Q4_K || QT == Q5_K) {
    da = _mm512_mul_ps(ld_ph16(h0, h1), ld_u8x16(h0 + 32 + 8 * k, h1 + 32 + 8 * k));
    oa = _mm512_mul_ps(ld_ph16(h0 + 16, h1 + 16),
                       _mm512_mul_ps(ld_u8x16(h0 + 96 + 8 * k, h1 + 96 + 8 * k), _mm512_set1_ps(-1.f)));
  } else {  // Q6_K
    const __m512 d = ld_ph16(h0, h1);
    da = _mm512_mul_ps(d, ld_i8x16(h0 + 16 + 16 * k, h1 + 16 + 16 * k));
    db = _mm512_mul_ps(d, ld_i8x16(h0 + 24 + 16 * k, h1 + 24 + 16 * k));
    oa = _mm512_mul_ps(da, _mm512_set1_ps(-32.f));
    ob = _mm512_mul_ps(db, _mm512_set1_ps(-32.f));
  }
  if constexpr (QT != Q6_K) {
    db = da;
    ob = oa;
  }
}

// acc + (4 weights of 16 rows in W) . (the 4 activations at p, the same in every lane). With VNNI the
// broadcast is vpdpbusd's memory operand: GCC 12 gave it a vpbroadcastd of its own, a vector op per
// dot product. The operand is typed as bytes: it reads the tile's int8 codes, and char aliases them.
template <bool kSigned>
inline __m512i dp(__m512i acc, __m512i w, const int8_t* p) {
  if constexpr (kVNNI) {
    asm("vpdpbusd %[x]%{1to16%}, %[w], %[acc]" : [acc] "+v"(acc) : [w] "v"(w), [x] "m"(*reinterpret_cast<const char(*)[4]>(p)));
    return acc;
  } else {
    int32_t v;
    std::memcpy(&v, p, 4);
    const __m512i x = _mm512_set1_epi32(v);
    if constexpr (kSigned) {
      const __mmask64 neg = _mm512_movepi8_mask(w);
      const __m512i xs = _mm512_mask_sub_epi8(x, neg, _mm512_setzero_si512(), x);
      return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_abs_epi8(w), xs), _mm512_set1_epi16(1)));
    } else {
      return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(w, x), _mm512_set1_epi16(1)));
    }
  }
}

// Keeps the two groups' streams `dist` bytes ahead of chunk c (of C) being read, into the next item.
struct Prefetcher {
  const uint8_t *g0, *g1;
  const Ahead& pf;
  int64_t C, dist, step, pos;
  Prefetcher(const uint8_t* g0_, const uint8_t* g1_, const Ahead& pf_, int64_t C_)
      : g0(g0_), g1(g1_), pf(pf_), C(C_), dist(pf_.gb ? std::min(g_prefetch_ahead, pf_.gb) : 0),
        step(pf_.gb ? pf_.gb / C_ : 0), pos(dist) {}  // no idiv per call where nothing is prefetched
  inline void before(int64_t c) {
    if (!dist) return;
    if (g_prefetch_level == 2) run<_MM_HINT_T1>(c);
    else run<_MM_HINT_T0>(c);
  }
  template <int HINT>
  inline void run(int64_t c) {
    for (const int64_t upto = c + 1 == C ? pf.gb + dist : (c + 1) * step + dist; pos < upto; pos += 64) {
      if (pos < pf.gb) {
        _mm_prefetch(reinterpret_cast<const char*>(g0 + pos), static_cast<_mm_hint>(HINT));
        _mm_prefetch(reinterpret_cast<const char*>(g1 + pos), static_cast<_mm_hint>(HINT));
      } else if (pf.n0) {
        _mm_prefetch(reinterpret_cast<const char*>(pf.n0 + pos - pf.gb), static_cast<_mm_hint>(HINT));
        _mm_prefetch(reinterpret_cast<const char*>(pf.n1 + pos - pf.gb), static_cast<_mm_hint>(HINT));
      }
    }
  }
};

}  // namespace zmm
#endif

}  // namespace TM_QUANT_NS

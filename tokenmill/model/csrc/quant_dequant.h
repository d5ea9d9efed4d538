// Rows of a packed (x8) weight as floats or bf16: the many-row path's slabs (dequantize, then the
// dense GEMM), `dequantize` and the embedding. With AVX2 a chunk (8 rows x 32 weights) is decoded
// to bytes as the packed kernels do (decode_ymm), its 8x8 dwords transposed so that each row's 32
// weights are one register, and converted 8 at a time: ~10x the scalar loop, whose cost was most
// of a many-row product below ~512 rows (BENCHMARKS.md, "Quantized GEMM crossover").
#pragma once

#include <cstdint>
#include <type_traits>

#include "quant_ymm.h"
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include "bf16_zmm.h"
#endif

namespace TM_QUANT_NS {

// Rows [r0, r1) of a packed weight, any format, one chunk at a time (scalar).
template <typename T>
void dequant_rows_scalar(const uint8_t* w, int qtype, int64_t K, int64_t r0, int64_t r1, T* dst) {
  const X8Geom g = x8_geom(qtype);
  const int64_t gb = x8_group_bytes(qtype, K), C = K / 32;
  const int cpb = g.qk / 32;
  uint8_t u[8][32];
  for (int64_t gi = r0 / 8; gi * 8 < r1; ++gi) {
    const uint8_t* group = w + gi * gb;
    for (int64_t c = 0; c < C; ++c) {
      X8Scales s;
      x8_chunk_scales(qtype, group, g, c, s);
      x8_chunk_bytes(x8_block(group, g, c / cpb) + g.block_head + (c % cpb) * g.body, g, u);
      for (int r = 0; r < 8; ++r) {
        const int64_t n = gi * 8 + r;
        if (n < r0 || n >= r1) continue;
        T* o = dst + (n - r0) * K + c * 32;
        for (int e = 0; e < 32; ++e) {
          const int h = e >> 4;
          const float q = x8_signed(qtype) ? static_cast<float>(static_cast<int8_t>(u[r][e])) : static_cast<float>(u[r][e]);
          o[e] = static_cast<T>(s.d[r][h] * q + s.off[r][h]);
        }
      }
    }
  }
}

#if defined(__AVX2__)
// 8 floats -> 8 bf16, rounded to nearest even as c10::BFloat16 does (NaN -> 0x7FC0)
inline __m128i bf16x8(__m256 v) {
  const __m256i b = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7FFF))), 16);
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)));
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

template <typename T>
inline void store8(T* o, __m256 v) {
  if constexpr (std::is_same_v<T, float>) _mm256_storeu_ps(o, v);
  else _mm_storeu_si128(reinterpret_cast<__m128i*>(o), bf16x8(v));
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
// store8 for 16 lanes, those of k only, bf16 rounded as bf16x8 rounds
template <typename T>
inline void store16(T* o, __m512 v, __mmask16 k) {
  if constexpr (std::is_same_v<T, float>) {
    _mm512_mask_storeu_ps(o, k, v);
  } else {
    static_assert(std::is_same_v<T, at::BFloat16>);
    _mm256_mask_storeu_epi16(o, k, bf16x16_c10(v));
  }
}
#endif

// u[j] (lanes: rows 0-7, bytes: weights 4j..4j+3) -> u[r] (bytes: weights 0..31 of row r)
inline void transpose8x8(__m256i u[8]) {
  __m256i t[8], s[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_epi32(u[i], u[i + 1]);
    t[i + 1] = _mm256_unpackhi_epi32(u[i], u[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    s[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
    s[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
    s[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
    s[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int r = 0; r < 4; ++r) {
    u[r] = _mm256_permute2x128_si256(s[r], s[r + 4], 0x20);
    u[r + 4] = _mm256_permute2x128_si256(s[r], s[r + 4], 0x31);
  }
}

template <int QT, typename T>
void dequant_rows_simd(const uint8_t* w, int64_t K, int64_t r0, int64_t r1, T* dst) {
  constexpr X8Geom g = x8_geom(QT);
  const int64_t gb = x8_group_bytes(QT, K), C = K / 32;
  constexpr int cpb = g.qk / 32;
  auto widen = [](__m128i b) {
    return _mm256_cvtepi32_ps(kSignedQ<QT> ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b));
  };
  alignas(32) float da[8], db[8], oa[8], ob[8];
  for (int64_t gi = r0 / 8; gi * 8 < r1; ++gi) {
    const uint8_t* group = w + gi * gb;
    const int rlo = static_cast<int>(std::max<int64_t>(r0 - gi * 8, 0));
    const int rhi = static_cast<int>(std::min<int64_t>(r1 - gi * 8, 8));
    for (int64_t c = 0; c < C; ++c) {
      const uint8_t* h = x8_block(group, g, c / cpb);
      const int k = static_cast<int>(c % cpb);
      ChunkVec v;
      chunk_vec<QT>(group, h, k, v);
      _mm256_store_ps(da, v.da);
      _mm256_store_ps(db, v.db);
      _mm256_store_ps(oa, v.oa);
      _mm256_store_ps(ob, v.ob);
      __m256i u[8];
      decode_ymm<kBits<QT>>(h + g.block_head + k * g.body, u);
      transpose8x8(u);
      for (int r = rlo; r < rhi; ++r) {
        T* o = dst + (gi * 8 + r - r0) * K + c * 32;
        const __m128i lo = _mm256_castsi256_si128(u[r]), hi = _mm256_extracti128_si256(u[r], 1);
        const __m256 a = _mm256_set1_ps(da[r]), b = _mm256_set1_ps(db[r]);
        const __m256 x = _mm256_set1_ps(oa[r]), y = _mm256_set1_ps(ob[r]);
        store8(o, _mm256_fmadd_ps(widen(lo), a, x));
        store8(o + 8, _mm256_fmadd_ps(widen(_mm_srli_si128(lo, 8)), a, x));
        store8(o + 16, _mm256_fmadd_ps(widen(hi), b, y));
        store8(o + 24, _mm256_fmadd_ps(widen(_mm_srli_si128(hi, 8)), b, y));
      }
    }
  }
}
#endif

template <typename T>
void dequant_rows(const uint8_t* w, int qtype, int64_t K, int64_t r0, int64_t r1, T* dst) {
#if defined(__AVX2__)
  if (dispatch_qtype(qtype, [&](auto qt) { dequant_rows_simd<decltype(qt)::value>(w, K, r0, r1, dst); })) return;
#endif
  dequant_rows_scalar(w, qtype, K, r0, r1, dst);
}

}  // namespace TM_QUANT_NS

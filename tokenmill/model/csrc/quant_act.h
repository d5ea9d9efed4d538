// What the packed GEMM kernels share (quant_gemm.cpp: the one-row/x8 path and the dequantize
// path; quant_gemm_rows.cpp: the few-row path): the int8 activation rows and the SIMD decoding of
// an x8 chunk (quant_x8.h) into bytes and per-row scale vectors.
// Everything lives in the variant's own namespace (TM_QUANT_NS, one per ISA build), so that two
// variants' libraries in one process never share an inline function compiled for another ISA.
#pragma once

#include <algorithm>
#include <cmath>

#include "quant_x8.h"

#ifndef TM_QUANT_NS
#define TM_QUANT_NS tokenmill_q_scalar
#endif

namespace TM_QUANT_NS {

using namespace tmq;

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
constexpr bool kVNNI = true;
#else
constexpr bool kVNNI = false;
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__)
constexpr bool kZmm = true;
#else
constexpr bool kZmm = false;
#endif

// One quantized activation row: x ~ dx * xq per chunk c of 32, xq[K] int8 (|xq| <= 127), or with
// `fine` activations x ~ dx * (xq + xr / 256) (a second int8 for the rounding residual: ~16-bit
// precision for twice the dot products). Per chunk: dx[c], and dx * sum(xq (+ xr / 256)) over the
// chunk (s[c]) and its halves (sa[c], sb[c]).
struct ActRow {
  const int8_t* q;
  const float* dx;
  const float* s;
  const float* sa;
  const float* sb;
  const int8_t* qr;
};

inline int64_t act_row_bytes(int64_t K) { return K / 32 * 16 + 2 * K; }

inline ActRow act_row(const uint8_t* base, int64_t K) {
  const int64_t C = K / 32;
  const float* f = reinterpret_cast<const float*>(base);
  const int8_t* q = reinterpret_cast<const int8_t*>(base + C * 16);
  return {q, f, f + C, f + 2 * C, f + 3 * C, q + K};
}

#if defined(__AVX512F__) && defined(__AVX512BW__)
template <typename T>  // 16 activations as floats (T: float, or bf16 as its 16 bits)
inline __m512 load16(const T* x) {
  if constexpr (sizeof(T) == 2) {
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  } else {
    return _mm512_loadu_ps(reinterpret_cast<const float*>(x));
  }
}

// 16 lanes of quantize_row's scalar loop below: the same operations, so the same codes and sums
inline void quantize16(__m512 y, bool fine, int8_t* q, int8_t* qr, int& s, int& r) {
  const __m512 v = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512i vi = _mm512_cvtps_epi32(v);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(q), _mm512_cvtepi32_epi8(vi));
  s = _mm512_reduce_add_epi32(vi);
  if (fine) {
    const __m512 e = _mm512_mul_ps(_mm512_sub_ps(y, v), _mm512_set1_ps(256.f));
    __m512i w = _mm512_cvtps_epi32(_mm512_roundscale_ps(e, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    w = _mm512_min_epi32(_mm512_max_epi32(w, _mm512_set1_epi32(-127)), _mm512_set1_epi32(127));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(qr), _mm512_cvtepi32_epi8(w));
    r = _mm512_reduce_add_epi32(w);
  }
}
#endif

template <typename T>
void quantize_row(const T* x, int64_t K, uint8_t* dst, bool fine) {
  const int64_t C = K / 32;
  float* dx = reinterpret_cast<float*>(dst);
  float *s = dx + C, *sa = dx + 2 * C, *sb = dx + 3 * C;
  int8_t* q = reinterpret_cast<int8_t*>(dst + C * 16);
  int8_t* qr = q + K;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  for (int64_t c = 0; c < C; ++c) {
    const __m512 a = load16(x + c * 32), b = load16(x + c * 32 + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    const float scale = amax / 127.f;
    const __m512 inv = _mm512_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
    int s0, s1, r0 = 0, r1 = 0;
    quantize16(_mm512_mul_ps(a, inv), fine, q + c * 32, qr + c * 32, s0, r0);
    quantize16(_mm512_mul_ps(b, inv), fine, q + c * 32 + 16, qr + c * 32 + 16, s1, r1);
    dx[c] = scale;
    sa[c] = scale * (s0 + r0 / 256.f);
    sb[c] = scale * (s1 + r1 / 256.f);
    s[c] = sa[c] + sb[c];
  }
#else
  float xf[32];
  for (int64_t c = 0; c < C; ++c) {
    float amax = 0.f;
    for (int i = 0; i < 32; ++i) {
      xf[i] = static_cast<float>(x[c * 32 + i]);
      amax = std::max(amax, std::fabs(xf[i]));
    }
    const float scale = amax / 127.f;
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    int s0 = 0, s1 = 0, r0 = 0, r1 = 0;
    for (int i = 0; i < 32; ++i) {
      const float y = xf[i] * inv;
      const int v = static_cast<int>(std::nearbyint(y));  // |v| <= 127: never -128
      q[c * 32 + i] = static_cast<int8_t>(v);
      (i < 16 ? s0 : s1) += v;
      if (fine) {
        const int w = std::clamp(static_cast<int>(std::nearbyint((y - v) * 256.f)), -127, 127);
        qr[c * 32 + i] = static_cast<int8_t>(w);
        (i < 16 ? r0 : r1) += w;
      }
    }
    dx[c] = scale;
    sa[c] = scale * (s0 + r0 / 256.f);
    sb[c] = scale * (s1 + r1 / 256.f);
    s[c] = sa[c] + sb[c];
  }
#endif
}

#if defined(__AVX2__)
inline __m256i bits_to_bytes(uint32_t bits, uint8_t value) {  // bit i -> byte i = value or 0
  const __m256i shuf = _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0);
  __m256i b = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)), shuf);
  b = _mm256_or_si256(b, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe));
  return _mm256_and_si256(_mm256_cmpeq_epi8(b, _mm256_set1_epi64x(-1)), _mm256_set1_epi8(static_cast<char>(value)));
}

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
    if constexpr (BITS >= 5) {
      for (int j = 0; j < 8; ++j) {
        uint32_t bits;
        std::memcpy(&bits, body + 128 + 4 * j, 4);
        u[j] = _mm256_or_si256(u[j], bits_to_bytes(bits, 0x10));
      }
    }
    if constexpr (BITS == 6) {
      for (int j = 0; j < 8; ++j) {
        uint32_t bits;
        std::memcpy(&bits, body + 160 + 4 * j, 4);
        u[j] = _mm256_or_si256(u[j], bits_to_bytes(bits, 0x20));
      }
    }
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

template <int QT> constexpr int kBits = QT == Q8_0 || QT == I8_ROW ? 8 : QT == Q6_K ? 6 : (QT == Q5_0 || QT == Q5_1 || QT == Q5_K) ? 5 : 4;
template <int QT> constexpr bool kSignedQ = QT == Q8_0 || QT == I8_ROW;

template <typename Fn>
bool dispatch_qtype(int qtype, Fn&& f) {
  switch (qtype) {
    case Q4_0: f(std::integral_constant<int, Q4_0>{}); return true;
    case Q4_1: f(std::integral_constant<int, Q4_1>{}); return true;
    case Q5_0: f(std::integral_constant<int, Q5_0>{}); return true;
    case Q5_1: f(std::integral_constant<int, Q5_1>{}); return true;
    case Q8_0: f(std::integral_constant<int, Q8_0>{}); return true;
    case Q4_K: f(std::integral_constant<int, Q4_K>{}); return true;
    case Q5_K: f(std::integral_constant<int, Q5_K>{}); return true;
    case Q6_K: f(std::integral_constant<int, Q6_K>{}); return true;
    case I8_ROW: f(std::integral_constant<int, I8_ROW>{}); return true;
    case I4_G128: f(std::integral_constant<int, I4_G128>{}); return true;
    default: return false;
  }
}

// The AVX2 / scalar kernel (quant_gemm_x8.cpp): out[m][r] = row r of an x8 group . activation row
// m, for m < mr <= 4.
bool group_dot_rows(int qtype, const uint8_t* group, int64_t K, const ActRow* a, int mr, bool fine, float out[][8]);

// The AVX-512 kernel (quant_gemm_rows.cpp): out[m][r] = row r of the 16 rows of groups g0 (rows
// 0-7) and g1 (8-15) . activation row m, for m < mr <= kPairRows; false when this variant has none.
// `tile`: the mr rows as pack_tile lays them out: per chunk of 32, each row's codes (xq, then xr
// with `fine`: tile_code_bytes), then each row's dx (/ 256 with `fine`), s, sa, sb as floats.
// `pf`: prefetch while reading (gb: bytes per group, 0 for none; n0, n1: the groups read next, or null).
constexpr int kPairRows = 8;
constexpr int tile_code_bytes(bool fine) { return fine ? 64 : 32; }
inline int64_t tile_bytes(int64_t rows, int64_t K, bool fine) { return K / 32 * rows * (tile_code_bytes(fine) + 16); }
struct Ahead {
  int64_t gb;
  const uint8_t *n0, *n1;
};
void pack_tile(const ActRow* a, int mr, int64_t K, bool fine, uint8_t* dst);
void set_prefetch_ahead(int64_t bytes);  // the streaming (first) row tile's prefetch distance
bool pair_dot(int qtype, const uint8_t* g0, const uint8_t* g1, int64_t K, const uint8_t* tile, int mr, bool fine,
              const Ahead& pf, float out[][16]);

}  // namespace TM_QUANT_NS

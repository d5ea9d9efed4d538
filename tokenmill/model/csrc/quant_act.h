// What the packed GEMM kernels share (quant_gemm.cpp and the kernels it calls: quant_gemm_rows.cpp,
// quant_gemm_sb.cpp, quant_gemm_x8.cpp): the int8 activation rows, and the kernels' declarations.
// Everything lives in the variant's own namespace (TM_QUANT_NS, one per ISA build), so that two
// variants' libraries in one process never share an inline function compiled for another ISA.
#pragma once

#include <algorithm>
#include <cmath>
#include <utility>

#include "quant_x8.h"

#ifndef TM_QUANT_NS
#define TM_QUANT_NS tokenmill_q_scalar
#endif

#include "quant_act_chunk.h"
#include "quant_prefetch.h"
#include "quant_unroll.h"

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

// One quantized activation row: x ~ dx * xq, xq[K] int8 (|xq| <= 127), with one scale dx per chunk
// c of 32, or with `fine` activations x ~ dx * (xq + xr / 256) (a second int8 for the rounding
// residual: ~16-bit precision for twice the dot products). Per chunk: dx[c], and
// dx * sum(xq (+ xr / 256)) over the chunk (s[c]) and its halves (sa[c], sb[c]); bs: the integer sum
// of xq over each 16. With `pow2` scales (for weights in 256-value super-blocks, so that their
// sub-block scales apply in integers: quant_gemm_sb.cpp) a chunk's dx is its super-block's
// amax / 127 over a power of two: dx[c] = unit * 2^up[c], up[c] in 0..kMaxUp. A chunk keeps its own
// codes' range unless its amax is under 1/8 of the super-block's (where one scale per 256, as
// llama.cpp's Q8_K, cost Qwen2.5-Coder-1.5B 1.7% perplexity on 512 tokens).
struct ActRow {
  const int8_t* q;
  const float* dx;
  const float* s;
  const float* sa;
  const float* sb;
  const int8_t* qr;
  const int16_t* bs;
  const int8_t* up;
  // per super-block b, pair p: chunks 2p and 2p + 1's sums of xq, each times 2^up, as two int16 (the
  // K-quant minimums' partner in the AVX2 super-block kernel; written with pow2 scales without AVX-512)
  const int32_t* mp;
  const int16_t* q16;  // 256 xq + xr, or null: for the AVX2 kernel's 8-bit signed weights (act_q16)
};

constexpr int kMaxUp = 3;  // with 2^3 the integer sums of a Q6_K super-block stay within int32

// Whether rows carry q16: 16-bit codes for 8-bit signed weights without AVX-512 (2K more bytes a row,
// 36 MB for 2048 rows of K = 8960, and a store per code: only where a kernel reads them).
inline bool act_q16(bool fine, bool any_signed) { return fine && any_signed && !kZmm; }

// A row's layout: dx, s, sa, sb (C = K / 32 floats each), xq, xr (K each), bs (K / 16 int16), up (C),
// then from a 4-byte boundary mp (K / 256 int32) and q16 (K int16).
inline int64_t act_up_offset(int64_t K) { return K / 32 * 16 + 2 * K + K / 8; }
inline int64_t act_mp_offset(int64_t K) { return (act_up_offset(K) + K / 32 + 3) / 4 * 4; }
inline int64_t act_q16_offset(int64_t K) { return act_mp_offset(K) + K / 256 * 16; }

// whole cache lines, so that every row's float arrays stay aligned
inline int64_t act_row_bytes(int64_t K, bool q16) { return (act_q16_offset(K) + (q16 ? 2 * K : 0) + 63) / 64 * 64; }

inline ActRow act_row(const uint8_t* base, int64_t K, bool with_q16) {
  const int64_t C = K / 32;
  const float* f = reinterpret_cast<const float*>(base);
  const int8_t* q = reinterpret_cast<const int8_t*>(base + C * 16);
  const int8_t* up = reinterpret_cast<const int8_t*>(base + act_up_offset(K));
  const int32_t* mp = reinterpret_cast<const int32_t*>(base + act_mp_offset(K));
  const int16_t* q16 = with_q16 ? reinterpret_cast<const int16_t*>(base + act_q16_offset(K)) : nullptr;
  return {q, f, f + C, f + 2 * C, f + 3 * C, q + K, reinterpret_cast<const int16_t*>(q + 2 * K), up, mp, q16};
}

// A super-block's amax, amax / 127 and 127 / amax (or 0): pow2's divisions once per 256, not per chunk
struct BlockScale {
  float amax, scale, inv;
  explicit BlockScale(float a = 0.f) : amax(a), scale(a / 127.f), inv(a > 0.f ? 127.f / a : 0.f) {}
};

// A chunk's scale and its inverse: amax_c / 127, or with pow2 the super-block's amax_b / 127 over the
// largest 2^s (s <= kMaxUp) that keeps the chunk's codes within 127 (exact: the kernel shifts by up).
inline void chunk_scale(float amax_c, const BlockScale& b, bool pow2, float& scale, float& inv, int8_t& up) {
  if (!pow2) {
    scale = amax_c / 127.f;
    inv = amax_c > 0.f ? 127.f / amax_c : 0.f;
    up = 0;
    return;
  }
  // times 2^-s, 2^s: exact, or rounded once as ldexp rounds (a libm call per chunk). A branch-free
  // count of s ran 10-17% slower than this loop, which mostly stops at its first test.
  int s = 0;
  while (s < kMaxUp && amax_c * static_cast<float>(2 << s) <= b.amax) ++s;
  scale = b.scale * (1.f / static_cast<float>(1 << s));
  inv = b.inv * static_cast<float>(1 << s);
  up = static_cast<int8_t>(kMaxUp - s);
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
void quantize_row(const T* x, int64_t K, uint8_t* dst, bool fine, bool pow2 = false, bool with_q16 = false) {
  const int64_t C = K / 32;
  float* dx = reinterpret_cast<float*>(dst);
  float *s = dx + C, *sa = dx + 2 * C, *sb = dx + 3 * C;
  int8_t* q = reinterpret_cast<int8_t*>(dst + C * 16);
  int8_t* qr = q + K;
  int16_t* bs = reinterpret_cast<int16_t*>(q + 2 * K);
  int8_t* up = reinterpret_cast<int8_t*>(dst + act_up_offset(K));
#if defined(__AVX512F__) && defined(__AVX512BW__)
  BlockScale block;
  for (int64_t c = 0; c < C; ++c) {
    const __m512 a = load16(x + c * 32), b = load16(x + c * 32 + 16);
    if (pow2 && c % 8 == 0) {
      __m512 m = _mm512_setzero_ps();
      for (int i = 0; i < 256; i += 16) m = _mm512_max_ps(m, _mm512_abs_ps(load16(x + c * 32 + i)));
      block = BlockScale(_mm512_reduce_max_ps(m));
    }
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    float scale, vinv;
    chunk_scale(amax, block, pow2, scale, vinv, up[c]);
    const __m512 inv = _mm512_set1_ps(vinv);
    int s0, s1, r0 = 0, r1 = 0;
    quantize16(_mm512_mul_ps(a, inv), fine, q + c * 32, qr + c * 32, s0, r0);
    quantize16(_mm512_mul_ps(b, inv), fine, q + c * 32 + 16, qr + c * 32 + 16, s1, r1);
    dx[c] = scale;
    sa[c] = scale * (s0 + r0 / 256.f);
    sb[c] = scale * (s1 + r1 / 256.f);
    s[c] = sa[c] + sb[c];
    bs[2 * c] = static_cast<int16_t>(s0);
    bs[2 * c + 1] = static_cast<int16_t>(s1);
  }
#else
  int16_t* q16 = with_q16 ? reinterpret_cast<int16_t*>(dst + act_q16_offset(K)) : nullptr;
  int32_t* mp = reinterpret_cast<int32_t*>(dst + act_mp_offset(K));
  BlockScale block;
  for (int64_t c = 0; c < C; ++c) {
    if (pow2 && c % 8 == 0) block = BlockScale(abs_max(x + c * 32, 256));
    float scale, inv;
    chunk_scale(abs_max(x + c * 32, 32), block, pow2, scale, inv, up[c]);
    int sq[2], sr[2];  // the halves' sums of codes and of residual codes
    quantize_chunk(x + c * 32, inv, fine, q + c * 32, qr + c * 32, q16 ? q16 + c * 32 : nullptr, sq, sr);
    dx[c] = scale;
    sa[c] = scale * (sq[0] + sr[0] / 256.f);
    sb[c] = scale * (sq[1] + sr[1] / 256.f);
    s[c] = sa[c] + sb[c];
    bs[2 * c] = static_cast<int16_t>(sq[0]);
    bs[2 * c + 1] = static_cast<int16_t>(sq[1]);
    if (pow2 && c % 8 == 7) {  // |sum| <= 32 * 127, times 2^3: within int16
      const int64_t c0 = c - 7;
      for (int p = 0; p < 4; ++p) {
        const int64_t a = c0 + 2 * p;
        const auto lo = static_cast<uint16_t>((bs[2 * a] + bs[2 * a + 1]) * (1 << up[a]));
        const auto hi = static_cast<uint16_t>((bs[2 * a + 2] + bs[2 * a + 3]) * (1 << up[a + 1]));
        mp[c0 / 2 + p] = static_cast<int32_t>(lo | static_cast<uint32_t>(hi) << 16);
      }
    }
  }
#endif
}

template <int QT> constexpr int kBits = QT == Q8_0 || QT == I8_ROW ? 8 : QT == Q6_K ? 6 : (QT == Q5_0 || QT == Q5_1 || QT == Q5_K) ? 5 : 4;
template <int QT> constexpr bool kSignedQ = x8_signed(QT);

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
// m, for m < mr <= 8.
bool group_dot_rows(int qtype, const uint8_t* group, int64_t K, const ActRow* a, int mr, bool fine, float out[][8],
                    StreamPrefetch* pf = nullptr);
// The same for one weight type (quant_x8_dot.h; instantiated in quant_gemm_x8_*.cpp).
template <int QT>
bool group_dot_rows_qt(const uint8_t* group, int64_t K, const ActRow* a, int mr, bool fine, float out[][8],
                       StreamPrefetch* pf);
// The same for Q4_K and Q5_K against 8-bit codes with pow2 scales (quant_gemm_x8sb.cpp): the
// sub-block scales in integers; false for other types, or without AVX2.
bool group_dot_rows_sb(int qtype, const uint8_t* group, int64_t K, const ActRow* a, int mr, float out[][8],
                       StreamPrefetch* pf = nullptr);

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
// The super-block kernel (quant_gemm_sb.cpp): pair_dot for Q4_K, Q5_K and Q6_K weights against 8-bit
// activation codes with one scale per 256 (ActRow's block 256), its tile laid out by pack_tile_sb
// (tile_bytes(rows, K, false) bytes).
inline bool sb_type(int qtype) { return qtype == Q4_K || qtype == Q5_K || qtype == Q6_K; }
void pack_tile_sb(const ActRow* a, int mr, int64_t K, uint8_t* dst);
bool pair_dot_sb(int qtype, const uint8_t* g0, const uint8_t* g1, int64_t K, const uint8_t* tile, int mr,
                 const Ahead& pf, float out[][16]);
// the streaming (first) row tile's prefetch distance, and the cache level it prefetches into (1 or 2)
void set_prefetch_ahead(int64_t bytes, int64_t level);
bool pair_dot(int qtype, const uint8_t* g0, const uint8_t* g1, int64_t K, const uint8_t* tile, int mr, bool fine,
              const Ahead& pf, float out[][16]);

}  // namespace TM_QUANT_NS

// The few-row packed kernel without AVX-512 (AVX2, or portable scalar code): x[M, K] . W^T, 8
// output rows (one x8 group) at a time, up to 4 activation rows per decoded chunk. Each lane of
// a ymm is one output row, so there are no horizontal sums; with AVX-512, quant_gemm_rows.cpp
// runs instead.
#include <cstring>

#include "quant_ymm.h"

namespace TM_QUANT_NS {

namespace {

// out[m][r] (m < MR, r < 8) = row r of a group . activation row m
template <int QT, int MR, bool RES>
void group_dot(const uint8_t* group, const X8Geom& g, int64_t K, const ActRow* a, float out[][8]) {
  const int64_t C = K / 32;
  const int cpb = g.qk / 32;
#if defined(__AVX2__)
  constexpr bool kSigned = kSignedQ<QT>;
  constexpr bool kTwo = QT == Q6_K;
  __m256 acc[MR], aco[MR];
  for (int m = 0; m < MR; ++m) acc[m] = aco[m] = _mm256_setzero_ps();
  for (int64_t c = 0; c < C; ++c) {
    const int k = static_cast<int>(c % cpb);
    const uint8_t* h = x8_block(group, g, c / cpb);
    const uint8_t* body = h + g.block_head + k * g.body;
    ChunkVec v;
    chunk_vec<QT>(group, h, k, v);
    __m256i ra[MR], rb[MR];
    __m256i u[8];
    decode_ymm<kBits<QT>>(body, u);
    for (int m = 0; m < MR; ++m) {
      // Unsigned codes of b bits against int8 codes: a maddubs pair is at most 2 * (2^b - 1) * 128,
      // so 8 (4 bits), 4 (5) or 2 (6) of them add up in int16 exactly before one madd widens them.
      auto dots = [&](const int8_t* xq, __m256i& oa, __m256i& ob) {
      auto mb = [&](int j) {
        int32_t xg;
        std::memcpy(&xg, xq + 4 * j, 4);
        const __m256i x = _mm256_set1_epi32(xg);
        if constexpr (kSigned) return _mm256_maddubs_epi16(_mm256_sign_epi8(u[j], u[j]), _mm256_sign_epi8(x, u[j]));
        else return _mm256_maddubs_epi16(u[j], x);
      };
      const __m256i ones = _mm256_set1_epi16(1);
      auto wide = [&](__m256i v) { return _mm256_madd_epi16(v, ones); };
      auto add16 = [](__m256i a, __m256i b) { return _mm256_add_epi16(a, b); };
      auto add32 = [](__m256i a, __m256i b) { return _mm256_add_epi32(a, b); };
      __m256i lo, hi;
      if constexpr (kBits<QT> == 4) {
        lo = add16(add16(mb(0), mb(1)), add16(mb(2), mb(3)));
        hi = add16(add16(mb(4), mb(5)), add16(mb(6), mb(7)));
      } else if constexpr (kBits<QT> == 5) {
        lo = wide(add16(add16(mb(0), mb(1)), add16(mb(2), mb(3))));
        hi = wide(add16(add16(mb(4), mb(5)), add16(mb(6), mb(7))));
      } else if constexpr (kBits<QT> == 6) {
        lo = add32(wide(add16(mb(0), mb(1))), wide(add16(mb(2), mb(3))));
        hi = add32(wide(add16(mb(4), mb(5))), wide(add16(mb(6), mb(7))));
      } else {
        lo = add32(add32(wide(mb(0)), wide(mb(1))), add32(wide(mb(2)), wide(mb(3))));
        hi = add32(add32(wide(mb(4)), wide(mb(5))), add32(wide(mb(6)), wide(mb(7))));
      }
      if constexpr (kTwo) {
        oa = lo;
        ob = hi;
      } else if constexpr (kBits<QT> == 4) {
        oa = wide(add16(lo, hi));
      } else {
        oa = add32(lo, hi);
      }
      };
      dots(a[m].q + c * 32, ra[m], rb[m]);
      if constexpr (RES) {
        __m256i fa, fb;
        dots(a[m].qr + c * 32, fa, fb);
        ra[m] = _mm256_add_epi32(_mm256_slli_epi32(ra[m], 8), fa);
        if constexpr (kTwo) rb[m] = _mm256_add_epi32(_mm256_slli_epi32(rb[m], 8), fb);
      }
    }
    for (int m = 0; m < MR; ++m) {
      const __m256 dx = _mm256_set1_ps(RES ? a[m].dx[c] / 256.f : a[m].dx[c]);
      if constexpr (kTwo) {
        acc[m] = _mm256_fmadd_ps(v.da, _mm256_mul_ps(_mm256_cvtepi32_ps(ra[m]), dx), acc[m]);
        acc[m] = _mm256_fmadd_ps(v.db, _mm256_mul_ps(_mm256_cvtepi32_ps(rb[m]), dx), acc[m]);
        aco[m] = _mm256_fmadd_ps(v.oa, _mm256_set1_ps(a[m].sa[c]), aco[m]);
        aco[m] = _mm256_fmadd_ps(v.ob, _mm256_set1_ps(a[m].sb[c]), aco[m]);
      } else {
        acc[m] = _mm256_fmadd_ps(v.da, _mm256_mul_ps(_mm256_cvtepi32_ps(ra[m]), dx), acc[m]);
        aco[m] = _mm256_fmadd_ps(v.oa, _mm256_set1_ps(a[m].s[c]), aco[m]);
      }
    }
  }
  for (int m = 0; m < MR; ++m) _mm256_storeu_ps(out[m], _mm256_add_ps(acc[m], aco[m]));
#else
  float acc[MR][8] = {};
  uint8_t u[8][32];
  for (int64_t c = 0; c < C; ++c) {
    const uint8_t* body = x8_block(group, g, c / cpb) + g.block_head + (c % cpb) * g.body;
    X8Scales s;
    x8_chunk_scales(QT, group, g, c, s);
    x8_chunk_bytes(body, g, u);
    for (int r = 0; r < 8; ++r) {
      for (int m = 0; m < MR; ++m) {
        const int8_t* x = a[m].q + c * 32;
        const int8_t* xr = a[m].qr + c * 32;
        int d0 = 0, d1 = 0;
        for (int i = 0; i < 16; ++i) {
          const int w0 = kSignedQ<QT> ? static_cast<int8_t>(u[r][i]) : u[r][i];
          const int w1 = kSignedQ<QT> ? static_cast<int8_t>(u[r][i + 16]) : u[r][i + 16];
          d0 += w0 * (RES ? 256 * x[i] + xr[i] : x[i]);
          d1 += w1 * (RES ? 256 * x[i + 16] + xr[i + 16] : x[i + 16]);
        }
        const float dx = RES ? a[m].dx[c] / 256.f : a[m].dx[c];
        acc[m][r] += dx * (s.d[r][0] * d0 + s.d[r][1] * d1) + s.off[r][0] * a[m].sa[c] + s.off[r][1] * a[m].sb[c];
      }
    }
  }
  for (int m = 0; m < MR; ++m)
    for (int r = 0; r < 8; ++r) out[m][r] = acc[m][r];
#endif
}

}  // namespace

bool group_dot_rows(int qtype, const uint8_t* group, int64_t K, const ActRow* a, int mr, bool fine, float out[][8]) {
  const X8Geom g = x8_geom(qtype);
  return dispatch_qtype(qtype, [&](auto qt) {
    constexpr int QT = decltype(qt)::value;
    auto run = [&](auto res_tag) {
      constexpr bool R = decltype(res_tag)::value;
      switch (mr) {
        case 4: group_dot<QT, 4, R>(group, g, K, a, out); break;
        case 3: group_dot<QT, 3, R>(group, g, K, a, out); break;
        case 2: group_dot<QT, 2, R>(group, g, K, a, out); break;
        default: group_dot<QT, 1, R>(group, g, K, a, out); break;
      }
    };
    if (fine) run(std::true_type{});
    else run(std::false_type{});
  });
}

}  // namespace TM_QUANT_NS

// The AVX2 / scalar few-row packed kernel (x[M, K] . W^T, 8 output rows, one x8 group, at a time, up
// to 8 activation rows per decoded chunk), instantiated for a few weight types per translation unit
// (quant_gemm_x8_*.cpp): all ten types x 8 row counts x 2 code widths, each body fully unrolled, took
// one compiler 40 s in one file, the longest step of a machine's first start. Each lane of a ymm is
// one output row, so there are no horizontal sums; with AVX-512, quant_gemm_rows.cpp runs instead.
#pragma once

#include <cstring>

#include "quant_ymm.h"

namespace TM_QUANT_NS {

namespace {

#if defined(__AVX2__)
// Int32 sums of a chunk of 8-bit signed weights (Q8_0, I8_ROW) against 16-bit activation codes
// (256 xq + xr, quant_act.h), per row m, in madd: the weights widened once for all rows. The sign
// trick of 8-bit codes took two maddubs, two signs and two madds a product here, each pair's sum
// alone in int16. The same exact integers.
template <int MR>
TM_INLINE inline void signed_fine_sums(const uint8_t* body, const ActRow* a, int64_t c, __m256i ra[]) {
  auto ld16 = [](const uint8_t* p) { return _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); };
  __m256i lo[MR], hi[MR];  // int32 lanes: rows 0-3 (lo) or 4-7 (hi), two lanes a row
  static_for<8>([&](auto jc) TM_INLINE {
    constexpr int j = decltype(jc)::value;
    const __m256i wl = ld16(body + 32 * j), wh = ld16(body + 32 * j + 16);
    static_for<MR>([&](auto mc) TM_INLINE {
      constexpr int m = decltype(mc)::value;
      int64_t xg;
      std::memcpy(&xg, a[m].q16 + c * 32 + 4 * j, 8);
      const __m256i x = _mm256_set1_epi64x(xg);
      const __m256i pl = _mm256_madd_epi16(wl, x), ph = _mm256_madd_epi16(wh, x);
      lo[m] = j == 0 ? pl : _mm256_add_epi32(lo[m], pl);
      hi[m] = j == 0 ? ph : _mm256_add_epi32(hi[m], ph);
      __asm__("" : "+x"(lo[m]), "+x"(hi[m]));
    });
  });
  // hadd: rows 0, 1, 4, 5 | 2, 3, 6, 7; the 64-bit pairs back in row order
  static_for<MR>([&](auto mc) TM_INLINE {
    constexpr int m = decltype(mc)::value;
    ra[m] = _mm256_permute4x64_epi64(_mm256_hadd_epi32(lo[m], hi[m]), 0xD8);
  });
}
#endif

// out[m][r] (m < MR, r < 8) = row r of a group . activation row m
template <int QT, int MR, bool RES>
void group_dot(const uint8_t* group, int64_t K, const ActRow* a, float out[][8], StreamPrefetch* pf) {
  constexpr X8Geom g = x8_geom(QT);
  constexpr int cpb = g.qk / 32;
#if defined(__AVX2__)
  // Blocks and chunks as nested loops over compile-time sizes (a chunk index divided by a runtime
  // chunks-per-block cost an idiv per chunk), and the weight vectors decoded as the terms use them,
  // fewer of them live at once (the float accumulators had been spilled, each chunk's FMA waiting
  // on a store-to-load forward). The integer sums are the same exact ones in any order.
  constexpr bool kSigned = kSignedQ<QT>;
  constexpr bool kTwo = QT == Q6_K;
  constexpr int kB = kBits<QT>;
  // Unsigned codes of b bits against int8 codes: a maddubs pair is at most 2 * (2^b - 1) * 128,
  // so 8 (4 bits), 4 (5), 2 (6) or 1 (8) of them add up in int16 exactly before one madd widens them.
  constexpr int kRun = kB == 4 ? 8 : kB == 5 ? 4 : kB == 6 ? 2 : 1;
  constexpr int64_t block_bytes = g.block_head + cpb * g.body;
  const __m256i m4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  auto ld = [](const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); };
  __m256 acc[MR], aco[MR];
  for (int m = 0; m < MR; ++m) acc[m] = aco[m] = _mm256_setzero_ps();
  const int64_t nb = K / g.qk;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* h = group + g.group_head + b * block_bytes;
    for (int k = 0; k < cpb; ++k) {
      const int64_t c = b * cpb + k;
      const uint8_t* body = h + g.block_head + k * g.body;
      if (pf) pf->upto(body + g.body);
      __m256i u8[8];  // 5 and 6 bits: all vectors decoded at once (their high-bit planes are shared)
      if constexpr (kB == 5 || kB == 6) decode_ymm<kB>(body, u8);
      auto u = [&](auto jc) TM_INLINE {  // weights 4j..4j+3 of each row, as bytes
        constexpr int j = decltype(jc)::value;
        if constexpr (kB == 8) return ld(body + 32 * j);
        else if constexpr (kB == 4) {
          if constexpr (j < 4) return _mm256_and_si256(ld(body + 32 * j), m4);
          else return _mm256_and_si256(_mm256_srli_epi16(ld(body + 32 * (j - 4)), 4), m4);
        } else return u8[j];
      };
      auto term = [&](const __m256i& w, const int8_t* xq) TM_INLINE {
        int32_t xg;
        std::memcpy(&xg, xq, 4);
        const __m256i x = _mm256_set1_epi32(xg);
        if constexpr (kSigned) return _mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w));
        else return _mm256_maddubs_epi16(w, x);
      };
      // ra: int32 sums of the chunk (of its first half with kTwo; rb the second), per row m. Every
      // index below is a compile-time one: as a runtime loop over j, GCC kept the weight vectors'
      // loop and copied the 16-bit sums between registers at each step (~2.5 ops of 4 a product).
      __m256i ra[MR], rb[MR];
      if constexpr (kSigned && RES) signed_fine_sums<MR>(body, a, c, ra);
      else static_for<8 / kRun>([&](auto run) TM_INLINE {
        constexpr int j0 = decltype(run)::value * kRun;
        __m256i s16[MR], f16[MR];
        static_for<kRun>([&](auto jj) TM_INLINE {
          constexpr int j = j0 + decltype(jj)::value;
          const __m256i w = u(std::integral_constant<int, j>{});
          static_for<MR>([&](auto mc) TM_INLINE {
            constexpr int m = decltype(mc)::value;
            const __m256i t = term(w, a[m].q + c * 32 + 4 * j);
            s16[m] = j == j0 ? t : _mm256_add_epi16(s16[m], t);
            // keeps each sum a chain: GCC reassociated them into trees, all products live at once
            __asm__("" : "+x"(s16[m]));
            if constexpr (RES) {
              const __m256i f = term(w, a[m].qr + c * 32 + 4 * j);
              f16[m] = j == j0 ? f : _mm256_add_epi16(f16[m], f);
              __asm__("" : "+x"(f16[m]));
            }
          });
        });
        static_for<MR>([&](auto mc) TM_INLINE {
          constexpr int m = decltype(mc)::value;
          // 16-bit codes: the residual codes' sum joins at once (one int32 accumulator a row, not
          // two: with 4 rows they had pushed the float accumulators out of the 16 registers)
          __m256i s32 = _mm256_madd_epi16(s16[m], ones);
          if constexpr (RES) s32 = _mm256_add_epi32(_mm256_slli_epi32(s32, 8), _mm256_madd_epi16(f16[m], ones));
          constexpr bool second = kTwo && j0 >= 4;
          __m256i& dst = second ? rb[m] : ra[m];
          if constexpr (j0 == 0 || (second && j0 == 4)) dst = s32;
          else dst = _mm256_add_epi32(dst, s32);
        });
      });
      ChunkVec v;
      chunk_vec<QT>(group, h, k, v);
      for (int m = 0; m < MR; ++m) {
        const __m256 dx = _mm256_set1_ps(RES ? a[m].dx[c] / 256.f : a[m].dx[c]);
        acc[m] = _mm256_fmadd_ps(v.da, _mm256_mul_ps(_mm256_cvtepi32_ps(ra[m]), dx), acc[m]);
        if constexpr (kTwo) {
          acc[m] = _mm256_fmadd_ps(v.db, _mm256_mul_ps(_mm256_cvtepi32_ps(rb[m]), dx), acc[m]);
          aco[m] = _mm256_fmadd_ps(v.oa, _mm256_set1_ps(a[m].sa[c]), aco[m]);
          aco[m] = _mm256_fmadd_ps(v.ob, _mm256_set1_ps(a[m].sb[c]), aco[m]);
        } else if constexpr (!kSigned) {  // Q8_0 / I8_ROW have no offset (0 x s added nothing)
          aco[m] = _mm256_fmadd_ps(v.oa, _mm256_set1_ps(a[m].s[c]), aco[m]);
        }
      }
    }
  }
  for (int m = 0; m < MR; ++m) _mm256_storeu_ps(out[m], _mm256_add_ps(acc[m], aco[m]));
#else
  float acc[MR][8] = {};
  uint8_t u[8][32];
  for (int64_t c = 0; c < K / 32; ++c) {
    const uint8_t* body = x8_block(group, g, c / cpb) + g.block_head + (c % cpb) * g.body;
    if (pf) pf->upto(body + g.body);
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

template <int QT>
bool group_dot_rows_qt(const uint8_t* group, int64_t K, const ActRow* a, int mr, bool fine, float out[][8],
                       StreamPrefetch* pf) {
  auto run = [&](auto res_tag) {
    constexpr bool R = decltype(res_tag)::value;
    dispatch_rows(mr, [&](auto rows) { group_dot<QT, decltype(rows)::value, R>(group, K, a, out, pf); });
  };
  if (fine) run(std::true_type{});
  else run(std::false_type{});
  return true;
}

}  // namespace TM_QUANT_NS

// One type's instances, in the translation unit that names it.
#define TM_X8_INSTANCES(QT)                                                                                \
  template bool TM_QUANT_NS::group_dot_rows_qt<TM_QUANT_NS::QT>(const uint8_t*, int64_t, const ActRow*, int, \
                                                                bool, float[][8], StreamPrefetch*);

// The AVX2 super-block kernel: group_dot (quant_x8_dot.h) for Q4_K and Q5_K weights against 8-bit
// activation codes whose chunk scales are a super-block unit times 2^up (quant_act.h), as
// quant_gemm_sb.cpp does with AVX-512. A chunk's 16-bit sums meet its 6-bit sub-block scales in the
// vpmaddwd that widens them, then 2^up in a shift, and the floats come in once per super-block: the
// per-chunk float epilogue (int-to-float, two scales and two FMAs a row, and the scales' own decode)
// ran on the ports of vpmaddubsw. The minimums meet the rows' shifted chunk sums (ActRow::mp) in four
// vpmaddwd a super-block. Lane = output row. Q6_K stays on group_dot: with two scales a chunk and its
// -32 offset, the integer form measured no faster there.
#include <cstring>

#include "quant_ymm.h"

namespace TM_QUANT_NS {

#if defined(__AVX2__)
namespace {

template <int QT, int MR>
void group_dot_sb(const uint8_t* group, int64_t K, const ActRow* a, float out[][8], StreamPrefetch* pf) {
  constexpr X8Geom g = x8_geom(QT);
  constexpr int kB = kBits<QT>;
  // unsigned codes of 4 (5) bits against int8 codes: 8 (4) maddubs pairs add up in int16 exactly
  constexpr int kRun = kB == 4 ? 8 : 4;
  const int64_t blk = g.block_head + 8 * g.body;
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  auto ld = [](const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); };
  __m256 acc[MR];
  for (int m = 0; m < MR; ++m) acc[m] = _mm256_setzero_ps();
  for (int64_t b = 0; b < K / 256; ++b) {
    const uint8_t* h = group + g.group_head + b * blk;
    __m256i isum[MR];
    for (int m = 0; m < MR; ++m) isum[m] = _mm256_setzero_si256();
#pragma GCC unroll 1
    for (int k = 0; k < 8; ++k) {
      const int64_t c = b * 8 + k;
      const uint8_t* body = h + g.block_head + k * g.body;
      if (pf) pf->upto(body + g.body);
      __m256i u8[8];
      if constexpr (kB == 5) decode_ymm<5>(body, u8);
      auto u = [&](auto jc) TM_INLINE {
        constexpr int j = decltype(jc)::value;
        if constexpr (kB == 5) return u8[j];
        else if constexpr (j < 4) return _mm256_and_si256(ld(body + 32 * j), m4);
        else return _mm256_and_si256(_mm256_srli_epi16(ld(body + 32 * (j - 4)), 4), m4);
      };
      // the sub-block scales as int16 pairs (sc, sc); a row's 2^up shifts its int32 sums, the same
      // integers as scales shifted first. A table of the four shifted scales, built on the stack each
      // chunk and read back at an index, ran 1.1-1.35x slower in cache at 1-4 rows (BENCHMARKS.md).
      const __m128i sc8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(h + 32 + 8 * k));
      const __m256i sc = _mm256_cvtepu8_epi32(sc8);
      const __m256i sc2 = _mm256_or_si256(sc, _mm256_slli_epi32(sc, 16));
      __m128i ups[MR];
      for (int m = 0; m < MR; ++m) ups[m] = _mm_cvtsi32_si128(a[m].up[c]);
      static_for<8 / kRun>([&](auto run) TM_INLINE {
        constexpr int j0 = decltype(run)::value * kRun;
        __m256i s16[MR];
        static_for<kRun>([&](auto jj) TM_INLINE {
          constexpr int j = j0 + decltype(jj)::value;
          const __m256i w = u(std::integral_constant<int, j>{});
          static_for<MR>([&](auto mc) TM_INLINE {
            constexpr int m = decltype(mc)::value;
            int32_t xg;
            std::memcpy(&xg, a[m].q + c * 32 + 4 * j, 4);
            const __m256i t = _mm256_maddubs_epi16(w, _mm256_set1_epi32(xg));
            s16[m] = j == j0 ? t : _mm256_add_epi16(s16[m], t);
            __asm__("" : "+x"(s16[m]));  // a chain, not a tree of all products (quant_x8_dot.h)
          });
        });
        static_for<MR>([&](auto mc) TM_INLINE {
          constexpr int m = decltype(mc)::value;
          isum[m] = _mm256_add_epi32(isum[m], _mm256_sll_epi32(_mm256_madd_epi16(s16[m], sc2), ups[m]));
        });
      });
    }
    // isum: sum over chunks of sc 2^up (weights . codes), in units of d x unit; the minimums' term
    // the same in dmin x unit. At most 8 x 63 x 8 x (32 x 15 x 127): within int32.
    const __m256 d = ld_ph8(h), dmin = ld_ph8(h + 16);
    __m256i mins[4];  // lane r: the minimums of chunks 2p and 2p + 1 as two int16
    for (int p = 0; p < 4; ++p) {
      const __m128i lo = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(h + 96 + 16 * p));
      const __m128i hi = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(h + 104 + 16 * p));
      mins[p] = _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(lo, hi));
    }
    for (int m = 0; m < MR; ++m) {
      const float unit = a[m].dx[8 * b] / static_cast<float>(1 << a[m].up[8 * b]);  // exact
      const __m256 vu = _mm256_set1_ps(unit);
      const int32_t* mp = a[m].mp + 4 * b;
      __m256i im = _mm256_madd_epi16(mins[0], _mm256_set1_epi32(mp[0]));
      for (int p = 1; p < 4; ++p) im = _mm256_add_epi32(im, _mm256_madd_epi16(mins[p], _mm256_set1_epi32(mp[p])));
      acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[m]), _mm256_mul_ps(d, vu), acc[m]);
      acc[m] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(im), _mm256_mul_ps(dmin, vu), acc[m]);
    }
  }
  for (int m = 0; m < MR; ++m) _mm256_storeu_ps(out[m], acc[m]);
}

}  // namespace

bool group_dot_rows_sb(int qtype, const uint8_t* group, int64_t K, const ActRow* a, int mr, float out[][8],
                       StreamPrefetch* pf) {
  auto run = [&](auto qt) {
    constexpr int QT = decltype(qt)::value;
    dispatch_rows(mr, [&](auto rows) { group_dot_sb<QT, decltype(rows)::value>(group, K, a, out, pf); });
  };
  switch (qtype) {
    case Q4_K: run(std::integral_constant<int, Q4_K>{}); return true;
    case Q5_K: run(std::integral_constant<int, Q5_K>{}); return true;
    default: return false;
  }
}

#else

bool group_dot_rows_sb(int, const uint8_t*, int64_t, const ActRow*, int, float[][8], StreamPrefetch*) { return false; }

#endif

}  // namespace TM_QUANT_NS

// The super-block kernel: pair_dot (quant_gemm_rows.cpp) for Q4_K, Q5_K and Q6_K weights against
// 8-bit activation codes whose chunk scales are a super-block unit times 2^up (quant_act.h). Each
// 32-weight chunk's integer dot product takes its 6- or 8-bit sub-block scale in int32 (one vpmulld
// per row, two for Q6_K's halves) and its activation scale as a shift, and the floats come in once
// per super-block: the per-chunk float epilogue of pair_dot (int-to-float, scale, two FMAs per row)
// ran on the same multiply ports as vpdpbusd and held the kernel near half their peak.
// Q4_K/Q5_K's minimums (dmin * m per chunk) meet the activations' shifted per-chunk sums in
// vpdpwssd, once per super-block; Q6_K's -32 offset starts each chunk's chains (-32 x the codes'
// sums, broadcast from the tile: a load, where a subtraction took a vector-ALU slot per half and row).
// At 6+ rows Q4_K/Q5_K take a chunk's scale times 2^up from a 4-entry table built once per chunk
// instead of shifting each row's product (the ALU pipes, not the dot products', bound those rows).
// A lane is an output row, a row's result does not depend on the rows beside it.
#include <cmath>
#include <cstring>

#include "quant_zmm.h"

namespace TM_QUANT_NS {

#if defined(__AVX512F__) && defined(__AVX512BW__)
namespace {

using namespace zmm;

// Tile (pack_tile_sb), per super-block: the 8 chunks' codes (chunk k, row m at (k * MR + m) * 32),
// then per row a record of 32 int32: [0] the unit (float bits), [4 + p] the activation sums of
// chunks 2p and 2p + 1, each shifted by its up, as two int16 (<= 4064 << 3), [8 + k] chunk k's up,
// [16 + h] -32 x the sum of half h (16 values).
constexpr int kRecInts = 32;
constexpr int64_t kSbRowBytes = 256 + 4 * kRecInts;

inline __m512i ld_bytes16(const uint8_t* p, const uint8_t* q, bool sign) {
  const __m128i v = _mm_unpacklo_epi64(ld8(p), ld8(q));
  return sign ? _mm512_cvtepi8_epi32(v) : _mm512_cvtepu8_epi32(v);
}

inline __m512i dpwssd(__m512i acc, __m512i a, __m512i b) {
  if constexpr (kVNNI) return _mm512_dpwssd_epi32(acc, a, b);
  else return _mm512_add_epi32(acc, _mm512_madd_epi16(a, b));
}

// R rows of chunk k: isum[r] += sub-block scale x (the chunk's 32 weights . the row's 32 codes).
// tab (kTab): the chunk's scale shifted by 0..3, 16 int32 each.
template <int QT, int R, bool kTab>
__attribute__((always_inline)) inline void rows_sb(const __m512i W[8], const uint8_t* tc, const int32_t* rec, int k,
                                                   __m512i sa, __m512i sb, const int32_t* tab, __m512i* isum) {
  __m512i lo[R], hi[R];
  static_for<R>([&](auto r) TM_INLINE {
    if constexpr (QT == Q6_K) {
      lo[r] = _mm512_set1_epi32(rec[kRecInts * r + 16 + 2 * k]);
      hi[r] = _mm512_set1_epi32(rec[kRecInts * r + 17 + 2 * k]);
    } else {
      lo[r] = hi[r] = _mm512_setzero_si512();
    }
  });
  static_for<4>([&](auto j) TM_INLINE {
    static_for<R>([&](auto r) TM_INLINE {
      const int8_t* x = reinterpret_cast<const int8_t*>(tc + r * 32);
      lo[r] = dp<false>(lo[r], W[j], x + 4 * j);
      hi[r] = dp<false>(hi[r], W[j + 4], x + 16 + 4 * j);
    });
  });
  static_for<R>([&](auto r) TM_INLINE {
    const int32_t* rr = rec + kRecInts * r;
    __m512i v;
    if constexpr (QT == Q6_K) {
      v = _mm512_add_epi32(_mm512_mullo_epi32(lo[r], sa), _mm512_mullo_epi32(hi[r], sb));
    } else if constexpr (kTab) {  // the scale carries the 2^up
      v = _mm512_mullo_epi32(_mm512_add_epi32(lo[r], hi[r]), _mm512_load_si512(tab + 16 * rr[8 + k]));
    } else {
      v = _mm512_mullo_epi32(_mm512_add_epi32(lo[r], hi[r]), sa);
    }
    if constexpr (!kTab) v = _mm512_sllv_epi32(v, _mm512_set1_epi32(rr[8 + k]));
    isum[r] = _mm512_add_epi32(isum[r], v);
  });
}

// Word 2L + j of min-pair vector q (lane L, chunk 2q + j of four) from four chunks' minimums as words:
// group 0's row r of chunk c at 8c + r, group 1's at 32 + 8c + r. Two permutes build what took eight
// byte loads, four shifts and four ors per super-block (a few % of the kernel at 1-8 rows).
struct MinPairIndex {
  alignas(64) int16_t idx[2][32];
};
constexpr MinPairIndex min_pair_index() {
  MinPairIndex t{};
  for (int q = 0; q < 2; ++q)
    for (int L = 0; L < 16; ++L)
      for (int j = 0; j < 2; ++j) t.idx[q][2 * L + j] = static_cast<int16_t>((L < 8 ? 0 : 32) + 8 * (2 * q + j) + L % 8);
  return t;
}
constexpr MinPairIndex kMinPairs = min_pair_index();

template <int QT, int MR>
__attribute__((noinline)) void sb_dot_t(const uint8_t* g0, const uint8_t* g1, int64_t K, const uint8_t* tile,
                                        const Ahead& pf, float out[][16]) {
  constexpr X8Geom g = x8_geom(QT);
  const int64_t nb = K / 256, blk = g.block_head + 8 * g.body;
  Prefetcher ahead(g0, g1, pf, K / 32);
  __m512 acc[MR];  // compile-time indices only, as in pair_dot_t (quant_gemm_rows.cpp)
  static_for<MR>([&](auto m) TM_INLINE { acc[m] = _mm512_setzero_ps(); });
  constexpr bool kTab = QT != Q6_K && MR >= 6;  // measured: even at 4 rows, slower at 1-2
  alignas(64) int32_t tab[kTab ? 64 : 16];
  const uint8_t* tb = tile;
  for (int64_t b = 0; b < nb; ++b, tb += MR * kSbRowBytes) {
    const uint8_t* h0 = g0 + g.group_head + b * blk;
    const uint8_t* h1 = g1 + g.group_head + b * blk;
    const int32_t* rec = reinterpret_cast<const int32_t*>(tb + MR * 256);
    __m512i isum[MR];
    static_for<MR>([&](auto m) TM_INLINE { isum[m] = _mm512_setzero_si512(); });
#pragma GCC unroll 1
    for (int k = 0; k < 8; ++k) {
      ahead.before(b * 8 + k);
      __m512i W[8];
      decode_zmm<kBits<QT>>(h0 + g.block_head + k * g.body, h1 + g.block_head + k * g.body, W);
      __m512i sa, sb;
      if constexpr (QT == Q6_K) {
        sa = ld_bytes16(h0 + 16 + 16 * k, h1 + 16 + 16 * k, true);
        sb = ld_bytes16(h0 + 24 + 16 * k, h1 + 24 + 16 * k, true);
      } else {
        sa = sb = ld_bytes16(h0 + 32 + 8 * k, h1 + 32 + 8 * k, false);
        if constexpr (kTab) {
          static_for<4>([&](auto u) TM_INLINE { _mm512_store_si512(tab + 16 * u, _mm512_slli_epi32(sa, decltype(u)::value)); });
        }
      }
      const uint8_t* tc = tb + k * MR * 32;
      constexpr int R0 = MR < 4 ? MR : 4;  // rows 0..R0-1, then the rest
      rows_sb<QT, R0, kTab>(W, tc, rec, k, sa, sb, tab, isum);
      if constexpr (MR > R0) {
        rows_sb<QT, MR - R0, kTab>(W, tc + R0 * 32, rec + kRecInts * R0, k, sa, sb, tab, isum + R0);
      }
    }
    const __m512 d = ld_ph16(h0, h1);
    if constexpr (QT == Q6_K) {
      static_for<MR>([&](auto m) TM_INLINE {
        float unit;
        std::memcpy(&unit, rec + kRecInts * m, 4);
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[m]), _mm512_mul_ps(d, _mm512_set1_ps(unit)), acc[m]);
      });
    } else {
      const __m512 dmin = ld_ph16(h0 + 16, h1 + 16);
      __m512i mins[4];  // lane: the minimums of chunks 2p and 2p + 1 as two int16
      for (int h = 0; h < 2; ++h) {  // chunks 4h..4h+3 of both groups as words, then two word permutes
        const __m512i a = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h0 + 96 + 32 * h)));
        const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h1 + 96 + 32 * h)));
        mins[2 * h] = _mm512_permutex2var_epi16(a, _mm512_load_si512(kMinPairs.idx[0]), b);
        mins[2 * h + 1] = _mm512_permutex2var_epi16(a, _mm512_load_si512(kMinPairs.idx[1]), b);
      }
      static_for<MR>([&](auto m) TM_INLINE {
        const int32_t* r = rec + kRecInts * m;
        float unit;
        std::memcpy(&unit, r, 4);
        const __m512 vu = _mm512_set1_ps(unit);
        __m512i im = _mm512_setzero_si512();
        for (int p = 0; p < 4; ++p) im = dpwssd(im, mins[p], _mm512_set1_epi32(r[4 + p]));
        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[m]), _mm512_mul_ps(d, vu), acc[m]);
        acc[m] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(im), _mm512_mul_ps(dmin, vu), acc[m]);
      });
    }
  }
  static_for<MR>([&](auto m) TM_INLINE { _mm512_storeu_ps(out[m], acc[m]); });
}

}  // namespace

void pack_tile_sb(const ActRow* a, int mr, int64_t K, uint8_t* dst) {
  for (int64_t b = 0; b < K / 256; ++b) {
    uint8_t* t = dst + b * mr * kSbRowBytes;
    for (int k = 0; k < 8; ++k)
      for (int m = 0; m < mr; ++m) std::memcpy(t + (k * mr + m) * 32, a[m].q + b * 256 + k * 32, 32);
    for (int m = 0; m < mr; ++m) {
      int32_t* r = reinterpret_cast<int32_t*>(t + mr * 256) + kRecInts * m;
      std::memset(r, 0, 4 * kRecInts);
      const int8_t* up = a[m].up + 8 * b;
      const float unit = a[m].dx[8 * b] * (1.f / static_cast<float>(1 << up[0]));  // as ldexp
      std::memcpy(r, &unit, 4);
      const int16_t* bs = a[m].bs + 16 * b;
      for (int p = 0; p < 4; ++p) {
        const auto lo = static_cast<uint16_t>((bs[4 * p] + bs[4 * p + 1]) * (1 << up[2 * p]));
        const auto hi = static_cast<uint16_t>((bs[4 * p + 2] + bs[4 * p + 3]) * (1 << up[2 * p + 1]));
        r[4 + p] = static_cast<int32_t>(lo | static_cast<uint32_t>(hi) << 16);
      }
      for (int k = 0; k < 8; ++k) r[8 + k] = up[k];
      for (int h = 0; h < 16; ++h) r[16 + h] = -32 * bs[h];
    }
  }
}

bool pair_dot_sb(int qtype, const uint8_t* g0, const uint8_t* g1, int64_t K, const uint8_t* tile, int mr,
                 const Ahead& pf, float out[][16]) {
  auto run = [&](auto qt) {
    constexpr int QT = decltype(qt)::value;
    static_assert(kPairRows <= 8, "dispatch_rows covers 1..8 rows");
    dispatch_rows(mr, [&](auto rows) { sb_dot_t<QT, decltype(rows)::value>(g0, g1, K, tile, pf, out); });
  };
  switch (qtype) {
    case Q4_K: run(std::integral_constant<int, Q4_K>{}); return true;
    case Q5_K: run(std::integral_constant<int, Q5_K>{}); return true;
    case Q6_K: run(std::integral_constant<int, Q6_K>{}); return true;
    default: return false;
  }
}

#else

void pack_tile_sb(const ActRow*, int, int64_t, uint8_t*) {}

bool pair_dot_sb(int, const uint8_t*, const uint8_t*, int64_t, const uint8_t*, int, const Ahead&, float[][16]) {
  return false;
}

#endif

}  // namespace TM_QUANT_NS

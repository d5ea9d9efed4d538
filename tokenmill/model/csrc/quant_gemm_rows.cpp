// The few-row packed kernel (decode at concurrency 2-16, speculative verification): x[M, K] . W^T
// for 2 <= M below the dense crossover, with AVX-512.
// The one-row kernel (quant_gemm.cpp) reads pre-broadcast 64-byte activation vectors (lanes 0-7:
// weight group 2k, lanes 8-15: group 2k+1), 256 bytes per 32 activations: a few rows of those no
// longer stay in L1, and each row pays a fold and 8-lane float work per chunk. Here a zmm holds
// the same weight group of 16 output rows (two x8 groups side by side), so each vpdpbusd takes
// its 4 activation bytes as a 32-bit broadcast from the compact int8 row (32 bytes per chunk, L1
// resident), and the float epilogue covers 16 rows at once. Each decoded chunk serves up to
// kPairRows activation rows. Per lane the integer dot products and the float operations are those
// of the one-row kernel, in the same order: a row's result does not depend on the rows beside it.
#include <cstring>

#include "quant_act.h"

namespace TM_QUANT_NS {

#if defined(__AVX512F__) && defined(__AVX512BW__)
namespace {

inline __m512 join(__m256 lo, __m256 hi) {
  return _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(lo)), _mm256_castps_pd(hi), 1));
}

inline __m512i bcast4(const int8_t* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm512_set1_epi32(v);
}

// acc + (4 weights of 16 rows in W) . (the same 4 activations in every lane x)
template <bool kSigned>
inline __m512i dp(__m512i acc, __m512i w, __m512i x) {
  if constexpr (kVNNI) {
    return _mm512_dpbusd_epi32(acc, w, x);
  } else if constexpr (kSigned) {
    const __mmask64 neg = _mm512_movepi8_mask(w);
    const __m512i xs = _mm512_mask_sub_epi8(x, neg, _mm512_setzero_si512(), x);
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_abs_epi8(w), xs), _mm512_set1_epi16(1)));
  } else {
    return _mm512_add_epi32(acc, _mm512_madd_epi16(_mm512_maddubs_epi16(w, x), _mm512_set1_epi16(1)));
  }
}

// (weights 0-15, weights 16-31) . one int8 activation chunk, 16 rows
template <bool kSigned>
inline void dots(const __m512i W[8], const int8_t* xq, __m512i& lo, __m512i& hi) {
  lo = dp<kSigned>(dp<kSigned>(dp<kSigned>(dp<kSigned>(_mm512_setzero_si512(), W[0], bcast4(xq)), W[1], bcast4(xq + 4)),
                                W[2], bcast4(xq + 8)), W[3], bcast4(xq + 12));
  hi = dp<kSigned>(dp<kSigned>(dp<kSigned>(dp<kSigned>(_mm512_setzero_si512(), W[4], bcast4(xq + 16)), W[5],
                                           bcast4(xq + 20)), W[6], bcast4(xq + 24)), W[7], bcast4(xq + 28));
}

template <int QT, int MR, bool RES>
void pair_dot_t(const uint8_t* g0, const uint8_t* g1, const X8Geom& g, int64_t K, const ActRow* a, float out[][16]) {
  constexpr bool kSigned = kSignedQ<QT>;
  constexpr bool kTwo = QT == Q6_K;
  const int64_t C = K / 32;
  const int cpb = g.qk / 32;
  __m512 acc[MR], aco[MR];
  for (int m = 0; m < MR; ++m) acc[m] = aco[m] = _mm512_setzero_ps();
  for (int64_t c = 0; c < C; ++c) {
    const int k = static_cast<int>(c % cpb);
    const uint8_t* h0 = x8_block(g0, g, c / cpb);
    const uint8_t* h1 = x8_block(g1, g, c / cpb);
    ChunkVec v0, v1;
    chunk_vec<QT>(g0, h0, k, v0);
    chunk_vec<QT>(g1, h1, k, v1);
    const __m512 da = join(v0.da, v1.da), db = join(v0.db, v1.db);
    __m512 oa = join(v0.oa, v1.oa), ob = join(v0.ob, v1.ob);
    if constexpr (kSigned && kVNNI) {  // dot products run on q + 128
      oa = ob = _mm512_mul_ps(da, _mm512_set1_ps(-128.f));
    }
    __m512i W[8];
    {
      __m256i u0[8], u1[8];
      decode_ymm<kBits<QT>>(h0 + g.block_head + k * g.body, u0);
      decode_ymm<kBits<QT>>(h1 + g.block_head + k * g.body, u1);
      for (int j = 0; j < 8; ++j) {
        W[j] = _mm512_inserti64x4(_mm512_castsi256_si512(u0[j]), u1[j], 1);
        if constexpr (kSigned && kVNNI) W[j] = _mm512_xor_si512(W[j], _mm512_set1_epi8(-128));
      }
    }
    for (int m = 0; m < MR; ++m) {
      __m512i lo, hi;
      dots<kSigned>(W, a[m].q + c * 32, lo, hi);
      if constexpr (RES) {  // x = dx (xq + xr / 256): 256 xq.u + xr.u (fits int32)
        __m512i flo, fhi;
        dots<kSigned>(W, a[m].qr + c * 32, flo, fhi);
        lo = _mm512_add_epi32(_mm512_slli_epi32(lo, 8), flo);
        hi = _mm512_add_epi32(_mm512_slli_epi32(hi, 8), fhi);
      }
      const __m512 dx = _mm512_set1_ps(RES ? a[m].dx[c] / 256.f : a[m].dx[c]);
      if constexpr (kTwo) {
        acc[m] = _mm512_fmadd_ps(da, _mm512_mul_ps(_mm512_cvtepi32_ps(lo), dx), acc[m]);
        acc[m] = _mm512_fmadd_ps(db, _mm512_mul_ps(_mm512_cvtepi32_ps(hi), dx), acc[m]);
        aco[m] = _mm512_fmadd_ps(oa, _mm512_set1_ps(a[m].sa[c]), aco[m]);
        aco[m] = _mm512_fmadd_ps(ob, _mm512_set1_ps(a[m].sb[c]), aco[m]);
      } else {
        acc[m] = _mm512_fmadd_ps(da, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(lo, hi)), dx), acc[m]);
        aco[m] = _mm512_fmadd_ps(oa, _mm512_set1_ps(a[m].s[c]), aco[m]);
      }
    }
  }
  for (int m = 0; m < MR; ++m) _mm512_storeu_ps(out[m], _mm512_add_ps(acc[m], aco[m]));
}

}  // namespace

bool pair_dot(int qtype, const uint8_t* g0, const uint8_t* g1, int64_t K, const ActRow* a, int mr, bool fine,
              float out[][16]) {
  const X8Geom g = x8_geom(qtype);
  return dispatch_qtype(qtype, [&](auto qt) {
    constexpr int QT = decltype(qt)::value;
    auto run = [&](auto res_tag) {
      constexpr bool R = decltype(res_tag)::value;
      static_assert(kPairRows <= 8, "the switch below covers 1..8 rows");
      switch (mr) {
        case 8: pair_dot_t<QT, 8, R>(g0, g1, g, K, a, out); break;
        case 7: pair_dot_t<QT, 7, R>(g0, g1, g, K, a, out); break;
        case 6: pair_dot_t<QT, 6, R>(g0, g1, g, K, a, out); break;
        case 5: pair_dot_t<QT, 5, R>(g0, g1, g, K, a, out); break;
        case 4: pair_dot_t<QT, 4, R>(g0, g1, g, K, a, out); break;
        case 3: pair_dot_t<QT, 3, R>(g0, g1, g, K, a, out); break;
        case 2: pair_dot_t<QT, 2, R>(g0, g1, g, K, a, out); break;
        default: pair_dot_t<QT, 1, R>(g0, g1, g, K, a, out); break;
      }
    };
    if (fine) run(std::true_type{});
    else run(std::false_type{});
  });
}

#else

bool pair_dot(int, const uint8_t*, const uint8_t*, int64_t, const ActRow*, int, bool, float[][16]) { return false; }

#endif

}  // namespace TM_QUANT_NS

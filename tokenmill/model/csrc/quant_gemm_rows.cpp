// The many-row packed kernel (decode at concurrency 2+, speculative verification, prefill):
// x[M, K] . W^T with AVX-512.
// A zmm holds the same weight group of 16 output rows (two x8 groups side by side), so each
// vpdpbusd takes its 4 activation bytes as a 32-bit broadcast, and the float epilogue covers 16
// rows at once. Each decoded chunk serves up to kPairRows activation rows, read from a tile
// (pack_tile) that interleaves those rows chunk by chunk: one pointer walks the tile, every row's
// codes and scales sit at a constant offset from it (embedded broadcasts, no per-row pointers to
// reload). Per lane the integer dot products and the float operations are those of the one-row
// kernel, in the same order: a row's result does not depend on the rows beside it.
#include <cstring>

#include "quant_zmm.h"

namespace TM_QUANT_NS {

#if defined(__AVX512F__) && defined(__AVX512BW__)
namespace {

using namespace zmm;

// Rows m0..m0+R-1 of a tile chunk (codes at tc, CB bytes per row; scales at sc) against the decoded
// weights W: the integer dot products of weights 0-15 (lo) and 16-31 (hi) of each row, then the float
// epilogue. The rows' chains are interleaved so that independent vpdpbusd are in flight (one row's
// chains alone leave the unit waiting on their latency). kOne (a format with one scale per 32, at 4+
// rows): one chain a row, lo summing all 32 (the same int32 as lo + hi); two a row left the 8-row
// kernel short of registers, 6-15% slower at 16-512 rows (BENCHMARKS.md). With residual codes the xr
// products accumulate onto the xq ones shifted by 8: 256 xq.u + xr.u, exact in int32.
template <bool kSigned, bool RES, bool kTwo, bool kOne, int R, int CB>
__attribute__((always_inline)) inline void rows_chunk(const __m512i W[8], const uint8_t* tc, const float* sc, __m512 da, __m512 db, __m512 oa,
                                                      __m512 ob, __m512* acc, __m512* aco) {
  __m512i lo[R], hi[R];
  static_for<R>([&](auto r) TM_INLINE { lo[r] = hi[r] = _mm512_setzero_si512(); });
  auto pass = [&](auto at) TM_INLINE {
    static_for<4>([&](auto j) TM_INLINE {
      static_for<R>([&](auto r) TM_INLINE {
        const int8_t* x = reinterpret_cast<const int8_t*>(tc + r * CB + at);
        lo[r] = dp<kSigned>(lo[r], W[j], x + 4 * j);
        if constexpr (kOne) lo[r] = dp<kSigned>(lo[r], W[j + 4], x + 16 + 4 * j);
        else hi[r] = dp<kSigned>(hi[r], W[j + 4], x + 16 + 4 * j);
      });
    });
  };
  pass(std::integral_constant<int, 0>{});
  if constexpr (RES) {
    static_for<R>([&](auto r) TM_INLINE {
      lo[r] = _mm512_slli_epi32(lo[r], 8);
      if constexpr (!kOne) hi[r] = _mm512_slli_epi32(hi[r], 8);
    });
    pass(std::integral_constant<int, 32>{});
  }
  static_for<R>([&](auto r) TM_INLINE {
    const __m512 dx = _mm512_set1_ps(sc[4 * r]);
    if constexpr (kTwo) {
      acc[r] = _mm512_fmadd_ps(da, _mm512_mul_ps(_mm512_cvtepi32_ps(lo[r]), dx), acc[r]);
      acc[r] = _mm512_fmadd_ps(db, _mm512_mul_ps(_mm512_cvtepi32_ps(hi[r]), dx), acc[r]);
      aco[r] = _mm512_fmadd_ps(oa, _mm512_set1_ps(sc[4 * r + 2]), aco[r]);
      aco[r] = _mm512_fmadd_ps(ob, _mm512_set1_ps(sc[4 * r + 3]), aco[r]);
    } else {
      const __m512i sum = kOne ? lo[r] : _mm512_add_epi32(lo[r], hi[r]);
      acc[r] = _mm512_fmadd_ps(da, _mm512_mul_ps(_mm512_cvtepi32_ps(sum), dx), acc[r]);
      aco[r] = _mm512_fmadd_ps(oa, _mm512_set1_ps(sc[4 * r + 1]), aco[r]);
    }
  });
}

// Never inlined: GCC inlined some instances (Q4_1, Q5_0, Q8_0) into pair_dot's dispatch and compiled
// them 3-4x slower than the rest (BENCHMARKS.md, "On an AMD EPYC").
template <int QT, int MR, bool RES>
__attribute__((noinline)) void pair_dot_t(const uint8_t* g0, const uint8_t* g1, int64_t K, const uint8_t* tile,
                                          const Ahead& pf, float out[][16]) {
  constexpr bool kSigned = kSignedQ<QT>;
  constexpr bool kTwo = QT == Q6_K;
  constexpr bool kOne = !kTwo && MR >= 4;  // one chain a row where 4+ rows keep the unit busy
  constexpr X8Geom g = x8_geom(QT);
  constexpr int cpb = g.qk / 32;
  constexpr int CB = tile_code_bytes(RES);
  constexpr int64_t CS = MR * (CB + 16);  // tile bytes per chunk
  const int64_t C = K / 32, nb = K / g.qk, blk = g.block_head + cpb * g.body;
  Prefetcher ahead(g0, g1, pf, C);
  // Every index into acc and aco a compile-time one (static_for, not loops): with a runtime loop GCC
  // kept both arrays in memory around the chunk loop, zeroed by `rep stos` and stored back at the end,
  // ~8% of a call at SmolLM2's K = 576 (BENCHMARKS.md, twenty-fourth session).
  __m512 acc[MR], aco[MR];
  static_for<MR>([&](auto m) TM_INLINE { acc[m] = aco[m] = _mm512_setzero_ps(); });
  const uint8_t* tc = tile;
  int64_t c = 0;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* h0 = g0 + g.group_head + b * blk;
    const uint8_t* h1 = g1 + g.group_head + b * blk;
#pragma GCC unroll 1
    for (int k = 0; k < cpb; ++k, ++c, tc += CS) {
      ahead.before(c);
      __m512 da, db, oa, ob;
      chunk_vec16<QT>(g0, h0, g1, h1, k, da, db, oa, ob);
      if constexpr (kSigned && kVNNI) {  // dot products run on q + 128
        oa = ob = _mm512_mul_ps(da, _mm512_set1_ps(-128.f));
      }
      __m512i W[8];
      decode_zmm<kBits<QT>>(h0 + g.block_head + k * g.body, h1 + g.block_head + k * g.body, W);
      if constexpr (kSigned && kVNNI) {
        for (int j = 0; j < 8; ++j) W[j] = _mm512_xor_si512(W[j], _mm512_set1_epi8(-128));
      }
      const float* sc = reinterpret_cast<const float*>(tc + MR * CB);  // per row: dx (/ 256), s, sa, sb
      constexpr int R0 = MR < 4 ? MR : 4;  // rows 0..R0-1, then the rest
      rows_chunk<kSigned, RES, kTwo, kOne, R0, CB>(W, tc, sc, da, db, oa, ob, acc, aco);
      if constexpr (MR > R0) {
        rows_chunk<kSigned, RES, kTwo, kOne, MR - R0, CB>(W, tc + R0 * CB, sc + 4 * R0, da, db, oa, ob, acc + R0, aco + R0);
      }
    }
  }
  static_for<MR>([&](auto m) TM_INLINE { _mm512_storeu_ps(out[m], _mm512_add_ps(acc[m], aco[m])); });
}

}  // namespace

void pack_tile(const ActRow* a, int mr, int64_t K, bool fine, uint8_t* dst) {
  const int CB = tile_code_bytes(fine);
  for (int64_t c = 0; c < K / 32; ++c) {
    uint8_t* t = dst + c * mr * (CB + 16);
    float* sc = reinterpret_cast<float*>(t + mr * CB);
    for (int m = 0; m < mr; ++m) {
      std::memcpy(t + m * CB, a[m].q + c * 32, 32);
      if (fine) std::memcpy(t + m * CB + 32, a[m].qr + c * 32, 32);
      sc[4 * m] = fine ? a[m].dx[c] / 256.f : a[m].dx[c];
      sc[4 * m + 1] = a[m].s[c];
      sc[4 * m + 2] = a[m].sa[c];
      sc[4 * m + 3] = a[m].sb[c];
    }
  }
}

bool pair_dot(int qtype, const uint8_t* g0, const uint8_t* g1, int64_t K, const uint8_t* tile, int mr, bool fine,
              const Ahead& pf, float out[][16]) {
  return dispatch_qtype(qtype, [&](auto qt) {
    constexpr int QT = decltype(qt)::value;
    auto run = [&](auto res_tag) {
      constexpr bool R = decltype(res_tag)::value;
      static_assert(kPairRows <= 8, "dispatch_rows covers 1..8 rows");
      dispatch_rows(mr, [&](auto rows) { pair_dot_t<QT, decltype(rows)::value, R>(g0, g1, K, tile, pf, out); });
    };
    if (fine) run(std::true_type{});
    else run(std::false_type{});
  });
}

#else

void pack_tile(const ActRow*, int, int64_t, bool, uint8_t*) {}

bool pair_dot(int, const uint8_t*, const uint8_t*, int64_t, const uint8_t*, int, bool, const Ahead&, float[][16]) {
  return false;
}

#endif

void set_prefetch_ahead(int64_t bytes, int64_t level) {
  g_prefetch_ahead = std::max<int64_t>(bytes, 0) / 64 * 64;
  g_prefetch_level = level == 2 ? 2 : 1;
}

}  // namespace TM_QUANT_NS

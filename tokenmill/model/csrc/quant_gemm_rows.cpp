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

// decode_ymm of two chunk bodies at once: zmm j = ymm j of b0 (rows 0-7), then of b1 (rows 8-15);
// the 5th and 6th bits go in as byte masks (one masked add each) rather than expanded bit by bit.
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
    auto add_bits = [&](int at, char value) {
      for (int j = 0; j < 8; ++j) {
        uint32_t lo, hi;
        std::memcpy(&lo, b0 + at + 4 * j, 4);
        std::memcpy(&hi, b1 + at + 4 * j, 4);
        const __mmask64 k = _cvtu64_mask64(static_cast<uint64_t>(hi) << 32 | lo);
        W[j] = _mm512_mask_add_epi8(W[j], k, W[j], _mm512_set1_epi8(value));
      }
    };
    if constexpr (BITS >= 5) add_bits(128, 0x10);
    if constexpr (BITS == 6) add_bits(160, 0x20);
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

// Rows m0..m0+R-1 of a tile chunk (codes at tc, CB bytes per row; scales at sc) against the decoded
// weights W: the integer dot products of weights 0-15 (lo) and 16-31 (hi) of each row, then the float
// epilogue. The R rows' chains are interleaved so that 2R independent vpdpbusd are in flight (one
// row's chains alone leave the unit waiting on their latency). With residual codes the xr products
// accumulate onto the xq ones shifted by 8: 256 xq.u + xr.u, exact in int32.
template <bool kSigned, bool RES, bool kTwo, int R, int CB>
__attribute__((always_inline)) inline void rows_chunk(const __m512i W[8], const uint8_t* tc, const float* sc, __m512 da, __m512 db, __m512 oa,
                                                      __m512 ob, __m512* acc, __m512* aco) {
  __m512i lo[R], hi[R];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) lo[r] = hi[r] = _mm512_setzero_si512();
  auto pass = [&](int at) {
#pragma GCC unroll 8
    for (int j = 0; j < 4; ++j) {
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const int8_t* x = reinterpret_cast<const int8_t*>(tc + r * CB + at);
        lo[r] = dp<kSigned>(lo[r], W[j], bcast4(x + 4 * j));
        hi[r] = dp<kSigned>(hi[r], W[j + 4], bcast4(x + 16 + 4 * j));
      }
    }
  };
  pass(0);
  if constexpr (RES) {
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      lo[r] = _mm512_slli_epi32(lo[r], 8);
      hi[r] = _mm512_slli_epi32(hi[r], 8);
    }
    pass(32);
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const __m512 dx = _mm512_set1_ps(sc[4 * r]);
    if constexpr (kTwo) {
      acc[r] = _mm512_fmadd_ps(da, _mm512_mul_ps(_mm512_cvtepi32_ps(lo[r]), dx), acc[r]);
      acc[r] = _mm512_fmadd_ps(db, _mm512_mul_ps(_mm512_cvtepi32_ps(hi[r]), dx), acc[r]);
      aco[r] = _mm512_fmadd_ps(oa, _mm512_set1_ps(sc[4 * r + 2]), aco[r]);
      aco[r] = _mm512_fmadd_ps(ob, _mm512_set1_ps(sc[4 * r + 3]), aco[r]);
    } else {
      acc[r] = _mm512_fmadd_ps(da, _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(lo[r], hi[r])), dx), acc[r]);
      aco[r] = _mm512_fmadd_ps(oa, _mm512_set1_ps(sc[4 * r + 1]), aco[r]);
    }
  }
}

// Bytes each weight stream is prefetched ahead of the chunk being read. Without it the kernel is
// latency-bound on DRAM (the hardware prefetcher alone streamed ~9-10 GB/s where a plain read runs
// ~17 GB/s). The best distance depends on the CPU kind (quant_kernels.py sets it at load: 1 KiB on
// a Xeon, 16 KiB on an AMD EPYC; BENCHMARKS.md, issue 8).
int64_t g_prefetch_ahead = 1024;

// Never inlined: GCC inlined some instances (Q4_1, Q5_0, Q8_0) into pair_dot's dispatch and compiled
// them 3-4x slower than the rest (BENCHMARKS.md, "On an AMD EPYC").
template <int QT, int MR, bool RES>
__attribute__((noinline)) void pair_dot_t(const uint8_t* g0, const uint8_t* g1, int64_t K, const uint8_t* tile,
                                          const Ahead& pf, float out[][16]) {
  constexpr bool kSigned = kSignedQ<QT>;
  constexpr bool kTwo = QT == Q6_K;
  constexpr X8Geom g = x8_geom(QT);
  constexpr int cpb = g.qk / 32;
  constexpr int CB = tile_code_bytes(RES);
  constexpr int64_t CS = MR * (CB + 16);  // tile bytes per chunk
  const int64_t C = K / 32, nb = K / g.qk, blk = g.block_head + cpb * g.body;
  const int64_t dist = pf.gb ? std::min(g_prefetch_ahead, pf.gb) : 0, step = pf.gb / C;
  int64_t pos = dist;  // next byte offset (in each group) to prefetch
  __m512 acc[MR], aco[MR];
  for (int m = 0; m < MR; ++m) acc[m] = aco[m] = _mm512_setzero_ps();
  const uint8_t* tc = tile;
  int64_t c = 0;
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* h0 = g0 + g.group_head + b * blk;
    const uint8_t* h1 = g1 + g.group_head + b * blk;
#pragma GCC unroll 1
    for (int k = 0; k < cpb; ++k, ++c, tc += CS) {
      if (dist) {  // keep both streams `dist` bytes ahead of the chunk being read, into the next item
        for (const int64_t upto = c + 1 == C ? pf.gb + dist : (c + 1) * step + dist; pos < upto; pos += 64) {
          if (pos < pf.gb) {
            _mm_prefetch(reinterpret_cast<const char*>(g0 + pos), _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(g1 + pos), _MM_HINT_T0);
          } else if (pf.n0) {
            _mm_prefetch(reinterpret_cast<const char*>(pf.n0 + pos - pf.gb), _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(pf.n1 + pos - pf.gb), _MM_HINT_T0);
          }
        }
      }
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
      rows_chunk<kSigned, RES, kTwo, R0, CB>(W, tc, sc, da, db, oa, ob, acc, aco);
      if constexpr (MR > R0) {
        rows_chunk<kSigned, RES, kTwo, MR - R0, CB>(W, tc + R0 * CB, sc + 4 * R0, da, db, oa, ob, acc + R0, aco + R0);
      }
    }
  }
  for (int m = 0; m < MR; ++m) _mm512_storeu_ps(out[m], _mm512_add_ps(acc[m], aco[m]));
}

}  // namespace

void set_prefetch_ahead(int64_t bytes) { g_prefetch_ahead = std::max<int64_t>(bytes, 0) / 64 * 64; }

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
      static_assert(kPairRows <= 8, "the switch below covers 1..8 rows");
      switch (mr) {
        case 8: pair_dot_t<QT, 8, R>(g0, g1, K, tile, pf, out); break;
        case 7: pair_dot_t<QT, 7, R>(g0, g1, K, tile, pf, out); break;
        case 6: pair_dot_t<QT, 6, R>(g0, g1, K, tile, pf, out); break;
        case 5: pair_dot_t<QT, 5, R>(g0, g1, K, tile, pf, out); break;
        case 4: pair_dot_t<QT, 4, R>(g0, g1, K, tile, pf, out); break;
        case 3: pair_dot_t<QT, 3, R>(g0, g1, K, tile, pf, out); break;
        case 2: pair_dot_t<QT, 2, R>(g0, g1, K, tile, pf, out); break;
        default: pair_dot_t<QT, 1, R>(g0, g1, K, tile, pf, out); break;
      }
    };
    if (fine) run(std::true_type{});
    else run(std::false_type{});
  });
}

#else

void set_prefetch_ahead(int64_t) {}

void pack_tile(const ActRow*, int, int64_t, bool, uint8_t*) {}

bool pair_dot(int, const uint8_t*, const uint8_t*, int64_t, const uint8_t*, int, bool, const Ahead&, float[][16]) {
  return false;
}

#endif

}  // namespace TM_QUANT_NS

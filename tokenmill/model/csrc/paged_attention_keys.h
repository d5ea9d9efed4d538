// Scores q.k of the AVX-512 paged attention kernels (paged_attention_avx512.h), shared by the
// one-row and the many-row kernel so that a score's arithmetic never depends on which ran it.
// A chunk's keys are staged once, transposed: pair p (dims 2p, 2p + 1, as bf16) of 16 tokens in
// one vector, a token per lane. A score is then a lane of a chain of bf16 pair dot products
// (vdpbf16ps) over p = 0, 1, ... from zero, times the token's factor: no horizontal sums, the
// keys converted once per chunk rather than once per query, and every query of a run (rows x
// heads of a kv head) reusing each staged vector from registers.
#pragma once

#include <immintrin.h>

#include <cstring>

namespace tm_paged {

// acc + a.b per lane over one bf16 pair; without AVX512-BF16, the same two products in the order
// of Intel's definition of vdpbf16ps (odd element first), each fused.
inline __m512 dot_pairs(__m512 acc, __m512i a, __m512i b) {
#ifdef __AVX512BF16__
  return _mm512_dpbf16_ps(acc, (__m512bh)a, (__m512bh)b);
#else
  const __m512i hi = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  acc = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(a, hi)), _mm512_castsi512_ps(_mm512_and_si512(b, hi)), acc);
  return _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(a, 16)), _mm512_castsi512_ps(_mm512_slli_epi32(b, 16)),
                         acc);
#endif
}

// r[j] lane i <- r[i] lane j, for 16 vectors of 16 dwords
inline void transpose16(__m512i r[16]) {
  __m512i t[16];
  for (int k = 0; k < 8; ++k) {
    t[2 * k] = _mm512_unpacklo_epi32(r[2 * k], r[2 * k + 1]);
    t[2 * k + 1] = _mm512_unpackhi_epi32(r[2 * k], r[2 * k + 1]);
  }
  __m512i u[16];  // u[4m + c]: in 128-bit lane l, column 4l + c of rows 4m .. 4m + 3
  for (int m = 0; m < 4; ++m) {
    u[4 * m] = _mm512_unpacklo_epi64(t[4 * m], t[4 * m + 2]);
    u[4 * m + 1] = _mm512_unpackhi_epi64(t[4 * m], t[4 * m + 2]);
    u[4 * m + 2] = _mm512_unpacklo_epi64(t[4 * m + 1], t[4 * m + 3]);
    u[4 * m + 3] = _mm512_unpackhi_epi64(t[4 * m + 1], t[4 * m + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // the 4 x 4 transpose of 128-bit lanes of u[c], u[4 + c], u[8 + c], u[12 + c]
    const __m512i v0 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x44), v1 = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xEE);
    const __m512i v2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x44),
                  v3 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xEE);
    r[c] = _mm512_shuffle_i32x4(v0, v2, 0x88);
    r[4 + c] = _mm512_shuffle_i32x4(v0, v2, 0xDD);
    r[8 + c] = _mm512_shuffle_i32x4(v1, v3, 0x88);
    r[12 + c] = _mm512_shuffle_i32x4(v1, v3, 0xDD);
  }
}

// 32 values of a cache row as bf16, in order: bf16 as stored; int8, e4m3 and e5m2 codes exactly (as
// floats they have at most 8 significant bits, so the top half of the float is the value).
template <typename C>
inline __m512i bf16x32(const C* p) {
  if constexpr (std::is_same_v<C, at::BFloat16>) {
    return _mm512_loadu_si512(p);
  } else {
    const __m256i lo = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(f32x16(p)), 16));
    const __m256i hi = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(f32x16(p + 16)), 16));
    return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1);
  }
}

// Keys [t0, t0 + n) of kv head h (n <= kKeyChunk) staged: kt[g * P + p] is pair p of the 16 tokens
// of group g (zero past n), P = D / 2; sv[t - t0] the factor of token t's dot products (the
// softmax scale, times the token's scale in a quantized cache). L: the row's (or run's) length.
template <int NV, typename C>
void stage_keys(const PagedKV<C>& kv, const int64_t* table, int64_t L, int64_t t0, int64_t n, int64_t BS,
                int64_t row, int64_t h, float scale, __m512i* kt, float* sv) {
  constexpr int64_t D = 16 * NV, P = 8 * NV;
  const int64_t Hkv = row / D;
  int64_t slots[kKeyChunk];
  chunk_slots(kv.k, table, t0, n, BS, row, h, D, (L + BS - 1) / BS, slots);
  for (int64_t i = 0; i < n; ++i) sv[i] = slot_scale<C>(kv.ks, slots[i], Hkv, h) * scale;
  for (int64_t i = n; i % 16; ++i) sv[i] = 0.f;
  for (int64_t g = 0; g * 16 < n; ++g)
    for (int64_t half = 0; half < P / 16; ++half) {
      __m512i r[16];
      for (int64_t i = 0; i < 16; ++i) {
        const int64_t j = g * 16 + i;
        r[i] = j < n ? bf16x32(kv.k + slots[j] * row + h * D + 32 * half) : _mm512_setzero_si512();
      }
      transpose16(r);
      for (int64_t j = 0; j < 16; ++j) kt[g * P + half * 16 + j] = r[j];
    }
}

// A query's pairs as dwords (read once per chunk; broadcast from memory in the score chain)
template <int NV>
inline void query_pairs(const at::BFloat16* q, int32_t* out) {
  std::memcpy(out, q, 32 * NV);
}

template <int P, int NQ, int NG>
inline void group_scores(const int32_t* const* q, const __m512i* kt, const float* sv, float* const* out) {
  __m512 acc[NQ][NG];
  for (int i = 0; i < NQ; ++i)
    for (int g = 0; g < NG; ++g) acc[i][g] = _mm512_setzero_ps();
  for (int p = 0; p < P; ++p)
    for (int g = 0; g < NG; ++g) {
      const __m512i k = _mm512_load_si512(kt + g * P + p);
      for (int i = 0; i < NQ; ++i) acc[i][g] = dot_pairs(acc[i][g], _mm512_set1_epi32(q[i][p]), k);
    }
  for (int i = 0; i < NQ; ++i)
    for (int g = 0; g < NG; ++g) _mm512_storeu_ps(out[i] + 16 * g, _mm512_mul_ps(acc[i][g], _mm512_loadu_ps(sv + 16 * g)));
}

template <int P, int NQ>
inline void scores_of(const int32_t* const* q, const __m512i* kt, int64_t groups, const float* sv, float* const* out) {
  switch (groups) {
    case 1: group_scores<P, NQ, 1>(q, kt, sv, out); break;
    case 2: group_scores<P, NQ, 2>(q, kt, sv, out); break;
    case 3: group_scores<P, NQ, 3>(q, kt, sv, out); break;
    default: group_scores<P, NQ, 4>(q, kt, sv, out); break;
  }
}

// out[i][0 .. 16 * ceil(n / 16)) = the scores of query i (q[i]: its pairs) against staged keys of n
// tokens, for nq queries, four at a time. sv must hold 16 * ceil(n / 16) floats.
template <int NV>
void chunk_scores(const int32_t* const* q, int64_t nq, const __m512i* kt, int64_t n, const float* sv,
                  float* const* out) {
  static_assert(kKeyChunk == 64, "four groups of 16 keys per chunk");
  constexpr int P = 8 * NV;
  const int64_t groups = (n + 15) / 16;
  int64_t i = 0;
  for (; i + 4 <= nq; i += 4) scores_of<P, 4>(q + i, kt, groups, sv, out + i);
  switch (nq - i) {
    case 1: scores_of<P, 1>(q + i, kt, groups, sv, out + i); break;
    case 2: scores_of<P, 2>(q + i, kt, groups, sv, out + i); break;
    case 3: scores_of<P, 3>(q + i, kt, groups, sv, out + i); break;
    default: break;
  }
}

}  // namespace tm_paged

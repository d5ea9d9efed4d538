// Weighted sums of values of the AVX-512 paged attention kernels (paged_attention_avx512.h),
// shared by the one-row and the many-row kernel as the scores are (paged_attention_keys.h), so that
// a row's sum never depends on which kernel ran it.
// A chunk's values are staged once as bf16 pairs of consecutive tokens: lane i of vector j of
// pair u holds one dim of tokens 2u and 2u + 1 side by side. sum_t p[t] v[t] is then a chain of
// bf16 pair dot products (vdpbf16ps) over u from zero: two tokens per instruction, where float
// FMAs took one and left a GQA model's attention (Qwen2: 6 query heads per kv head, 128 dims)
// bound by them. The weights p (e^(s - max), times the token's scale in a quantized cache) are
// rounded to bf16 for it; the cache itself holds bf16 or 8-bit values.
// The pairs come from unpacklo/unpackhi within 128-bit lanes, so an accumulator's lanes hold dims
// out of order; the store puts them back.
#pragma once

#include <immintrin.h>

#include "bf16_zmm.h"

namespace tm_paged {

// Values [t0, t0 + n) of kv head h (n <= kKeyChunk) staged: vt[u * NV + j], zero past n; vs[t - t0]
// the token's scale (1 for a bf16 cache). L: the row's (or run's) length.
template <int NV, typename C>
void stage_values(const PagedKV<C>& kv, const int64_t* table, int64_t L, int64_t t0, int64_t n, int64_t BS,
                  int64_t row, int64_t h, __m512i* vt, float* vs) {
  constexpr int64_t D = 16 * NV;
  const int64_t Hkv = row / D;
  int64_t slots[kKeyChunk];
  chunk_slots(kv.v, table, t0, n, BS, row, h, D, (L + BS - 1) / BS, slots);
  for (int64_t i = 0; i < n; ++i) vs[i] = slot_scale<C>(kv.vs, slots[i], Hkv, h);
  for (int64_t u = 0; 2 * u < n; ++u) {
    const C* a = kv.v + slots[2 * u] * row + h * D;
    const C* b = 2 * u + 1 < n ? kv.v + slots[2 * u + 1] * row + h * D : nullptr;
    for (int k = 0; k < NV / 2; ++k) {
      const __m512i x = bf16x32(a + 32 * k), y = b ? bf16x32(b + 32 * k) : _mm512_setzero_si512();
      vt[u * NV + 2 * k] = _mm512_unpacklo_epi16(x, y);
      vt[u * NV + 2 * k + 1] = _mm512_unpackhi_epi16(x, y);
    }
  }
}

// 16 floats to bf16, rounded to nearest even (the weights fed to vdpbf16ps)
inline __m256i bf16x16_rne(__m512 x) {
#ifdef __AVX512BF16__
  return (__m256i)_mm512_cvtneps_pbh(x);
#else
  return _mm512_cvtepi32_epi16(bf16_rne_lanes(x));
#endif
}

// softmax_partial for one chunk's scores of N queries (s[j], n <= kKeyChunk keys each; s[j] holds
// 16 * ceil(n / 16) floats), in registers, the tail masked rather than a scalar exp per key: p[j][0]
// <- the max, p[j][1] <- sum_t e^(s[j][t] - max), and the weights as bf16 pairs w[j][u] (tokens 2u,
// 2u + 1; zero past n): e^(s[j][t] - max) times the token's scale in a quantized cache (vs), rounded
// from the same registers (stored as floats and read back, the scores waited on their stores).
// The N queries' operations interleave (one query's reductions and exps alone left the core waiting
// on their latency) but each query's are those of N = 1, in the same order: its result does not
// depend on N.
template <typename C, int N>
inline void softmax_weights(float* const* s, int64_t n, const float* vs, float* const* p, int32_t* const* w) {
  const int64_t nv = (n + 15) / 16;
  __m512 v[N][kKeyChunk / 16];
  __mmask16 k[kKeyChunk / 16];
  __m512 mx[N];
  for (int j = 0; j < N; ++j) mx[j] = _mm512_set1_ps(-INFINITY);
  for (int64_t i = 0; i < nv; ++i) {
    k[i] = n - 16 * i >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (n - 16 * i)) - 1);
    for (int j = 0; j < N; ++j) {
      // a plain load where the vector is whole: the scores were just stored, and on an AMD Zen 4 a
      // masked load waited on those stores (perf's samples piled up behind it)
      v[j][i] = k[i] == 0xFFFF ? _mm512_loadu_ps(s[j] + 16 * i)
                               : _mm512_mask_loadu_ps(_mm512_set1_ps(-INFINITY), k[i], s[j] + 16 * i);
      mx[j] = _mm512_max_ps(mx[j], v[j][i]);
    }
  }
  __m512 m[N], sum[N];
  for (int j = 0; j < N; ++j) {
    const float mj = _mm512_reduce_max_ps(mx[j]);
    p[j][0] = mj;
    m[j] = _mm512_set1_ps(mj);
    sum[j] = _mm512_setzero_ps();
  }
  for (int64_t i = 0; i < nv; ++i)
    for (int j = 0; j < N; ++j) {
      const __m512 e = _mm512_maskz_mov_ps(k[i], at::vec::Vectorized<float>(_mm512_sub_ps(v[j][i], m[j])).exp_u20());
      sum[j] = _mm512_add_ps(sum[j], e);
      __m512 x = e;
      if constexpr (!std::is_same_v<C, at::BFloat16>) x = _mm512_mul_ps(x, _mm512_maskz_loadu_ps(k[i], vs + 16 * i));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(w[j] + 8 * i), bf16x16_rne(x));
    }
  for (int j = 0; j < N; ++j) p[j][1] = _mm512_reduce_add_ps(sum[j]);
}

// softmax_weights for nq queries over the same n keys, up to 4 interleaved
template <typename C>
inline void softmax_weights_of(float* const* s, int64_t nq, int64_t n, const float* vs, float* const* p,
                               int32_t* const* w) {
  for (int64_t i = 0; i < nq; i += 4) {
    switch (std::min<int64_t>(4, nq - i)) {
      case 1: softmax_weights<C, 1>(s + i, n, vs, p + i, w + i); break;
      case 2: softmax_weights<C, 2>(s + i, n, vs, p + i, w + i); break;
      case 3: softmax_weights<C, 3>(s + i, n, vs, p + i, w + i); break;
      default: softmax_weights<C, 4>(s + i, n, vs, p + i, w + i); break;
    }
  }
}

// sum over pairs u < npairs of w_i[u] . vt[u] for NH weight rows (out_i, D floats in dim order),
// each lane's sum in u order from zero; each value vector is loaded once into a register for all NH.
template <int NV, int NH>
inline void pair_sums(const __m512i* vt, const int32_t* const* w, int64_t npairs, float* const* out) {
  // acc stays in registers only if every loop over it is unrolled early: otherwise GCC zeroed it in
  // memory and went through memory around the sums (a verification's attention 8% slower)
  __m512 acc[NH][NV];
#pragma GCC unroll 8
  for (int i = 0; i < NH; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t u = 0; u < npairs; ++u) {
    __m512i v[NV];
    for (int j = 0; j < NV; ++j) {
      v[j] = _mm512_load_si512(vt + u * NV + j);
      asm("" : "+v"(v[j]));  // kept in a register, not reloaded by each product
    }
    for (int i = 0; i < NH; ++i) {
      const __m512i wi = _mm512_set1_epi32(w[i][u]);
      for (int j = 0; j < NV; ++j) acc[i][j] = dot_pairs(acc[i][j], v[j], wi);
    }
  }
  // lane 4l + c of the unpacklo sum is dim 8l + c of its 32, of the unpackhi sum dim 8l + 4 + c
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
#pragma GCC unroll 8
  for (int i = 0; i < NH; ++i)
#pragma GCC unroll 8
    for (int k = 0; k < NV / 2; ++k) {
      _mm512_storeu_ps(out[i] + 32 * k, _mm512_permutex2var_ps(acc[i][2 * k], first, acc[i][2 * k + 1]));
      _mm512_storeu_ps(out[i] + 32 * k + 16, _mm512_permutex2var_ps(acc[i][2 * k], second, acc[i][2 * k + 1]));
    }
}

// pair_sums for nq weight rows, as many at once as registers hold
template <int NV>
void pair_sums_of(const __m512i* vt, const int32_t* const* w, int64_t nq, int64_t npairs, float* const* out) {
  constexpr int64_t kMax = NV == 4 ? 6 : 2;
  for (int64_t i = 0; i < nq; i += kMax) {
    switch (std::min(kMax, nq - i)) {
      case 1: pair_sums<NV, 1>(vt, w + i, npairs, out + i); break;
      case 2: pair_sums<NV, 2>(vt, w + i, npairs, out + i); break;
      case 3: if constexpr (kMax >= 3) pair_sums<NV, 3>(vt, w + i, npairs, out + i); break;
      case 4: if constexpr (kMax >= 4) pair_sums<NV, 4>(vt, w + i, npairs, out + i); break;
      case 5: if constexpr (kMax >= 5) pair_sums<NV, 5>(vt, w + i, npairs, out + i); break;
      default: if constexpr (kMax >= 6) pair_sums<NV, 6>(vt, w + i, npairs, out + i); break;
    }
  }
}

}  // namespace tm_paged

// The kernels of the AVX-512 bf16 path of paged decode attention (included by
// paged_attention.cpp; paged_attention_tasks.h splits a batch into their tasks): each computes, for
// a run of rows, a kv head and a chunk of kKeyChunk keys, a partial softmax (max, sum,
// unnormalized sum of values) per row and query head, and combine_partials merges a row's chunks.
// A row's chunks depend on its length only, and each chunk's arithmetic on that row only (the
// rows of a run share K/V loads, not sums), so a row's result does not depend on the batch, on
// the run it is part of (a speculative verification), or on the thread count.
// The cache is bf16, or int8 / fp8 e4m3 / fp8 e5m2 codes with one float scale per token and kv head
// (quant_kv.cpp writes them). Keys go to the scores as bf16 (codes exactly; the scale multiplies
// the score, paged_attention_keys.h), and values too (the scale multiplies the token's weight,
// paged_attention_values.h).
#pragma once

#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <immintrin.h>

#include <memory>

namespace tm_paged {

constexpr int64_t kKeyChunk = 64;

inline int64_t key_chunks(int64_t L) { return (L + kKeyChunk - 1) / kKeyChunk; }

// Blocks of a sequence are scattered in the pool, so the hardware prefetcher stalls at every
// block boundary; fetch this head's rows kAheadBytes ahead (per stream, K or V), block by block,
// into L2. One block ahead into L1 read a context from DRAM at 6-9 GB/s on an AMD EPYC Zen 4;
// 16 KiB into L2 at 10-25 (BENCHMARKS.md, "Paged decode attention from DRAM").
constexpr int64_t kAheadBytes = 16384;
template <typename C>
inline void prefetch_block(const C* first_row, int64_t rows, int64_t row_stride, int64_t row_bytes) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < row_bytes; b += 64)
      _mm_prefetch(reinterpret_cast<const char*>(first_row + r * row_stride) + b, _MM_HINT_T1);
}

// 16 quantized cache values as floats: int8 and fp8 e4m3 as their codes (times the token's scale later)
inline __m512 f32x16(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)p)));
}
// e4m3 (bias 7) bits moved into a float's exponent and mantissa fields, then scaled by 2^(127 - 7):
// exact for normal and subnormal codes (the writer clamps, so no NaN code is ever stored)
inline __m512 f32x16(const c10::Float8_e4m3fn* p) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
  const __m512i mag = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x7F)), 20);
  const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(b, _mm512_set1_epi32(0x80)), 24);
  return _mm512_mul_ps(_mm512_castsi512_ps(_mm512_or_si512(mag, sign)), _mm512_set1_ps(0x1p120f));
}

// e5m2 is the top byte of an IEEE half: shifted into place, a half-to-float conversion is exact
inline __m512 f32x16(const c10::Float8_e5m2* p) {
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)p));
  return _mm512_cvtph_ps(_mm256_slli_epi16(b, 8));
}

// The scale of a cache slot's row of kv head h in a quantized cache ([num_blocks, BS, Hkv]
// floats), 1 for a bf16 cache.
template <typename C>
inline float slot_scale(const float* scales, int64_t slot, int64_t Hkv, int64_t h) {
  if constexpr (std::is_same_v<C, at::BFloat16>) return 1.f;
  else return scales[slot * Hkv + h];
}

// The cache slots (block * BS + offset) of tokens [t0, t0 + n), without a division per token;
// prefetches the rows of kv head h of `cache` kAheadBytes ahead on the way (blocks are scattered):
// at the chunk's start every block up to there (most already in flight when the previous chunk ran
// on this thread), then one block per block read.
template <typename C>
inline void chunk_slots(const C* cache, const int64_t* table, int64_t t0, int64_t n, int64_t BS, int64_t row,
                        int64_t h, int64_t D, int64_t nblocks, int64_t* slots) {
  int64_t blk = t0 / BS, off = t0 % BS;
  const int64_t A = std::max<int64_t>(1, kAheadBytes / static_cast<int64_t>(D * sizeof(C)) / BS);
  for (int64_t i = 0; i < n; ++i) {
    if (i == 0) {
      for (int64_t a = 1; a <= A && blk + a < nblocks; ++a)
        prefetch_block(cache + table[blk + a] * BS * row + h * D, BS, row, D * sizeof(C));
    } else if (off == 0 && blk + A < nblocks) {
      prefetch_block(cache + table[blk + A] * BS * row + h * D, BS, row, D * sizeof(C));
    }
    slots[i] = table[blk] * BS + off;
    if (++off == BS) off = 0, ++blk;
  }
}

template <typename C>
struct PagedKV {  // the cache of one layer: K and V codes, and their scales (unused for bf16)
  const C* k;
  const C* v;
  const float* ks;
  const float* vs;
};

// One partial: [m, l, acc[D]] per (row, query head, chunk of the row).
// A buffer of them for every row and head, or (base, hq0) for the rows of one run and the H heads
// from hq0 (a task's own, see decode_attention_avx512). Not zeroed: each is written before it is read.
struct Partials {
  float* buf;
  const int64_t* first;  // row -> index of its first chunk
  int64_t H, stride, base = 0, hq0 = 0;
  float* at(int64_t b, int64_t hq, int64_t c) { return buf + ((first[b] - base + c) * H + hq - hq0) * stride; }
};

}  // namespace tm_paged

#include "paged_attention_keys.h"
#include "paged_attention_values.h"

namespace tm_paged {

// chunk_partials below for one row (a plain decode) with G known, its buffers on the stack; the same
// operations in the same order.
template <int NV, int G, typename C>
void row_chunk(const at::BFloat16* q, const PagedKV<C>& kv, const int64_t* table, int64_t L, int64_t b, int64_t h,
               int64_t H, int64_t row, int64_t BS, int64_t t0, float scale, Partials& part, float* scores) {
  constexpr int64_t D = 16 * NV;
  const int64_t t1 = std::min(t0 + kKeyChunk, L), n = t1 - t0;
  alignas(64) __m512i kt[kKeyChunk / 16 * 8 * NV];
  alignas(64) float sv[kKeyChunk];
  alignas(64) int32_t qd[G][8 * NV];
  const int32_t* qp[G];
  float* sp[G];
  stage_keys<NV, C>(kv, table, L, t0, n, BS, row, h, scale, kt, sv);
  for (int g = 0; g < G; ++g) {
    query_pairs<NV>(q + (b * H + h * G + g) * D, qd[g]);
    qp[g] = qd[g];
    sp[g] = scores + g * kKeyChunk;
  }
  chunk_scores<NV>(qp, G, kt, n, sv, sp);
  alignas(64) __m512i vt[kKeyChunk / 2 * NV];
  alignas(64) int32_t w[G][kKeyChunk / 2];
  float* op[G];
  stage_values<NV, C>(kv, table, L, t0, n, BS, row, h, vt, sv);
  float* pp[G];
  int32_t* wq[G];
  for (int g = 0; g < G; ++g) {
    pp[g] = part.at(b, h * G + g, t0 / kKeyChunk);
    wq[g] = w[g];
    op[g] = pp[g] + 2;
  }
  softmax_weights_of<C>(sp, G, n, sv, pp, wq);
  pair_sums_of<NV>(vt, wq, G, (n + 1) / 2, op);
}

// Rows [b0, b0 + R) of one run (lengths L0, L0 + 1, ...), kv head h, keys [t0, t0 + kKeyChunk):
// the partials of every row whose keys reach t0. The chunk's keys and values are staged once; the
// scores of all the run's (row, query head) pairs come from the staged keys (chunk_scores), their
// weighted values from the staged values (pair_sums_of); per score and per output lane the same
// operations in the same order as row_chunk, so a row's result is bit for bit that of the row alone.
struct Scratch {  // a thread's buffers, reused across its tasks
  std::vector<float> scores;
  std::vector<int32_t> qbuf, wbuf;
  std::vector<__m512i> kt;  // the staged keys, then the staged values
  std::vector<const int32_t*> qp;
  std::vector<float*> sp, op, pp;  // pp: each (row, head)'s partial
  std::vector<int32_t*> wq;  // its weights, written by the softmax
};

template <int NV, typename C>
void chunk_partials(const at::BFloat16* q, const PagedKV<C>& kv, const int64_t* table, const int64_t* seq_lens,
                    int64_t b0, int64_t R, int64_t h, int64_t H, int64_t G, int64_t row, int64_t BS, int64_t t0,
                    float scale, Partials& part, Scratch& scratch) {
  auto& [scores, qbuf, wbuf, kt, qp, sp, op, pp, wq] = scratch;
  constexpr int64_t D = 16 * NV;
  const int64_t L0 = seq_lens[b0], Lmax = seq_lens[b0 + R - 1];
  const int64_t t1 = std::min(t0 + kKeyChunk, Lmax), n = t1 - t0;
  const int64_t r0 = std::max<int64_t>(0, t0 - L0 + 1);  // rows before r0 end before t0
  const int64_t Q = (R - r0) * G;  // the (row, head) pairs that reach this chunk
  qbuf.resize(Q * 8 * NV);
  scores.resize(Q * kKeyChunk + kKeyChunk);
  wbuf.resize(Q * kKeyChunk / 2);
  kt.resize(kKeyChunk / 16 * 8 * NV + kKeyChunk / 2 * NV);
  float* sv = scores.data() + Q * kKeyChunk;
  qp.resize(Q);
  sp.resize(Q);
  op.resize(Q);
  pp.resize(Q);
  wq.resize(Q);
  for (int64_t i = 0; i < Q; ++i) {
    query_pairs<NV>(q + ((b0 + r0 + i / G) * H + h * G + i % G) * D, &qbuf[i * 8 * NV]);
    qp[i] = &qbuf[i * 8 * NV];
    sp[i] = &scores[i * kKeyChunk];
  }
  stage_keys<NV, C>(kv, table, Lmax, t0, n, BS, row, h, scale, kt.data(), sv);
  chunk_scores<NV>(qp.data(), Q, kt.data(), n, sv, sp.data());
  __m512i* vt = kt.data() + kKeyChunk / 16 * 8 * NV;
  stage_values<NV, C>(kv, table, Lmax, t0, n, BS, row, h, vt, sv);
  for (int64_t r = r0; r < R; ++r)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t i = (r - r0) * G + g;
      pp[i] = part.at(b0 + r, h * G + g, t0 / kKeyChunk);
      wq[i] = &wbuf[i * kKeyChunk / 2];
      op[i] = pp[i] + 2;
    }
  if (L0 + r0 >= t1) {  // every row reaches all n keys: the queries of all rows together
    softmax_weights_of<C>(sp.data(), Q, n, sv, pp.data(), wq.data());
    pair_sums_of<NV>(vt, wq.data(), Q, (n + 1) / 2, op.data());
  } else {
    for (int64_t r = r0; r < R; ++r) {  // each row over the keys it reaches
      const int64_t i = (r - r0) * G, nr = std::min(t1, L0 + r) - t0;
      softmax_weights_of<C>(sp.data() + i, G, nr, sv, pp.data() + i, wq.data() + i);
      pair_sums_of<NV>(vt, wq.data() + i, G, (nr + 1) / 2, op.data() + i);
    }
  }
}

// out = sum_c e^(m_c - M) acc_c / sum_c e^(m_c - M) l_c over the row's chunks, in chunk order
template <int NV>
void combine_partials(at::BFloat16* o, Partials& part, int64_t b, int64_t hq, int64_t chunks) {
  constexpr int64_t D = 16 * NV;
  float M = -INFINITY;
  for (int64_t c = 0; c < chunks; ++c) M = std::max(M, part.at(b, hq, c)[0]);
  __m512 acc[NV];
  for (int j = 0; j < NV; ++j) acc[j] = _mm512_setzero_ps();
  float l = 0.f;
  for (int64_t c = 0; c < chunks; ++c) {
    const float* p = part.at(b, hq, c);
    const float w = std::exp(p[0] - M);
    l += w * p[1];
    for (int j = 0; j < NV; ++j) acc[j] = _mm512_fmadd_ps(_mm512_set1_ps(w), _mm512_loadu_ps(p + 2 + 16 * j), acc[j]);
  }
  for (int j = 0; j < NV; ++j) {
    const __m256i h = bf16x16_c10(_mm512_mul_ps(acc[j], _mm512_set1_ps(1.f / l)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + 16 * j), h);
  }
}

}  // namespace tm_paged

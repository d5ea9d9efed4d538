// The kernels of the AVX-512 bf16 path of paged decode attention (included by
// paged_attention.cpp; paged_attention_tasks.h splits a batch into their tasks): each computes, for
// a run of rows, a kv head and a chunk of kKeyChunk keys, a partial softmax (max, sum,
// unnormalized sum of values) per row and query head, and combine_partials merges a row's chunks.
// A row's chunks depend on its length only, and each chunk's arithmetic on that row only (the
// rows of a run share K/V loads, not sums), so a row's result does not depend on the batch, on
// the run it is part of (a speculative verification), or on the thread count.
// The cache is bf16, or int8 / fp8 e4m3 codes with one float scale per token and kv head
// (quant_kv.cpp writes them), turned into floats (code times scale) as each row is loaded.
#pragma once

#include <c10/util/Float8_e4m3fn.h>
#include <immintrin.h>

#include <memory>

namespace tm_paged {

constexpr int64_t kKeyChunk = 64;

inline int64_t key_chunks(int64_t L) { return (L + kKeyChunk - 1) / kKeyChunk; }

// Blocks of a sequence are scattered in the pool, so the hardware prefetcher stalls at every
// block boundary; fetch the next block's rows of this head while computing on the current one.
template <typename C>
inline void prefetch_block(const C* first_row, int64_t rows, int64_t row_stride, int64_t row_bytes) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < row_bytes; b += 64)
      _mm_prefetch(reinterpret_cast<const char*>(first_row + r * row_stride) + b, _MM_HINT_T0);
}

inline __m512 bf16x16_to_f32(const at::BFloat16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

// 16 cache values as floats: bf16 exactly; int8 and fp8 e4m3 as their codes (times the token's scale later)
inline __m512 f32x16(const at::BFloat16* p) { return bf16x16_to_f32(p); }
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

// A token's scale in a quantized cache ([num_blocks, BS, Hkv] floats), 1 for a bf16 cache.
template <typename C>
inline float token_scale(const float* scales, const int64_t* table, int64_t t, int64_t BS, int64_t Hkv, int64_t h) {
  if constexpr (std::is_same_v<C, at::BFloat16>) return 1.f;
  else return scales[(table[t / BS] * BS + t % BS) * Hkv + h];
}

// 16 values of a token's K or V row, as floats: a quantized code times the token's scale
template <typename C>
inline __m512 kv16(const C* p, float s) {
  if constexpr (std::is_same_v<C, at::BFloat16>) return f32x16(p);
  else return _mm512_mul_ps(f32x16(p), _mm512_set1_ps(s));
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

// chunk_partials below for one row (a plain decode) with G known: q and the sums stay in registers;
// the same operations in the same order.
template <int NV, int G, typename C>
void row_chunk(const at::BFloat16* q, const PagedKV<C>& kv, const int64_t* table, int64_t L, int64_t b, int64_t h,
               int64_t H, int64_t row, int64_t BS, int64_t t0, float scale, Partials& part, float* scores) {
  constexpr int64_t D = 16 * NV;
  const int64_t Hkv = row / D;
  const int64_t t1 = std::min(t0 + kKeyChunk, L), n = t1 - t0, nblocks = (L + BS - 1) / BS;
  __m512 qv[G][NV], acc[G][NV];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < NV; ++j) {
      qv[g][j] = _mm512_mul_ps(bf16x16_to_f32(q + (b * H + h * G + g) * D + 16 * j), _mm512_set1_ps(scale));
      acc[g][j] = _mm512_setzero_ps();
    }
  for (int64_t t = t0; t < t1; ++t) {
    if ((t % BS == 0 || t == t0) && t / BS + 1 < nblocks)
      prefetch_block(kv.k + table[t / BS + 1] * BS * row + h * D, BS, row, D * sizeof(C));
    const C* k = token_row(kv.k, table, t, BS, row, h, D);
    __m512 kx[NV];
    const float ks = token_scale<C>(kv.ks, table, t, BS, Hkv, h);
    for (int j = 0; j < NV; ++j) kx[j] = kv16(k + 16 * j, ks);
    for (int g = 0; g < G; ++g) {
      __m512 a = _mm512_mul_ps(qv[g][0], kx[0]);
      for (int j = 1; j < NV; ++j) a = _mm512_fmadd_ps(qv[g][j], kx[j], a);
      scores[g * n + t - t0] = _mm512_reduce_add_ps(a);
    }
  }
  for (int g = 0; g < G; ++g) {
    float* p = part.at(b, h * G + g, t0 / kKeyChunk);
    p[1] = softmax_partial(scores + g * n, n, p[0]);
  }
  for (int64_t t = t0; t < t1; ++t) {
    if ((t % BS == 0 || t == t0) && t / BS + 1 < nblocks)
      prefetch_block(kv.v + table[t / BS + 1] * BS * row + h * D, BS, row, D * sizeof(C));
    const C* v = token_row(kv.v, table, t, BS, row, h, D);
    __m512 vv[NV];
    const float vs = token_scale<C>(kv.vs, table, t, BS, Hkv, h);
    for (int j = 0; j < NV; ++j) vv[j] = kv16(v + 16 * j, vs);
    for (int g = 0; g < G; ++g) {
      const __m512 pg = _mm512_set1_ps(scores[g * n + t - t0]);
      for (int j = 0; j < NV; ++j) acc[g][j] = _mm512_fmadd_ps(pg, vv[j], acc[g][j]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < NV; ++j) _mm512_storeu_ps(part.at(b, h * G + g, t0 / kKeyChunk) + 2 + 16 * j, acc[g][j]);
}

// _mm512_reduce_add_ps of 16 vectors at once, each sum exactly as GCC's (lanes i + (i + 8), then
// j + (j + 4), then 0 + 2 and 1 + 3, then those two; float addition commutes), by shuffles that
// serve four or eight vectors per add. Output lane 4l + m is the sum of a[4m + l]: put item j at
// a[slot16(j)] to get them in order.
constexpr int slot16(int j) { return 4 * (j % 4) + j / 4; }

inline __m512 reduce_add16(const __m512 a[16]) {
  __m512 b[8], c[4];
  for (int p = 0; p < 8; ++p)
    b[p] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], 0x44),
                         _mm512_shuffle_f32x4(a[2 * p], a[2 * p + 1], 0xEE));
  for (int s = 0; s < 4; ++s)
    c[s] = _mm512_add_ps(_mm512_shuffle_f32x4(b[2 * s], b[2 * s + 1], 0x88),
                         _mm512_shuffle_f32x4(b[2 * s], b[2 * s + 1], 0xDD));
  const __m512 d0 = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x44), _mm512_shuffle_ps(c[0], c[1], 0xEE));
  const __m512 d1 = _mm512_add_ps(_mm512_shuffle_ps(c[2], c[3], 0x44), _mm512_shuffle_ps(c[2], c[3], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_ps(d0, d1, 0x88), _mm512_shuffle_ps(d0, d1, 0xDD));
}

// sum_t p_i[t] v[t] for NH heads (out_i), each lane's sum in t order from zero, as row_chunk.
template <int NV, int NH>
inline void weighted_values(const float* vf, const float* const* p, int64_t n, float* const* out) {
  __m512 acc[NH][NV];
  for (int i = 0; i < NH; ++i)
    for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t t = 0; t < n; ++t) {
    __m512 v[NV];
    for (int j = 0; j < NV; ++j) v[j] = _mm512_loadu_ps(vf + t * 16 * NV + 16 * j);
    for (int i = 0; i < NH; ++i) {
      const __m512 pt = _mm512_set1_ps(p[i][t]);
      for (int j = 0; j < NV; ++j) acc[i][j] = _mm512_fmadd_ps(pt, v[j], acc[i][j]);
    }
  }
  for (int i = 0; i < NH; ++i)
    for (int j = 0; j < NV; ++j) _mm512_storeu_ps(out[i] + 16 * j, acc[i][j]);
}

// Rows [b0, b0 + R) of one run (lengths L0, L0 + 1, ...), kv head h, keys [t0, t0 + kKeyChunk):
// the partials of every row whose keys reach t0. The chunk's K and V rows are turned into floats
// once (kvf), then each (row, query head) runs over them with its sums in registers, its scores 16
// keys at a time (reduce_add16), the weighted values of up to 4 heads at once (independent FMA
// chains); per score and per output lane the same operations in the same order as row_chunk, so a
// row's result is bit for bit that of the row alone.
template <int NV, typename C>
void chunk_partials(const at::BFloat16* q, const PagedKV<C>& kv, const int64_t* table, const int64_t* seq_lens,
                    int64_t b0, int64_t R, int64_t h, int64_t H, int64_t G, int64_t row, int64_t BS, int64_t t0,
                    float scale, Partials& part, std::vector<float>& scores, std::vector<__m512>& qbuf,
                    std::vector<float>& kvf) {
  constexpr int64_t D = 16 * NV;
  const int64_t Hkv = row / D;
  const int64_t L0 = seq_lens[b0], Lmax = seq_lens[b0 + R - 1];
  const int64_t CH = std::min(kKeyChunk, Lmax);
  const int64_t t1 = std::min(t0 + kKeyChunk, Lmax);
  const int64_t r0 = std::max<int64_t>(0, t0 - L0 + 1);  // rows before r0 end before t0
  qbuf.resize(R * G * NV);
  scores.resize(R * G * CH);
  kvf.resize(2 * CH * D);
  float* kf = kvf.data();
  float* vf = kf + CH * D;
  for (int64_t r = r0; r < R; ++r)
    for (int64_t g = 0; g < G; ++g)
      for (int j = 0; j < NV; ++j)
        qbuf[(r * G + g) * NV + j] =
            _mm512_mul_ps(bf16x16_to_f32(q + ((b0 + r) * H + h * G + g) * D + 16 * j), _mm512_set1_ps(scale));
  const int64_t nblocks = (Lmax + BS - 1) / BS;
  auto to_floats = [&](const C* cache, const float* scales, float* dst) {
    for (int64_t t = t0; t < t1; ++t) {
      if ((t % BS == 0 || t == t0) && t / BS + 1 < nblocks)
        prefetch_block(cache + table[t / BS + 1] * BS * row + h * D, BS, row, D * sizeof(C));
      const C* src = token_row(cache, table, t, BS, row, h, D);
      const float s = token_scale<C>(scales, table, t, BS, Hkv, h);
      for (int j = 0; j < NV; ++j) _mm512_storeu_ps(dst + (t - t0) * D + 16 * j, kv16(src + 16 * j, s));
    }
  };
  to_floats(kv.k, kv.ks, kf);
  to_floats(kv.v, kv.vs, vf);
  for (int64_t r = r0; r < R; ++r) {
    const int64_t n = std::min(t1, L0 + r) - t0;  // the keys this row reaches
    for (int64_t g = 0; g < G; ++g) {
      const __m512* qv = &qbuf[(r * G + g) * NV];
      float* sc = &scores[(r * G + g) * CH];
      auto dot = [&](int64_t t) {
        const float* k = kf + t * D;
        __m512 acc = _mm512_mul_ps(qv[0], _mm512_loadu_ps(k));
        for (int j = 1; j < NV; ++j) acc = _mm512_fmadd_ps(qv[j], _mm512_loadu_ps(k + 16 * j), acc);
        return acc;
      };
      int64_t t = 0;
      for (; t + 16 <= n; t += 16) {
        __m512 a[16];
        for (int j = 0; j < 16; ++j) a[slot16(j)] = dot(t + j);
        _mm512_storeu_ps(sc + t, reduce_add16(a));
      }
      for (; t < n; ++t) sc[t] = _mm512_reduce_add_ps(dot(t));
      float* p = part.at(b0 + r, h * G + g, t0 / kKeyChunk);
      p[1] = softmax_partial(sc, n, p[0]);
    }
    constexpr int64_t kHeads = NV == 4 ? 4 : 2;
    for (int64_t g = 0; g < G; g += kHeads) {
      const float* sc[kHeads];
      float* outp[kHeads];
      const int64_t nh = std::min(kHeads, G - g);
      for (int64_t i = 0; i < nh; ++i) {
        sc[i] = &scores[(r * G + g + i) * CH];
        outp[i] = part.at(b0 + r, h * G + g + i, t0 / kKeyChunk) + 2;
      }
      switch (nh) {
        case 1: weighted_values<NV, 1>(vf, sc, n, outp); break;
        case 2: weighted_values<NV, 2>(vf, sc, n, outp); break;
        case 3: if constexpr (kHeads >= 3) weighted_values<NV, 3>(vf, sc, n, outp); break;
        default: if constexpr (kHeads >= 4) weighted_values<NV, 4>(vf, sc, n, outp); break;
      }
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
  alignas(64) float tmp[D];
  for (int j = 0; j < NV; ++j) _mm512_store_ps(tmp + 16 * j, _mm512_mul_ps(acc[j], _mm512_set1_ps(1.f / l)));
  for (int64_t d = 0; d < D; ++d) o[d] = static_cast<at::BFloat16>(tmp[d]);
}

}  // namespace tm_paged

// The fp32 path of paged decode attention with AVX2 + FMA (included by paged_attention.cpp): the
// attention of a CPU without AVX512-BF16, whose engine runs in fp32. Against the portable kernel:
// - each row's keys are split into 64-key chunks (flash-decoding), so that one stream keeps both
//   threads busy whatever its number of kv heads (SmolLM2's 3 left one thread idle a third of the time);
// - four keys' dot products with up to three query heads at once (each key vector loaded once for
//   them), summed across lanes together (one transpose of hadds), not one horizontal sum per score;
// - the weighted values of 32 dimensions stay in registers over a chunk's keys.
// The chunks depend only on a row's length, so a row's result does not depend on the batch.
// The same path reads an int8 cache with a scale per token and kv head, or a bf16 one (quant_kv.cpp's
// layouts): its rows widen to fp32 as they are loaded, a key's scale multiplies its score and a
// value's its weight.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

namespace tm_paged {

constexpr int64_t kAvx2Chunk = 64;

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline __m256 load8(const at::BFloat16* p) {  // bf16 is the top half of an fp32
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

// The weighted values of dimensions d0..d0+31 for GN query heads at once: each value vector is
// loaded once for all of them, and the GN x 4 accumulators are independent FMA chains (one head's
// 4 chains waited on the FMA latency). Each accumulator sums its keys in order, as before. Not
// inlined: inside the task loop GCC kept the one-head instance's accumulators on the stack, a store
// and a reload a key (a third of a 7-head call's time, Qwen2.5-0.5B's).
template <int GN, typename C>
__attribute__((noinline)) void chunk_values_avx2(const C* v_cache, const int64_t* off, int64_t n,
                                                 const float* scores, int64_t D, int64_t d0, float* a) {
  __m256 acc[GN][4];
  for (int g = 0; g < GN; ++g)
    for (int c = 0; c < 4; ++c) acc[g][c] = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; ++i) {
    const C* v = v_cache + off[i] + d0;
    __m256 p[GN];
    for (int g = 0; g < GN; ++g) p[g] = _mm256_set1_ps(scores[g * kAvx2Chunk + i]);
    for (int c = 0; c < 4; ++c) {  // one vector register for the values: 3 x 4 accumulators + 3 + 1 = 16
      const __m256 vc = load8(v + 8 * c);
      for (int g = 0; g < GN; ++g) acc[g][c] = _mm256_fmadd_ps(p[g], vc, acc[g][c]);
    }
  }
  for (int g = 0; g < GN; ++g)
    for (int c = 0; c < 4; ++c) _mm256_storeu_ps(a + g * D + d0 + 8 * c, acc[g][c]);
}

// The scores of GN query heads (q: GN x D, scaled) against keys i..i+3 of a chunk, each key's
// vectors loaded once for all GN heads (one head at a time, every product had loaded its key).
// Per score: lane-wise FMA chains over d, then ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)),
// the order of scores8_avx2's transpose of hadds, so a head gets the same bits either way.
template <int GN, typename C>
__attribute__((always_inline)) inline void scores4_avx2(const float* q, const C* const k[4], int64_t D, float* s,
                                                        const float* ks) {
  __m256 acc[GN][4];
  for (int g = 0; g < GN; ++g)
    for (int j = 0; j < 4; ++j) acc[g][j] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) {
    __m256 qv[GN];
    for (int g = 0; g < GN; ++g) qv[g] = _mm256_loadu_ps(q + g * D + d);
    for (int j = 0; j < 4; ++j) {
      const __m256 kv = load8(k[j] + d);
      for (int g = 0; g < GN; ++g) acc[g][j] = _mm256_fmadd_ps(qv[g], kv, acc[g][j]);
    }
  }
  for (int g = 0; g < GN; ++g) {
    const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(acc[g][0], acc[g][1]), _mm256_hadd_ps(acc[g][2], acc[g][3]));
    const __m128 dots = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
    // all 4 lanes stored: a chunk's scores have kAvx2Chunk places, and those past n are not read
    _mm_storeu_ps(s + g * kAvx2Chunk, ks ? _mm_mul_ps(dots, _mm_loadu_ps(ks)) : dots);
  }
}

// One query head's scores against keys i..i+7 (the arithmetic of scores4_avx2's, per score).
template <typename C>
__attribute__((always_inline)) inline void scores8_avx2(const float* q, const C* const k[8], int64_t D, float* s,
                                                        const float* ks) {
  __m256 acc[8];
  for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
  for (int64_t d = 0; d < D; d += 8) {
    const __m256 qv = _mm256_loadu_ps(q + d);
    for (int j = 0; j < 8; ++j) acc[j] = _mm256_fmadd_ps(qv, load8(k[j] + d), acc[j]);
  }
  const __m256 ab = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
  const __m256 cd = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7]));
  const __m256 dots = _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
  _mm256_storeu_ps(s, ks ? _mm256_mul_ps(dots, _mm256_loadu_ps(ks)) : dots);
}

// One (row, kv head, chunk of keys), first half: the G query heads' scores of the chunk's n keys,
// then their maximum and softmax numerators' sum (part: G maxima, G sums, then G x D values, written
// by chunk_values_of). ks, vs: the chunk's keys' scales (kAvx2Chunk of them readable), or null for
// an unscaled cache; then weights holds the numerators times the value scales.
template <typename C>
inline void chunk_scores_avx2(const float* q, const C* k_cache, const int64_t* off, int64_t n, int64_t G, int64_t D,
                              float* scores, float* part, const float* ks = nullptr, const float* vs = nullptr,
                              float* weights = nullptr) {
  // heads in threes, the rest one at a time over 8 keys (Qwen2.5-0.5B's 7 as 3 + 3 + 1)
  int64_t g0 = 0;
  for (; g0 + 3 <= G; g0 += 3)
    for (int64_t i = 0; i < n; i += 4) {
      const C* k[4];
      for (int j = 0; j < 4; ++j) k[j] = k_cache + off[std::min(i + j, n - 1)];  // a short tail repeats its last key
      scores4_avx2<3>(q + g0 * D, k, D, scores + g0 * kAvx2Chunk + i, ks ? ks + i : nullptr);
    }
  for (; g0 < G; ++g0)
    for (int64_t i = 0; i < n; i += 8) {
      const C* k[8];
      for (int j = 0; j < 8; ++j) k[j] = k_cache + off[std::min(i + j, n - 1)];
      scores8_avx2(q + g0 * D, k, D, scores + g0 * kAvx2Chunk + i, ks ? ks + i : nullptr);
    }
  for (int64_t g = 0; g < G; ++g) {
    float* s = scores + g * kAvx2Chunk;
    float m;
    part[G + g] = softmax_partial(s, n, m);
    part[g] = m;
    if (vs)
      for (int64_t i = 0; i < n; ++i) weights[g * kAvx2Chunk + i] = s[i] * vs[i];
  }
}

// Second half: the numerators' (w: G x kAvx2Chunk) weighted values into part's G x D.
template <typename C>
inline void chunk_values_of(const C* v_cache, const int64_t* off, int64_t n, int64_t G, int64_t D, const float* w,
                            float* part) {
  for (int64_t g0 = 0; g0 < G; g0 += 3) {
    const int64_t gn = std::min<int64_t>(3, G - g0);
    float* a = part + 2 * G + g0 * D;
    for (int64_t d0 = 0; d0 < D; d0 += 32) {
      if (gn == 3) chunk_values_avx2<3>(v_cache, off, n, w + g0 * kAvx2Chunk, D, d0, a);
      else if (gn == 2) chunk_values_avx2<2>(v_cache, off, n, w + g0 * kAvx2Chunk, D, d0, a);
      else chunk_values_avx2<1>(v_cache, off, n, w + g0 * kAvx2Chunk, D, d0, a);
    }
  }
}

// A chunk's K or V rows towards L2, a task ahead of their use: the rows are scattered over the
// pool's blocks, where the hardware prefetcher finds them late (a call reading from DRAM took twice
// its time from cache). K's are asked for as the next task's keys are worked out, V's once this
// task's scores are done: both at once, the burst of prefetches held up this task's own loads, and
// a call took its memory time plus its arithmetic (an AVX2 Zen 4, 1x9/3x64 at 1024 keys from DRAM:
// fp32 1.15-1.23x faster split, bf16 1.8x, int8 alike).
template <typename C>
inline void prefetch_rows(const C* cache, const int64_t* off, int64_t n, int64_t D) {
  for (int64_t i = 0; i < n; ++i)
    for (int64_t d = 0; d < D; d += 64 / int64_t(sizeof(C)))
      _mm_prefetch(reinterpret_cast<const char*>(cache + off[i] + d), _MM_HINT_T1);
}

// fp32 queries and output; head_dim a multiple of 32. Same arguments as decode_attention, and the
// scales [num_blocks, block_size, Hkv] of an int8 cache (null for fp32 or bf16).
template <typename C>
inline void decode_attention_avx2(float* out, const float* q, const C* k_cache, const C* v_cache,
                                  const int64_t* block_tables, const int64_t* seq_lens, int64_t B, int64_t H,
                                  int64_t Hkv, int64_t D, int64_t BS, int64_t max_blocks, float scale,
                                  const float* k_scale = nullptr, const float* v_scale = nullptr) {
  const int64_t G = H / Hkv, row = Hkv * D, part_size = G * (D + 2);
  std::vector<int64_t> first(B + 1, 0);  // the first chunk of each row
  for (int64_t b = 0; b < B; ++b)
    first[b + 1] = first[b] + (std::max<int64_t>(seq_lens[b], 0) + kAvx2Chunk - 1) / kAvx2Chunk;
  // not zeroed: every chunk a row has is written before its merge reads it (zeroing a 17-row
  // verification's partials, ~0.5 MB, was 7% of its attention and kept the other thread waiting)
  std::unique_ptr<float[]> parts(new float[first[B] * Hkv * part_size]);
  auto part_of = [&](int64_t b, int64_t c, int64_t h) { return parts.get() + ((first[b] + c) * Hkv + h) * part_size; };
  // Runs of rows with lengths rising by one over one block table (a speculative verification, or a
  // prompt's rows in batch-invariant mode) take each (kv head, chunk of keys) together: the chunk's
  // K/V rows come from DRAM once and stay in cache for the run's other rows, which each re-read them
  // before (a 17-row verification read its sequence's cache 17 times). Each row's arithmetic is
  // unchanged, so is its result. At most kAvx2Run rows a run, for the threads' balance. Each row's
  // table agrees with the row before it over that row's blocks, so every row's keys are the first
  // of the longest row's: their offsets are worked out once a chunk, from it.
  constexpr int64_t kAvx2Run = 32;
  std::vector<int64_t> runs{0};  // run i: rows [runs[i], runs[i + 1])
  for (int64_t b = 1; b < B; ++b) {
    const int64_t prev_blocks = (std::max<int64_t>(seq_lens[b - 1], 0) + BS - 1) / BS;
    const bool more = b - runs.back() < kAvx2Run && seq_lens[b] == seq_lens[b - 1] + 1 &&
                      std::equal(block_tables + b * max_blocks, block_tables + b * max_blocks + prev_blocks,
                                 block_tables + (b - 1) * max_blocks);
    if (!more) runs.push_back(b);
  }
  runs.push_back(B);
  const int64_t R = static_cast<int64_t>(runs.size()) - 1;
  std::vector<int64_t> task_start{0};  // run i's tasks: (chunk, kv head) of its longest row
  for (int64_t i = 0; i < R; ++i)
    task_start.push_back(task_start.back() + (first[runs[i + 1]] - first[runs[i + 1] - 1]) * Hkv);
  // row b's keys t0.. of a chunk: their offsets in the cache and their scales' index; returns how many
  auto chunk_keys = [&](int64_t b, int64_t t0, int64_t h, int64_t* off, int64_t* at) {
    const int64_t n = std::min(kAvx2Chunk, seq_lens[b] - t0);
    const int64_t* table = block_tables + b * max_blocks;
    int64_t blk = t0 / BS, in_blk = t0 % BS;  // stepped, not divided per key (an idiv each)
    for (int64_t i = 0; i < n; ++i) {
      const int64_t slot = table[blk] * BS + in_blk;
      off[i] = slot * row + h * D;
      at[i] = slot * Hkv + h;
      if (++in_blk == BS) in_blk = 0, ++blk;
    }
    return n;
  };
  // task -> (run, chunk start t0, kv head)
  auto task_of = [&](int64_t task, int64_t& ri, int64_t& t0, int64_t& h) {
    ri = std::upper_bound(task_start.begin(), task_start.end(), task) - task_start.begin() - 1;
    const int64_t local = task - task_start[ri];
    t0 = local / Hkv * kAvx2Chunk;
    h = local % Hkv;
  };
  // a task's keys: (run, chunk start, kv head) and its longest row's offsets and scale indices
  struct TaskKeys {
    int64_t ri, t0, h, n, off[kAvx2Chunk], at[kAvx2Chunk];
  };
  auto keys_of = [&](int64_t task, TaskKeys& t) {
    task_of(task, t.ri, t.t0, t.h);
    t.n = chunk_keys(runs[t.ri + 1] - 1, t.t0, t.h, t.off, t.at);
    prefetch_rows(k_cache, t.off, t.n, D);
  };
  // A run's rows go through a chunk in groups of kAvx2Rows, by phase: every row's scores while the
  // chunk's K rows are in L1, then every row's weighted values while its V rows are (one row at a
  // time, its K and V together filled L1 and each next row re-read them from L2). Each row's
  // arithmetic is unchanged.
  constexpr int64_t kAvx2Rows = 8;
  const int64_t row_scores = G * kAvx2Chunk;
  TaskShares shares(task_start.back(), at::get_num_threads());
  at::parallel_for(0, shares.count(), 1, [&](int64_t own, int64_t) {
    std::vector<float> qf(G * D), scores(kAvx2Rows * row_scores), weights(k_scale ? kAvx2Rows * row_scores : 0);
    float ks[kAvx2Chunk] = {}, vs[kAvx2Chunk] = {};
    TaskKeys bufs[2];
    TaskKeys *cur = &bufs[0], *next = &bufs[1];
    int64_t cursor = 0, task = shares.claim(own, cursor), after = -1;
    if (task >= 0) keys_of(task, *cur);
    for (; task >= 0; task = after, std::swap(cur, next)) {
      after = shares.claim(own, cursor);  // claimed now, so that its K rows come while this one runs (V: below)
      if (after >= 0) keys_of(after, *next);
      const int64_t t0 = cur->t0, h = cur->h;
      if (k_scale)
        for (int64_t i = 0; i < cur->n; ++i) ks[i] = k_scale[cur->at[i]], vs[i] = v_scale[cur->at[i]];
      const float* w = k_scale ? weights.data() : scores.data();
      for (int64_t r0 = runs[cur->ri]; r0 < runs[cur->ri + 1]; r0 += kAvx2Rows) {
        const int64_t r1 = std::min(r0 + kAvx2Rows, runs[cur->ri + 1]);
        for (int64_t b = r0; b < r1; ++b) {
          if (seq_lens[b] <= t0) continue;  // a shorter row of the run ends before this chunk
          const float* qh = q + (b * H + h * G) * D;
          for (int64_t i = 0; i < G * D; ++i) qf[i] = qh[i] * scale;
          chunk_scores_avx2(qf.data(), k_cache, cur->off, std::min(kAvx2Chunk, seq_lens[b] - t0), G, D,
                            scores.data() + (b - r0) * row_scores, part_of(b, t0 / kAvx2Chunk, h),
                            k_scale ? ks : nullptr, k_scale ? vs : nullptr,
                            k_scale ? weights.data() + (b - r0) * row_scores : nullptr);
        }
        if (r0 == runs[cur->ri] && after >= 0) prefetch_rows(v_cache, next->off, next->n, D);
        for (int64_t b = r0; b < r1; ++b)
          if (seq_lens[b] > t0)
            chunk_values_of(v_cache, cur->off, std::min(kAvx2Chunk, seq_lens[b] - t0), G, D,
                            w + (b - r0) * row_scores, part_of(b, t0 / kAvx2Chunk, h));
      }
    }
  });
  // each (row, kv head): its chunks rescaled to their common maximum, in chunk order
  at::parallel_for(0, B * Hkv, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> w;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / Hkv, h = task % Hkv, nc = first[b + 1] - first[b];
      w.resize(nc);
      for (int64_t g = 0; g < G; ++g) {
        float m = -INFINITY, total = 0.f;
        for (int64_t c = 0; c < nc; ++c) m = std::max(m, part_of(b, c, h)[g]);
        for (int64_t c = 0; c < nc; ++c) {
          const float* p = part_of(b, c, h);
          w[c] = std::exp(p[g] - m);
          total += w[c] * p[G + g];
        }
        float* o = out + (b * H + h * G + g) * D;
        const float inv = total > 0.f ? 1.f / total : 0.f;
        for (int64_t d0 = 0; d0 < D; d0 += 8) {
          __m256 acc = _mm256_setzero_ps();
          for (int64_t c = 0; c < nc; ++c) {
            const float* a = part_of(b, c, h) + 2 * G + g * D;
            acc = _mm256_fmadd_ps(_mm256_set1_ps(w[c]), _mm256_loadu_ps(a + d0), acc);
          }
          _mm256_storeu_ps(o + d0, _mm256_mul_ps(acc, _mm256_set1_ps(inv)));
        }
      }
    }
  });
}

}  // namespace tm_paged

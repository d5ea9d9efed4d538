// Paged decode attention for CPU: each query token attends to its sequence's K/V read in place
// from the block-paged cache (no gather copy). One task per (sequence, kv head) on torch's
// intra-op thread pool; the G query heads of a kv head share every K/V load. Two passes over the
// keys (scores, then exp with a vectorized exp) and one over the values.
// A speculative verification (1 + k tokens of one sequence) arrives as consecutive rows over the
// same block table with lengths L, L + 1, ...: the bf16 path runs such a run of rows as one task
// that loads each K/V row once for all of them. Each row's arithmetic (its dot products, softmax
// and sums, in the same order) is that of a row alone, so the result does not depend on grouping.
// Built at first use by tokenmill/model/kernels.py; the caller is attention/cpu_paged.py.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

namespace tm_paged {  // named: the library compiles as one unit (kernels.py)

using fVec = at::vec::Vectorized<float>;
constexpr int64_t kVec = fVec::size();

// Load `n` (a multiple of kVec) elements as floats.
template <typename T>
inline void load_floats(const T* src, float* dst, int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    for (int64_t i = 0; i < n; i += kVec) fVec::loadu(src + i).store(dst + i);
  } else {
    using tVec = at::vec::Vectorized<T>;
    for (int64_t i = 0; i < n; i += tVec::size()) {
      auto [lo, hi] = at::vec::convert_to_float<T>(tVec::loadu(src + i));
      lo.store(dst + i);
      hi.store(dst + i + kVec);
    }
  }
}

// Turn one head's scores into softmax numerators in place (vectorized exp); returns 1 / their sum.
inline float softmax_numerators(float* s, int64_t L) {
  float m = -INFINITY;
  for (int64_t t = 0; t < L; ++t) m = std::max(m, s[t]);
  fVec vsum(0.f);
  int64_t t = 0;
  for (; t + kVec <= L; t += kVec) {
    fVec e = (fVec::loadu(s + t) - fVec(m)).exp_u20();
    e.store(s + t);
    vsum = vsum + e;
  }
  float sum = at::vec::vec_reduce_all<float>([](fVec& a, fVec& c) { return a + c; }, vsum);
  for (; t < L; ++t) {
    s[t] = std::exp(s[t] - m);
    sum += s[t];
  }
  return 1.f / sum;
}

// Token t of a sequence, head h: where its D values start in a [num_blocks, BS, Hkv, D] cache.
template <typename T>
inline const T* token_row(const T* cache, const int64_t* table, int64_t t, int64_t BS, int64_t row, int64_t h,
                          int64_t D) {
  return cache + (table[t / BS] * BS + t % BS) * row + h * D;
}

template <typename T>
void decode_attention(T* out, const T* q, const T* k_cache, const T* v_cache, const int64_t* block_tables,
                      const int64_t* seq_lens, int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t BS,
                      int64_t max_blocks, float scale) {
  const int64_t G = H / Hkv;
  const int64_t row = Hkv * D;  // elements between consecutive tokens of a block
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), kv(D), acc(G * D), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / Hkv, h = task % Hkv;
      const int64_t L = seq_lens[b];
      const int64_t* table = block_tables + b * max_blocks;
      load_floats(q + (b * H + h * G) * D, qf.data(), G * D);
      for (int64_t i = 0; i < G * D; i += kVec) (fVec::loadu(qf.data() + i) * fVec(scale)).store(qf.data() + i);
      scores.resize(G * L);
      // scores = q . k
      for (int64_t t = 0; t < L; ++t) {
        load_floats(token_row(k_cache, table, t, BS, row, h, D), kv.data(), D);
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qf.data() + g * D;
          fVec s(0.f);
          for (int64_t d = 0; d < D; d += kVec) s = at::vec::fmadd(fVec::loadu(qg + d), fVec::loadu(kv.data() + d), s);
          scores[g * L + t] = at::vec::vec_reduce_all<float>([](fVec& a, fVec& c) { return a + c; }, s);
        }
      }
      std::vector<float> inv(G);
      for (int64_t g = 0; g < G; ++g) inv[g] = softmax_numerators(scores.data() + g * L, L);
      // out = softmax . v
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < L; ++t) {
        load_floats(token_row(v_cache, table, t, BS, row, h, D), kv.data(), D);
        for (int64_t g = 0; g < G; ++g) {
          const fVec p(scores[g * L + t]);
          float* ag = acc.data() + g * D;
          for (int64_t d = 0; d < D; d += kVec)
            at::vec::fmadd(p, fVec::loadu(kv.data() + d), fVec::loadu(ag + d)).store(ag + d);
        }
      }
      T* o = out + (b * H + h * G) * D;
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) o[g * D + d] = static_cast<T>(acc[g * D + d] * inv[g]);
    }
  });
}


#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>

// Blocks of a sequence are scattered in the pool, so the hardware prefetcher stalls at every
// block boundary; fetch the next block's rows of this head while computing on the current one.
inline void prefetch_block(const at::BFloat16* first_row, int64_t rows, int64_t row_stride, int64_t row_bytes) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t b = 0; b < row_bytes; b += 64)
      _mm_prefetch(reinterpret_cast<const char*>(first_row + r * row_stride) + b, _MM_HINT_T0);
}

inline __m512 bf16x16_to_f32(const at::BFloat16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

// Runs of rows [start, end) that share a block table with lengths rising by one (a verification),
// cut so that there are at least `min_tasks` (run, kv head) tasks where rows allow.
std::vector<std::pair<int64_t, int64_t>> row_runs(const int64_t* tables, const int64_t* lens, int64_t B,
                                                  int64_t max_blocks, int64_t BS, int64_t Hkv, int64_t min_tasks) {
  constexpr int64_t kMaxRun = 16;
  std::vector<std::pair<int64_t, int64_t>> runs;
  for (int64_t b = 0; b < B;) {
    int64_t e = b + 1;
    while (e < B && e - b < kMaxRun && lens[e] == lens[e - 1] + 1 &&
           std::equal(tables + e * max_blocks, tables + e * max_blocks + (lens[e] + BS - 1) / BS, tables + b * max_blocks))
      ++e;
    runs.emplace_back(b, e);
    b = e;
  }
  for (bool cut = true; cut && static_cast<int64_t>(runs.size()) * Hkv < min_tasks;) {
    cut = false;
    std::vector<std::pair<int64_t, int64_t>> halves;
    for (auto [a, e] : runs) {
      if (e - a > 1) {
        halves.emplace_back(a, (a + e + 1) / 2);
        halves.emplace_back((a + e + 1) / 2, e);
        cut = true;
      } else {
        halves.emplace_back(a, e);
      }
    }
    runs.swap(halves);
  }
  return runs;
}

// bf16, rows [b0, b0 + R) of one run (lengths L0, L0 + 1, ...), kv head h: as R calls of the
// one-row code below (same operations per row), each K/V row loaded once.
template <int NV>
void run_attention_bf16(at::BFloat16* out, const at::BFloat16* q, const at::BFloat16* k_cache,
                        const at::BFloat16* v_cache, const int64_t* table, const int64_t* seq_lens, int64_t b0,
                        int64_t R, int64_t h, int64_t H, int64_t G, int64_t row, int64_t BS, float scale,
                        std::vector<float>& scores, std::vector<__m512>& qbuf, std::vector<__m512>& abuf) {
  constexpr int64_t D = 16 * NV;
  const int64_t L0 = seq_lens[b0], Lmax = seq_lens[b0 + R - 1];
  qbuf.resize(R * G * NV);
  abuf.assign(R * G * NV, _mm512_setzero_ps());
  scores.resize(R * G * Lmax);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t g = 0; g < G; ++g)
      for (int j = 0; j < NV; ++j)
        qbuf[(r * G + g) * NV + j] =
            _mm512_mul_ps(bf16x16_to_f32(q + ((b0 + r) * H + h * G + g) * D + 16 * j), _mm512_set1_ps(scale));
  const int64_t nblocks = (Lmax + BS - 1) / BS;
  for (int64_t t = 0; t < Lmax; ++t) {
    if (t % BS == 0 && t / BS + 1 < nblocks) prefetch_block(k_cache + table[t / BS + 1] * BS * row + h * D, BS, row, D * 2);
    const at::BFloat16* k = token_row(k_cache, table, t, BS, row, h, D);
    __m512 kv[NV];
    for (int j = 0; j < NV; ++j) kv[j] = bf16x16_to_f32(k + 16 * j);
    for (int64_t r = std::max<int64_t>(0, t - L0 + 1); r < R; ++r)  // rows whose keys reach t
      for (int64_t g = 0; g < G; ++g) {
        const __m512* qv = &qbuf[(r * G + g) * NV];
        __m512 acc = _mm512_mul_ps(qv[0], kv[0]);
        for (int j = 1; j < NV; ++j) acc = _mm512_fmadd_ps(qv[j], kv[j], acc);
        scores[(r * G + g) * Lmax + t] = _mm512_reduce_add_ps(acc);
      }
  }
  std::vector<float> inv(R * G);
  for (int64_t r = 0; r < R; ++r)
    for (int64_t g = 0; g < G; ++g) inv[r * G + g] = softmax_numerators(&scores[(r * G + g) * Lmax], L0 + r);
  for (int64_t t = 0; t < Lmax; ++t) {
    if (t % BS == 0 && t / BS + 1 < nblocks) prefetch_block(v_cache + table[t / BS + 1] * BS * row + h * D, BS, row, D * 2);
    const at::BFloat16* v = token_row(v_cache, table, t, BS, row, h, D);
    __m512 vv[NV];
    for (int j = 0; j < NV; ++j) vv[j] = bf16x16_to_f32(v + 16 * j);
    for (int64_t r = std::max<int64_t>(0, t - L0 + 1); r < R; ++r)
      for (int64_t g = 0; g < G; ++g) {
        const __m512 p = _mm512_set1_ps(scores[(r * G + g) * Lmax + t]);
        __m512* acc = &abuf[(r * G + g) * NV];
        for (int j = 0; j < NV; ++j) acc[j] = _mm512_fmadd_ps(p, vv[j], acc[j]);
      }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t g = 0; g < G; ++g) {
      at::BFloat16* o = out + ((b0 + r) * H + h * G + g) * D;
      alignas(64) float tmp[D];
      for (int j = 0; j < NV; ++j)
        _mm512_store_ps(tmp + 16 * j, _mm512_mul_ps(abuf[(r * G + g) * NV + j], _mm512_set1_ps(inv[r * G + g])));
      for (int64_t d = 0; d < D; ++d) o[d] = static_cast<at::BFloat16>(tmp[d]);
    }
}

// bf16 fast path for head_dim = 16 * NV (64 -> 4, 128 -> 8) and up to 8 query heads per kv head.
template <int NV>
void decode_attention_bf16(at::BFloat16* out, const at::BFloat16* q, const at::BFloat16* k_cache,
                           const at::BFloat16* v_cache, const int64_t* block_tables, const int64_t* seq_lens,
                           int64_t B, int64_t H, int64_t Hkv, int64_t BS, int64_t max_blocks, float scale) {
  constexpr int64_t D = 16 * NV;
  const int64_t G = H / Hkv;
  const int64_t row = Hkv * D;
  const auto runs = row_runs(block_tables, seq_lens, B, max_blocks, BS, Hkv, 2 * at::get_num_threads());
  const int64_t num_runs = static_cast<int64_t>(runs.size());
  at::parallel_for(0, num_runs * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<__m512> qbuf, abuf;
    for (int64_t task = begin; task < end; ++task) {
      const auto [b, b_end] = runs[task / Hkv];
      const int64_t h = task % Hkv;
      if (b_end - b > 1) {
        run_attention_bf16<NV>(out, q, k_cache, v_cache, block_tables + b * max_blocks, seq_lens, b, b_end - b, h, H,
                               G, row, BS, scale, scores, qbuf, abuf);
        continue;
      }
      const int64_t L = seq_lens[b];
      const int64_t* table = block_tables + b * max_blocks;
      __m512 qv[8][NV];
      for (int64_t g = 0; g < G; ++g)
        for (int j = 0; j < NV; ++j)
          qv[g][j] = _mm512_mul_ps(bf16x16_to_f32(q + (b * H + h * G + g) * D + 16 * j), _mm512_set1_ps(scale));
      scores.resize(G * L);
      const int64_t nblocks = (L + BS - 1) / BS;
      for (int64_t t = 0; t < L; ++t) {
        if (t % BS == 0 && t / BS + 1 < nblocks)
          prefetch_block(k_cache + table[t / BS + 1] * BS * row + h * D, BS, row, D * 2);
        const at::BFloat16* k = token_row(k_cache, table, t, BS, row, h, D);
        __m512 kv[NV];
        for (int j = 0; j < NV; ++j) kv[j] = bf16x16_to_f32(k + 16 * j);
        for (int64_t g = 0; g < G; ++g) {
          __m512 acc = _mm512_mul_ps(qv[g][0], kv[0]);
          for (int j = 1; j < NV; ++j) acc = _mm512_fmadd_ps(qv[g][j], kv[j], acc);
          scores[g * L + t] = _mm512_reduce_add_ps(acc);
        }
      }
      float inv[8];
      for (int64_t g = 0; g < G; ++g) inv[g] = softmax_numerators(scores.data() + g * L, L);
      __m512 acc[8][NV];
      for (int64_t g = 0; g < G; ++g)
        for (int j = 0; j < NV; ++j) acc[g][j] = _mm512_setzero_ps();
      for (int64_t t = 0; t < L; ++t) {
        if (t % BS == 0 && t / BS + 1 < nblocks)
          prefetch_block(v_cache + table[t / BS + 1] * BS * row + h * D, BS, row, D * 2);
        const at::BFloat16* v = token_row(v_cache, table, t, BS, row, h, D);
        __m512 vv[NV];
        for (int j = 0; j < NV; ++j) vv[j] = bf16x16_to_f32(v + 16 * j);
        for (int64_t g = 0; g < G; ++g) {
          const __m512 p = _mm512_set1_ps(scores[g * L + t]);
          for (int j = 0; j < NV; ++j) acc[g][j] = _mm512_fmadd_ps(p, vv[j], acc[g][j]);
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        at::BFloat16* o = out + (b * H + h * G + g) * D;
        alignas(64) float tmp[D];
        for (int j = 0; j < NV; ++j) _mm512_store_ps(tmp + 16 * j, _mm512_mul_ps(acc[g][j], _mm512_set1_ps(inv[g])));
        for (int64_t d = 0; d < D; ++d) o[d] = static_cast<at::BFloat16>(tmp[d]);
      }
    }
  });
}
#define TM_HAVE_AVX512_BF16_PATH 1
#endif

// out, q: [B, H, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D]; block_tables: [B, max_blocks]
// int64; seq_lens: [B] int64. head_dim must be a multiple of 32.
void paged_decode_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                            const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "paged_decode_attention: tensors must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong,
              "paged_decode_attention: block tables and lengths must be int64");
  TORCH_CHECK(q.size(2) % 32 == 0, "paged_decode_attention: head_dim must be a multiple of 32");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), BS = k_cache.size(1), Hkv = k_cache.size(2);
  auto bt = block_tables.contiguous();
  auto sl = seq_lens.contiguous();
  auto run = [&](auto tag) {
    using T = decltype(tag);
    decode_attention<T>(out.data_ptr<T>(), q.data_ptr<T>(), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(),
                        bt.data_ptr<int64_t>(), sl.data_ptr<int64_t>(), B, H, Hkv, D, BS, bt.size(1),
                        static_cast<float>(scale));
  };
  switch (q.scalar_type()) {
    case at::kFloat: run(float{}); break;
    case at::kBFloat16:
#ifdef TM_HAVE_AVX512_BF16_PATH
      if ((D == 64 || D == 128) && H / Hkv <= 8) {
        if (D == 64)
          decode_attention_bf16<4>(out.data_ptr<at::BFloat16>(), q.data_ptr<at::BFloat16>(),
                                   k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>(),
                                   bt.data_ptr<int64_t>(), sl.data_ptr<int64_t>(), B, H, Hkv, BS, bt.size(1),
                                   static_cast<float>(scale));
        else
          decode_attention_bf16<8>(out.data_ptr<at::BFloat16>(), q.data_ptr<at::BFloat16>(),
                                   k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>(),
                                   bt.data_ptr<int64_t>(), sl.data_ptr<int64_t>(), B, H, Hkv, BS, bt.size(1),
                                   static_cast<float>(scale));
        break;
      }
#endif
      run(at::BFloat16{});
      break;
    case at::kHalf: run(at::Half{}); break;
    default: TORCH_CHECK(false, "paged_decode_attention: unsupported dtype ", q.scalar_type());
  }
}

}  // namespace tm_paged

TORCH_LIBRARY(tokenmill, m) {
  m.def("paged_decode_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, float scale) -> ()");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("paged_decode_attention", &tm_paged::paged_decode_attention);
}

// Paged decode attention for CPU: each query token attends to its sequence's K/V read in place
// from the block-paged cache (no gather copy). One task per (sequence, kv head, chunk of keys) on
// torch's intra-op thread pool, then a merge of the chunks (flash-decoding); the G query heads of a
// kv head share every K/V load. Per chunk: scores, exp with a vectorized exp, then the values.
// Built at first use by tokenmill/model/kernels.py; the caller is attention/cpu_paged.py.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <tuple>
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

// Turn one head's scores into softmax numerators in place (vectorized exp): returns their max and sum.
inline std::pair<float, float> softmax_numerators(float* s, int64_t L) {
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
  return {m, sum};
}

// Token t of a sequence, head h: where its D values start in a [num_blocks, BS, Hkv, D] cache.
template <typename T>
inline const T* token_row(const T* cache, const int64_t* table, int64_t t, int64_t BS, int64_t row, int64_t h,
                          int64_t D) {
  return cache + (table[t / BS] * BS + t % BS) * row + h * D;
}

// Flash-decoding: the keys of a sequence are cut into chunks of kChunk tokens, each chunk of each
// (sequence, kv head) is a task of its own, so one sequence keeps every thread busy; a second pass
// merges the chunks' partial softmax results. The cut depends on nothing but the sequence's length,
// so a row's result is the same whatever the batch and the thread count (batch invariance).
constexpr int64_t kChunk = 64;

struct Geometry {
  int64_t B, H, Hkv, D, BS, max_blocks, G, row;
  float scale;
};

// A task's partial result: acc[G][D] (unnormalized), then max[G], then sum[G].
inline int64_t partial_size(const Geometry& g) { return g.G * (g.D + 2); }

// Calls fn(task, b, h, t0, t1) for every chunk task, spread over the intra-op threads.
template <typename Fn>
void for_each_chunk(const Geometry& geo, const int64_t* seq_lens, const std::vector<int64_t>& starts, Fn&& fn) {
  at::parallel_for(0, starts.back(), 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = std::upper_bound(starts.begin(), starts.end(), task) - starts.begin() - 1;
      const int64_t nc = (seq_lens[b] + kChunk - 1) / kChunk, r = task - starts[b];
      const int64_t c = r % nc, t0 = c * kChunk;
      fn(task, b, r / nc, t0, std::min(seq_lens[b], t0 + kChunk));
    }
  });
}

// out[b, h*G+g] = sum_c w_c acc_c / sum_c w_c sum_c, w_c = exp(max_c - max): the chunks in order.
template <typename T>
void merge_chunks(T* out, const float* parts, const int64_t* seq_lens, const std::vector<int64_t>& starts,
                  const Geometry& geo) {
  const int64_t G = geo.G, D = geo.D, P = partial_size(geo);
  at::parallel_for(0, geo.B * geo.Hkv, 4, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(D);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / geo.Hkv, h = bh % geo.Hkv;
      const int64_t nc = (seq_lens[b] + kChunk - 1) / kChunk;
      const float* first = parts + (starts[b] + h * nc) * P;
      for (int64_t g = 0; g < G; ++g) {
        T* o = out + (b * geo.H + h * G + g) * D;
        float m = -INFINITY, l = 0.f;
        for (int64_t c = 0; c < nc; ++c) m = std::max(m, first[c * P + G * D + g]);
        std::fill(acc.begin(), acc.end(), 0.f);
        for (int64_t c = 0; c < nc; ++c) {
          const float* p = first + c * P;
          const float w = std::exp(p[G * D + g] - m);
          l += w * p[G * D + G + g];
          for (int64_t d = 0; d < D; d += kVec)
            at::vec::fmadd(fVec(w), fVec::loadu(p + g * D + d), fVec::loadu(acc.data() + d)).store(acc.data() + d);
        }
        const float inv = nc ? 1.f / l : 0.f;  // an empty sequence attends to nothing: zeros
        for (int64_t d = 0; d < D; ++d) o[d] = static_cast<T>(acc[d] * inv);
      }
    }
  });
}

// Keys [t0, t1) of sequence b, kv head h, for its G query heads, into the partial result `part`.
template <typename T>
void chunk_attention(float* part, const T* q, const T* k_cache, const T* v_cache, const int64_t* table, int64_t b,
                     int64_t h, int64_t t0, int64_t t1, const Geometry& geo, std::vector<float>& scratch) {
  const int64_t G = geo.G, D = geo.D, L = t1 - t0;
  scratch.resize(G * D + D + G * L);
  float *qf = scratch.data(), *kv = qf + G * D, *scores = kv + D, *acc = part;
  load_floats(q + (b * geo.H + h * G) * D, qf, G * D);
  for (int64_t i = 0; i < G * D; i += kVec) (fVec::loadu(qf + i) * fVec(geo.scale)).store(qf + i);
  for (int64_t t = 0; t < L; ++t) {  // scores = q . k
    load_floats(token_row(k_cache, table, t0 + t, geo.BS, geo.row, h, D), kv, D);
    for (int64_t g = 0; g < G; ++g) {
      fVec s(0.f);
      for (int64_t d = 0; d < D; d += kVec) s = at::vec::fmadd(fVec::loadu(qf + g * D + d), fVec::loadu(kv + d), s);
      scores[g * L + t] = at::vec::vec_reduce_all<float>([](fVec& a, fVec& c) { return a + c; }, s);
    }
  }
  for (int64_t g = 0; g < G; ++g) std::tie(part[G * D + g], part[G * D + G + g]) = softmax_numerators(scores + g * L, L);
  std::fill(acc, acc + G * D, 0.f);
  for (int64_t t = 0; t < L; ++t) {  // acc = numerators . v
    load_floats(token_row(v_cache, table, t0 + t, geo.BS, geo.row, h, D), kv, D);
    for (int64_t g = 0; g < G; ++g) {
      const fVec p(scores[g * L + t]);
      for (int64_t d = 0; d < D; d += kVec)
        at::vec::fmadd(p, fVec::loadu(kv + d), fVec::loadu(acc + g * D + d)).store(acc + g * D + d);
    }
  }
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

// chunk_attention's bf16 fast path for head_dim = 16 * NV (64 -> 4, 128 -> 8), up to 8 query heads per kv head.
template <int NV>
void chunk_attention_bf16(float* part, const at::BFloat16* q, const at::BFloat16* k_cache,
                          const at::BFloat16* v_cache, const int64_t* table, int64_t b, int64_t h, int64_t t0,
                          int64_t t1, const Geometry& geo, std::vector<float>& scratch) {
  constexpr int64_t D = 16 * NV;
  const int64_t G = geo.G, L = t1 - t0, BS = geo.BS, row = geo.row;
  const int64_t last_block = (t1 - 1) / BS;
  scratch.resize(G * L);
  float* scores = scratch.data();
  __m512 qv[8][NV];
  for (int64_t g = 0; g < G; ++g)
    for (int j = 0; j < NV; ++j)
      qv[g][j] = _mm512_mul_ps(bf16x16_to_f32(q + (b * geo.H + h * G + g) * D + 16 * j), _mm512_set1_ps(geo.scale));
  for (int64_t t = t0; t < t1; ++t) {
    if (t % BS == 0 && t / BS < last_block) prefetch_block(k_cache + table[t / BS + 1] * BS * row + h * D, BS, row, D * 2);
    const at::BFloat16* k = token_row(k_cache, table, t, BS, row, h, D);
    __m512 kv[NV];
    for (int j = 0; j < NV; ++j) kv[j] = bf16x16_to_f32(k + 16 * j);
    for (int64_t g = 0; g < G; ++g) {
      __m512 acc = _mm512_mul_ps(qv[g][0], kv[0]);
      for (int j = 1; j < NV; ++j) acc = _mm512_fmadd_ps(qv[g][j], kv[j], acc);
      scores[g * L + t - t0] = _mm512_reduce_add_ps(acc);
    }
  }
  for (int64_t g = 0; g < G; ++g) std::tie(part[G * D + g], part[G * D + G + g]) = softmax_numerators(scores + g * L, L);
  __m512 acc[8][NV];
  for (int64_t g = 0; g < G; ++g)
    for (int j = 0; j < NV; ++j) acc[g][j] = _mm512_setzero_ps();
  for (int64_t t = t0; t < t1; ++t) {
    if (t % BS == 0 && t / BS < last_block) prefetch_block(v_cache + table[t / BS + 1] * BS * row + h * D, BS, row, D * 2);
    const at::BFloat16* v = token_row(v_cache, table, t, BS, row, h, D);
    __m512 vv[NV];
    for (int j = 0; j < NV; ++j) vv[j] = bf16x16_to_f32(v + 16 * j);
    for (int64_t g = 0; g < G; ++g) {
      const __m512 p = _mm512_set1_ps(scores[g * L + t - t0]);
      for (int j = 0; j < NV; ++j) acc[g][j] = _mm512_fmadd_ps(p, vv[j], acc[g][j]);
    }
  }
  for (int64_t g = 0; g < G; ++g)
    for (int j = 0; j < NV; ++j) _mm512_storeu_ps(part + g * D + 16 * j, acc[g][j]);
}
#define TM_HAVE_AVX512_BF16_PATH 1
#endif

template <typename T, typename Chunk>
void decode_attention(T* out, const T* q, const T* k_cache, const T* v_cache, const int64_t* block_tables,
                      const int64_t* seq_lens, const Geometry& geo, Chunk&& chunk) {
  std::vector<int64_t> starts(geo.B + 1, 0);  // first task of each sequence
  for (int64_t b = 0; b < geo.B; ++b) starts[b + 1] = starts[b] + geo.Hkv * ((seq_lens[b] + kChunk - 1) / kChunk);
  std::vector<float> parts(starts.back() * partial_size(geo));
  for_each_chunk(geo, seq_lens, starts, [&](int64_t task, int64_t b, int64_t h, int64_t t0, int64_t t1) {
    thread_local std::vector<float> scratch;
    chunk(parts.data() + task * partial_size(geo), q, k_cache, v_cache, block_tables + b * geo.max_blocks, b, h, t0,
          t1, geo, scratch);
  });
  merge_chunks(out, parts.data(), seq_lens, starts, geo);
}

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
  TORCH_CHECK(H % Hkv == 0, "paged_decode_attention: query heads must be a multiple of kv heads");
  auto bt = block_tables.contiguous();
  auto sl = seq_lens.contiguous();
  const Geometry geo{B, H, Hkv, D, BS, bt.size(1), H / Hkv, Hkv * D, static_cast<float>(scale)};
  const int64_t* lens = sl.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b)
    TORCH_CHECK(lens[b] >= 0 && lens[b] <= geo.max_blocks * BS, "paged_decode_attention: sequence length ", lens[b],
                " does not fit its block table");
  auto run = [&](auto tag, auto&& chunk) {
    using T = decltype(tag);
    decode_attention<T>(out.data_ptr<T>(), q.data_ptr<T>(), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(),
                        bt.data_ptr<int64_t>(), lens, geo, chunk);
  };
  switch (q.scalar_type()) {
    case at::kFloat: run(float{}, chunk_attention<float>); break;
    case at::kBFloat16:
#ifdef TM_HAVE_AVX512_BF16_PATH
      if (D == 64 && geo.G <= 8) { run(at::BFloat16{}, chunk_attention_bf16<4>); break; }
      if (D == 128 && geo.G <= 8) { run(at::BFloat16{}, chunk_attention_bf16<8>); break; }
#endif
      run(at::BFloat16{}, chunk_attention<at::BFloat16>);
      break;
    case at::kHalf: run(at::Half{}, chunk_attention<at::Half>); break;
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

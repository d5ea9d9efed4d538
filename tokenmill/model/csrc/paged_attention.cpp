// Paged decode attention for CPU: each query token attends to its sequence's K/V read in place
// from the block-paged cache (no gather copy). The G query heads of a kv head share every K/V
// load. Two passes over the keys (scores, then exp with a vectorized exp) and one over the values.
// The generic path below: one task per (sequence, kv head) on torch's intra-op thread pool. The
// AVX-512 bf16 path (paged_attention_avx512.h) also splits each sequence's keys into chunks, and
// so does the fp32 one with AVX2 (paged_attention_avx2.h), which a build without AVX-512 also runs
// bf16 queries through, widened to fp32 (paged_attention_avx2_entry.h).
// A speculative verification (1 + k tokens of one sequence) arrives as consecutive rows over the
// same block table with lengths L, L + 1, ...: the bf16 path runs such a run of rows in the same
// tasks, which load each K/V row once for all of them; the fp32 AVX2 path takes each chunk of keys
// for the whole run, so it comes from memory once. Each row's arithmetic (its dot products, softmax
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

#include "paged_attention_shares.h"

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

// Softmax numerators of n scores in place (vectorized exp); returns their sum, their max in m (the
// portable kernel's; the AVX-512 one has softmax_weights). The max in a local, 16 lanes at a time:
// through the reference (which may alias s) it was a store and a dependent scalar max per score.
// A max does not depend on the order (a tie of +0 and -0 gives the same differences below).
inline float softmax_partial(float* s, int64_t n, float& m_out) {
  fVec vmax(-INFINITY);
  int64_t t = 0;
  for (; t + kVec <= n; t += kVec) vmax = at::vec::maximum(vmax, fVec::loadu(s + t));
  float m = at::vec::vec_reduce_all<float>([](fVec& a, fVec& c) { return at::vec::maximum(a, c); }, vmax);
  for (; t < n; ++t) m = std::max(m, s[t]);
  m_out = m;
  fVec vsum(0.f);
  for (t = 0; t + kVec <= n; t += kVec) {
    fVec e = (fVec::loadu(s + t) - fVec(m)).exp_u20();
    e.store(s + t);
    vsum = vsum + e;
  }
  float sum = at::vec::vec_reduce_all<float>([](fVec& a, fVec& c) { return a + c; }, vsum);
  for (; t < n; ++t) {
    s[t] = std::exp(s[t] - m);
    sum += s[t];
  }
  return sum;
}

// One head's scores into softmax numerators in place; returns 1 / their sum.
inline float softmax_numerators(float* s, int64_t L) {
  float m;
  return 1.f / softmax_partial(s, L, m);
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


}  // namespace tm_paged

#if defined(__AVX512F__) && defined(__AVX512BW__)
#include "paged_attention_avx512.h"
#include "paged_attention_tasks.h"
#define TM_HAVE_AVX512_BF16_PATH 1
#endif
#if defined(__AVX2__) && defined(__FMA__)
#include "paged_attention_avx2_entry.h"
#define TM_HAVE_AVX2_FP32_PATH 1
#endif

namespace tm_paged {

#ifdef TM_HAVE_AVX512_BF16_PATH
template <typename C>
void avx512_path(at::Tensor& out, const at::Tensor& q, const PagedKV<C>& kv, const at::Tensor& bt, const at::Tensor& sl,
                 int64_t Hkv, int64_t BS, float scale) {
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2);
  auto* o = out.data_ptr<at::BFloat16>();
  const auto* qp = q.data_ptr<at::BFloat16>();
  if (D == 64)
    decode_attention_avx512<4, C>(o, qp, kv, bt.data_ptr<int64_t>(), sl.data_ptr<int64_t>(), B, H, Hkv, BS, bt.size(1),
                                  scale);
  else
    decode_attention_avx512<8, C>(o, qp, kv, bt.data_ptr<int64_t>(), sl.data_ptr<int64_t>(), B, H, Hkv, BS, bt.size(1),
                                  scale);
}
#endif

// The AVX-512 path over an int8, fp8 e4m3 or fp8 e5m2 cache with per-token scales (quant_kv.cpp's layout):
// false when it does not apply (another ISA, fp32 queries, head_dim not 64 or 128), and the caller
// then runs quant_kv.cpp's portable kernel. fp32 queries take the AVX2 path where it applies, and so
// do bf16 ones, widened, in a build without AVX-512.
bool paged_decode_attention_scaled(at::Tensor out, const at::Tensor& q, const at::Tensor& k_data,
                                   const at::Tensor& v_data, const at::Tensor& k_scale, const at::Tensor& v_scale,
                                   const at::Tensor& block_tables, const at::Tensor& seq_lens, double scale) {
#ifdef TM_HAVE_AVX2_FP32_PATH
  if (avx2_scaled_path(out, q, k_data, v_data, k_scale, v_scale, block_tables, seq_lens, scale)) return true;
#ifndef TM_HAVE_AVX512_BF16_PATH
  if (q.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16 && q.is_contiguous() &&
      out.is_contiguous() && avx2_reads(q, k_data, k_scale.numel() > 0)) {  // checked before widening
    through_fp32(out, q, [&](at::Tensor& of, const at::Tensor& qf) {
      avx2_scaled_path(of, qf, k_data, v_data, k_scale, v_scale, block_tables, seq_lens, scale);
    });
    return true;
  }
#endif
#endif
#ifdef TM_HAVE_AVX512_BF16_PATH
  const int64_t D = q.size(2);
  if (q.scalar_type() != at::kBFloat16 || (D != 64 && D != 128) || k_scale.numel() == 0) return false;
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && k_data.is_contiguous() && v_data.is_contiguous() &&
                  k_scale.is_contiguous() && v_scale.is_contiguous(),
              "paged_decode_attention_scaled: tensors must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong,
              "paged_decode_attention_scaled: block tables and lengths must be int64");
  const int64_t BS = k_data.size(1), Hkv = k_data.size(2);
  auto bt = block_tables.contiguous();
  auto sl = seq_lens.contiguous();
  const float* ks = k_scale.data_ptr<float>();
  const float* vs = v_scale.data_ptr<float>();
  switch (k_data.scalar_type()) {
    case at::kChar:
      avx512_path(out, q, PagedKV<int8_t>{k_data.data_ptr<int8_t>(), v_data.data_ptr<int8_t>(), ks, vs}, bt, sl, Hkv,
                  BS, static_cast<float>(scale));
      return true;
    case at::kFloat8_e4m3fn:
      avx512_path(out, q,
                  PagedKV<c10::Float8_e4m3fn>{k_data.data_ptr<c10::Float8_e4m3fn>(),
                                              v_data.data_ptr<c10::Float8_e4m3fn>(), ks, vs},
                  bt, sl, Hkv, BS, static_cast<float>(scale));
      return true;
    case at::kFloat8_e5m2:
      avx512_path(out, q,
                  PagedKV<c10::Float8_e5m2>{k_data.data_ptr<c10::Float8_e5m2>(), v_data.data_ptr<c10::Float8_e5m2>(),
                                            ks, vs},
                  bt, sl, Hkv, BS, static_cast<float>(scale));
      return true;
    default:
      return false;
  }
#else
  return false;
#endif
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
  auto bt = block_tables.contiguous();
  auto sl = seq_lens.contiguous();
  auto run = [&](auto tag) {
    using T = decltype(tag);
    decode_attention<T>(out.data_ptr<T>(), q.data_ptr<T>(), k_cache.data_ptr<T>(), v_cache.data_ptr<T>(),
                        bt.data_ptr<int64_t>(), sl.data_ptr<int64_t>(), B, H, Hkv, D, BS, bt.size(1),
                        static_cast<float>(scale));
  };
  switch (q.scalar_type()) {
    case at::kFloat:
#ifdef TM_HAVE_AVX2_FP32_PATH
      decode_attention_avx2(out.data_ptr<float>(), q.data_ptr<float>(), k_cache.data_ptr<float>(),
                            v_cache.data_ptr<float>(), bt.data_ptr<int64_t>(), sl.data_ptr<int64_t>(), B, H, Hkv, D, BS,
                            bt.size(1), static_cast<float>(scale));
#else
      run(float{});
#endif
      break;
    case at::kBFloat16:
#ifdef TM_HAVE_AVX512_BF16_PATH
      if (D == 64 || D == 128) {
        const PagedKV<at::BFloat16> kv{k_cache.data_ptr<at::BFloat16>(), v_cache.data_ptr<at::BFloat16>(), nullptr,
                                       nullptr};
        avx512_path(out, q, kv, bt, sl, Hkv, BS, static_cast<float>(scale));
        break;
      }
      run(at::BFloat16{});
#elif defined(TM_HAVE_AVX2_FP32_PATH)
      through_fp32(out, q, [&](at::Tensor& of, const at::Tensor& qf) {
        decode_attention_avx2(of.data_ptr<float>(), qf.data_ptr<float>(), k_cache.data_ptr<at::BFloat16>(),
                              v_cache.data_ptr<at::BFloat16>(), bt.data_ptr<int64_t>(), sl.data_ptr<int64_t>(), B, H,
                              Hkv, D, BS, bt.size(1), static_cast<float>(scale));
      });
#else
      run(at::BFloat16{});
#endif
      break;
    case at::kHalf: run(at::Half{}); break;
    default: TORCH_CHECK(false, "paged_decode_attention: unsupported dtype ", q.scalar_type());
  }
}

}  // namespace tm_paged

TORCH_LIBRARY(tokenmill, m) {
  m.def("paged_decode_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, "
        "Tensor seq_lens, float scale) -> ()");
  m.def("paged_decode_attention_scaled(Tensor(a!) out, Tensor q, Tensor k_data, Tensor v_data, Tensor k_scale, "
        "Tensor v_scale, Tensor block_tables, Tensor seq_lens, float scale) -> bool");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("paged_decode_attention", &tm_paged::paged_decode_attention);
  m.impl("paged_decode_attention_scaled", &tm_paged::paged_decode_attention_scaled);
}

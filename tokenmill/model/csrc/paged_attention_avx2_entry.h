// The AVX2 path's entry points besides fp32 queries over an fp32 cache (included by
// paged_attention.cpp where AVX2 and FMA are built): fp32 queries over an int8 or bf16 cache, and
// bf16 queries by way of fp32.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>

#include "paged_attention_avx2.h"

namespace tm_paged {

// Whether the AVX2 path reads this cache for such queries: int8 with scales or bf16 without, heads of
// a multiple of 32 dims.
inline bool avx2_reads(const at::Tensor& q, const at::Tensor& k_data, bool scaled) {
  const auto cache = k_data.scalar_type();
  return q.size(2) % 32 == 0 && ((cache == at::kChar && scaled) || (cache == at::kBFloat16 && !scaled));
}

// fp32 queries over an int8 cache with scales, or a bf16 one without: the AVX2 fp32 path, its rows
// widened as they load. false where it does not apply (fp8 caches, bf16 queries).
inline bool avx2_scaled_path(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_data, const at::Tensor& v_data,
                             const at::Tensor& k_scale, const at::Tensor& v_scale, const at::Tensor& block_tables,
                             const at::Tensor& seq_lens, double scale) {
  const bool scaled = k_scale.numel() > 0;
  if (q.scalar_type() != at::kFloat || !avx2_reads(q, k_data, scaled)) return false;
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && k_data.is_contiguous() && v_data.is_contiguous() &&
                  k_scale.is_contiguous() && v_scale.is_contiguous() && out.scalar_type() == at::kFloat,
              "paged_decode_attention_scaled: tensors must be contiguous");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong,
              "paged_decode_attention_scaled: block tables and lengths must be int64");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), BS = k_data.size(1), Hkv = k_data.size(2);
  auto bt = block_tables.contiguous();
  auto sl = seq_lens.contiguous();
  auto run = [&](auto tag, const float* ks, const float* vs) {
    using C = decltype(tag);
    decode_attention_avx2<C>(out.data_ptr<float>(), q.data_ptr<float>(), k_data.data_ptr<C>(), v_data.data_ptr<C>(),
                             bt.data_ptr<int64_t>(), sl.data_ptr<int64_t>(), B, H, Hkv, D, BS, bt.size(1),
                             static_cast<float>(scale), ks, vs);
  };
  if (scaled) run(int8_t{}, k_scale.data_ptr<float>(), v_scale.data_ptr<float>());
  else run(at::BFloat16{}, nullptr, nullptr);
  return true;
}

// bf16 queries on a build without the AVX-512 path (an AVX2 CPU running bf16): widened to fp32
// (exactly) for the AVX2 path, and its fp32 rows rounded to bf16 once. The portable kernel they took
// before ran 2.6-5.8x slower a call (BENCHMARKS.md).
template <typename F>
inline void through_fp32(at::Tensor& out, const at::Tensor& q, F&& fp32_path) {
  at::Tensor qf = q.to(at::kFloat), of = at::empty_like(qf);
  fp32_path(of, qf);
  out.copy_(of);
}

}  // namespace tm_paged

// Each row's first maximum of fp32 logits, as torch.argmax gives it (a NaN counts as the largest, the
// first of equals wins): the sampler's greedy rows. It runs right after the LM head, whose weights
// have just streamed through the caches, so every op there starts cold: one op instead of
// first_argmax's eight (sampler.py), with the same chunked search. The draft model's pick adds the
// probability of that maximum (argmax_prob_rows).
// Compiled into the kernels library as one unit with paged_attention.cpp (kernels.py).
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <tuple>

namespace tm_sampling {  // named: the library compiles as one unit (kernels.py)

using fVec = at::vec::Vectorized<float>;
constexpr int64_t kVec = fVec::size();

constexpr int64_t kBlock = 2048;  // 8 KiB: the block found holding the maximum is searched again in L1

// The largest of n floats, NaN if any is NaN.
inline float block_max(const float* p, int64_t n) {
  fVec vmax(-INFINITY);
  int64_t i = 0;
  for (; i + kVec <= n; i += kVec) vmax = at::vec::maximum(vmax, fVec::loadu(p + i));  // keeps a NaN
  float m = at::vec::vec_reduce_all<float>([](fVec& a, fVec& b) { return at::vec::maximum(a, b); }, vmax);
  for (; i < n; ++i)
    if (std::isnan(p[i]) || p[i] > m) m = p[i];
  return m;
}

// One pass over the row block by block, keeping the first block with the largest maximum (or the
// first with a NaN), then the first index of that value inside it.
inline int64_t row_argmax(const float* p, int64_t n) {
  int64_t best = 0;
  float m = -INFINITY;
  for (int64_t b = 0; b < n; b += kBlock) {
    const float bm = block_max(p + b, std::min(kBlock, n - b));
    if (std::isnan(bm) || bm > m) {
      m = bm;
      best = b;
      if (std::isnan(bm)) break;
    }
  }
  const int64_t end = std::min(best + kBlock, n);
  int64_t i = best;
  if (!std::isnan(m)) {
    const fVec target(m);
    for (; i + kVec <= end; i += kVec) {
      // zero_mask: a bit per lane that compares false, i.e. is not the maximum
      const int misses = (fVec::loadu(p + i) == target).zero_mask();
      if (misses != (1 << kVec) - 1) return i + __builtin_ctz(~misses);
    }
  }
  for (; i < end; ++i)
    if (std::isnan(m) ? std::isnan(p[i]) : p[i] == m) return i;
  return 0;  // an empty row
}

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "argmax_rows: a [rows, width] float tensor with contiguous rows");
  const int64_t rows = x.size(0), width = x.size(1), ld = x.stride(0);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* p = x.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) o[r] = row_argmax(p + r * ld, width);
  });
  return out;
}

// Each row's first maximum and the softmax probability it has, 1 / sum(exp(x - max)): the draft
// model's pick and its confidence (draft_model.py) in one op, where max(dim) and logsumexp were
// two passes and ~0.25 ms on a 32k-token row. A NaN row has a NaN probability.
std::tuple<at::Tensor, at::Tensor> argmax_prob_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.stride(1) == 1,
              "argmax_prob_rows: a [rows, width] float tensor with contiguous rows");
  const int64_t rows = x.size(0), width = x.size(1), ld = x.stride(0);
  at::Tensor idx = at::empty({rows}, x.options().dtype(at::kLong));
  at::Tensor prob = at::empty({rows}, x.options());
  const float* p = x.data_ptr<float>();
  int64_t* o = idx.data_ptr<int64_t>();
  float* pr = prob.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t b, int64_t e) {
    for (int64_t r = b; r < e; ++r) {
      const float* row = p + r * ld;
      o[r] = row_argmax(row, width);
      const float m = width ? row[o[r]] : NAN;
      const fVec vm(m);
      fVec acc(0.f);
      int64_t i = 0;
      for (; i + kVec <= width; i += kVec) acc = acc + (fVec::loadu(row + i) - vm).exp();
      float sum = at::vec::vec_reduce_all<float>([](fVec& a, fVec& c) { return a + c; }, acc);
      for (; i < width; ++i) sum += std::exp(row[i] - m);
      pr[r] = 1.f / sum;
    }
  });
  return {idx, prob};
}

}  // namespace tm_sampling

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.def("argmax_prob_rows(Tensor x) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("argmax_rows", &tm_sampling::argmax_rows);
  m.impl("argmax_prob_rows", &tm_sampling::argmax_prob_rows);
}

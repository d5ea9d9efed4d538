// Outlier channels of 8-bit activation codes (act_bits.py). A few input columns of a layer carry
// values 10-40x a row's RMS (the same columns for every token); each spreads its block's scale so that
// the other 31 values of the block lose most of their bits. Those columns are left out of the codes
// (zeroed before a row is quantized) and added back exactly: out[m, j] += x[m, c] * W[j, c] in fp32,
// from W's columns dequantized once at load, before the bias. Per output element this is the same
// arithmetic whatever the rows of the call, so a row's result does not depend on its batch.
#pragma once

#include <ATen/core/Tensor.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <vector>

namespace TM_QUANT_NS {

struct Outliers {
  int64_t n = 0;                 // 0: none
  const int64_t* cols = nullptr;
  const float* w = nullptr;      // [n, ldw]: w[c, j] = W[j, cols[c]], zero past the output rows
  int64_t ldw = 0;               // at least N + 16: a 16-wide item at the last column stays inside
  std::vector<float> xc;         // [M, n]: the rows' values in those columns

  // qlinear's optional arguments for a product of N outputs over K inputs
  static Outliers from(const std::optional<at::Tensor>& cols, const std::optional<at::Tensor>& w, int64_t N,
                       int64_t K) {
    Outliers ol;
    if (!cols || !cols->numel()) return ol;
    TORCH_CHECK(w && cols->scalar_type() == at::kLong && cols->dim() == 1 && cols->is_contiguous() &&
                    w->scalar_type() == at::kFloat && w->dim() == 2 && w->is_contiguous() &&
                    w->size(0) == cols->numel() && w->size(1) >= N + 16,
                "qlinear: outlier_cols must be int64 [n] and outlier_w float [n, >= N + 16]");
    ol.n = cols->numel(), ol.cols = cols->data_ptr<int64_t>(), ol.w = w->data_ptr<float>(), ol.ldw = w->size(1);
    for (int64_t i = 0; i < ol.n; ++i)
      TORCH_CHECK(ol.cols[i] >= 0 && ol.cols[i] < K, "qlinear: outlier column ", ol.cols[i], " out of range");
    return ol;
  }

  template <typename TX>
  void gather(const TX* x, int64_t M, int64_t K) {
    xc.resize(M * n);
    for (int64_t m = 0; m < M; ++m)
      for (int64_t c = 0; c < n; ++c) xc[m * n + c] = static_cast<float>(x[m * K + cols[c]]);
  }

  // Row m of x with the columns zeroed, in buf (K values), or the row itself when there are none.
  template <typename TX>
  const TX* row_without(const TX* row, int64_t K, std::vector<TX>& buf) const {
    if (!n) return row;
    buf.assign(row, row + K);
    for (int64_t c = 0; c < n; ++c) buf[cols[c]] = TX(0.f);
    return buf.data();
  }

  // res[0, width) of activation row m, output rows col, col + 1, ...: one FMA chain per lane, the
  // columns in order (as plain loops, ~3x the cost: they were not vectorized)
  template <int width>
  inline void add(float* res, int64_t m, int64_t col) const {
    const float* xm = xc.data() + m * n;
    const float* wc = w + col;
#if defined(__AVX512F__)
    if constexpr (width == 16) {
      __m512 acc = _mm512_loadu_ps(res);
      for (int64_t c = 0; c < n; ++c) acc = _mm512_fmadd_ps(_mm512_set1_ps(xm[c]), _mm512_loadu_ps(wc + c * ldw), acc);
      _mm512_storeu_ps(res, acc);
      return;
    }
#endif
#if defined(__AVX2__) && defined(__FMA__)
    for (int h = 0; h < width; h += 8) {
      __m256 acc = _mm256_loadu_ps(res + h);
      for (int64_t c = 0; c < n; ++c)
        acc = _mm256_fmadd_ps(_mm256_set1_ps(xm[c]), _mm256_loadu_ps(wc + c * ldw + h), acc);
      _mm256_storeu_ps(res + h, acc);
    }
#else
    for (int r = 0; r < width; ++r)
      for (int64_t c = 0; c < n; ++c) res[r] = std::fma(xm[c], wc[c * ldw + r], res[r]);
#endif
  }
};

}  // namespace TM_QUANT_NS

// Matrix products with quantized weights that stay packed (GGUF blocks, tokenmill's int8/int4):
//   repack:    GGUF rows -> the x8 layout (quant_x8.h), once at load; same size.
//   qlinear:   out[M, N] = x[M, K] . W^T (+ bias), W given as one or more row shards of any format
//              (a merged qkv whose q/k are Q4_K and v is Q6_K is one call, one thread fork).
//   dequantize / embedding: rows of W as floats (tests, the many-row path, token embeddings).
// Few rows (decode, verification): activations are quantized to int8 per 32 (scale dx; quant_act.h),
// and each chunk of 8 rows x 32 weights is integer dot products (VNNI vpdpbusd, or vpmaddubsw +
// vpmaddwd) whose lanes are output rows, so the weights are read once per call, as packed as they
// are stored, with no horizontal sums. Each decoded chunk serves several activation rows: up to 8
// (4 with 16-bit codes) in quant_x8_dot.h (AVX2, scalar; quant_gemm_x8sb.cpp for Q4_K and Q5_K
// with 8-bit codes), up to 8 with 16 output rows per zmm with AVX-512 (quant_pairs.h:
// quant_gemm_rows.cpp, or quant_gemm_sb.cpp for K-quants with 8-bit codes).
// Many rows (prefill, big batches): the same packed kernel, with activation rows blocked to fit
// L2, or, where the ISA's measured crossover says so (packed.py's DENSE_MIN_ROWS: AVX2, AMX),
// dequantize a slab of W to the activation dtype and hand it to the dense GEMM (oneDNN).
// Compiled once per ISA variant (quant_kernels.py): the SIMD paths below follow the flags.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <utility>
#include <vector>

#include "quant_dequant.h"
#include "quant_pairs.h"

namespace {

using namespace tmq;
using namespace TM_QUANT_NS;

std::vector<Shard> make_shards(const std::vector<at::Tensor>& weights, at::IntArrayRef qtypes,
                               at::IntArrayRef rows, int64_t K) {
  TORCH_CHECK(weights.size() == qtypes.size() && weights.size() == rows.size(), "qlinear: shard lists differ in length");
  std::vector<Shard> shards;
  int64_t first = 0;
  for (size_t i = 0; i < weights.size(); ++i) {
    const int qt = static_cast<int>(qtypes[i]);
    const X8Geom g = x8_geom(qt);
    TORCH_CHECK(g.qk > 0, "quantized weight: unsupported type ", qt);
    TORCH_CHECK(K % g.qk == 0, "quantized weight: K=", K, " is not a multiple of the block size ", g.qk);
    const int64_t gb = x8_group_bytes(qt, K);
    const auto& w = weights[i];
    TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() && w.numel() == (rows[i] + 7) / 8 * gb,
                "quantized weight: expected ", (rows[i] + 7) / 8, " groups of ", gb, " bytes for type ", qt);
    shards.push_back({w.data_ptr<uint8_t>(), qt, rows[i], gb, first});
    first += rows[i];
  }
  return shards;
}

constexpr int kMaxRows = 8;  // group_dot_rows' largest pass
// Activation rows a thread keeps in L2 (a quarter of a Zen 3's 512 KiB: one thread at 2048 rows of
// K = 8960 measured 37-38 G/s unblocked, 60-61 with 128 KiB, 46-50 with 256, 47-56 with 512).
constexpr int64_t kRowBlockBytes = 128 << 10;

template <typename TX, typename TO>
void qgemm_native(const TX* x, int64_t M, int64_t K, const std::vector<Shard>& shards, TO* out, int64_t ldo,
                  const float* bias, bool fine, Outliers& ol) {
  // 8-bit codes for K-quants only: power-of-two chunk scales within each super-block (quant_act.h;
  // every ISA path multiplies the same codes; AVX-512, and AVX2 for Q4_K / Q5_K, apply the sub-block
  // scales in integers)
  const bool sb = !fine && std::all_of(shards.begin(), shards.end(), [](const Shard& s) { return sb_type(s.qtype); });
  const bool q16 = act_q16(
      fine, std::any_of(shards.begin(), shards.end(), [](const Shard& s) { return x8_signed(s.qtype); }));
  const int64_t arb = act_row_bytes(K, q16);
  // not zeroed: quantize_row writes every byte a kernel reads (zeroing cost as much as a few rows' codes)
  std::unique_ptr<uint8_t[]> act(new uint8_t[M * arb + 64]);
  uint8_t* abase = act.get() + (64 - reinterpret_cast<uintptr_t>(act.get()) % 64) % 64;
  // row by row on both threads from two rows: a long row (K = 8960) takes ~10 us
  if (ol.n) ol.gather(x, M, K);
  at::parallel_for(0, M, 1, [&](int64_t b, int64_t e) {
    std::vector<TX> buf;
    for (int64_t m = b; m < e; ++m) quantize_row(ol.row_without(x + m * K, K, buf), K, abase + m * arb, fine, sb, q16);
  });
  std::vector<ActRow> rows(M);
  for (int64_t m = 0; m < M; ++m) rows[m] = act_row(abase + m * arb, K, q16);
  if constexpr (kZmm) return qgemm_pairs(rows.data(), M, K, shards, out, ldo, bias, fine, sb, ol);
  // Rows in passes of up to 8 over each decoded chunk (4 with 16-bit codes, whose two sums a row
  // would spill), as even as they go: a pass of one row ran at ~60% of the rate of a pass of four
  // (5 rows as 4 + 1 cost 1.4x 4 rows; as one pass, 1.1x).
  // Rows also in blocks that stay in L2 while a thread's groups run over them: without blocks each
  // group streamed every row's codes (9 MB at 2048 rows of K = 4096), and the kernel ran at half its
  // rate.
  const int64_t max_rows = fine ? 4 : kMaxRows;
  const int64_t row_bytes = (fine ? 2 : 1) * K + (q16 ? 2 * K : 0) + K / 4;  // what the kernels read of a row
  const int64_t fit = std::max<int64_t>(max_rows, kRowBlockBytes / row_bytes / max_rows * max_rows);
  std::vector<std::pair<int64_t, int>> passes;  // (first row, rows)
  std::vector<size_t> row_blocks{0};  // the first pass of each block, then passes.size()
  const int64_t nblocks = (M + fit - 1) / fit;  // as even as they go too (66 rows of 64: 33 + 33)
  for (int64_t blk = 0, r0 = 0; blk < nblocks; ++blk) {
    const int64_t n = M / nblocks + (blk < M % nblocks), np = (n + max_rows - 1) / max_rows;
    for (int64_t p = 0, m0 = r0; p < np; ++p) {
      const int mr = static_cast<int>(n / np + (p < n % np));
      passes.emplace_back(m0, mr);
      m0 += mr;
    }
    r0 += n;
    row_blocks.push_back(passes.size());
  }
  // work items: groups of 8 rows over all shards
  std::vector<int64_t> starts{0};
  for (const Shard& s : shards) starts.push_back(starts.back() + (s.rows + 7) / 8);
  // With several passes and short rows, a pass's rows meet a block of groups before the next pass:
  // its codes (8 x K bytes) stay in L1 and the block's weights in L2, where each group had read every
  // pass's codes from L2 again (5-9% of the kernel's rate at K = 1536). Longer rows fit no L1.
  const int64_t block = passes.size() > 1 && kMaxRows * K <= 16384 ? 8 : 1;
  at::parallel_for(0, starts.back(), 4, [&](int64_t b, int64_t e) {
    StreamPrefetch stream;  // the first pass reads the weights from memory; later ones from cache
    for (size_t rb = 0; rb + 1 < row_blocks.size(); ++rb)
    for (int64_t b0 = b; b0 < e; b0 += block) {
      const int64_t b1 = std::min(e, b0 + block);
      for (size_t pass = row_blocks[rb]; pass < row_blocks[rb + 1]; ++pass) {
        const auto [m0, mr] = passes[pass];
        StreamPrefetch* pf = rb == 0 && pass == 0 && g_prefetch_ahead ? &stream : nullptr;
        size_t si = 0;
        for (int64_t item = b0; item < b1; ++item) {
          while (item >= starts[si + 1]) ++si;
          const Shard& sh = shards[si];
          const int64_t gi = item - starts[si];
          const uint8_t* group = sh.w + gi * sh.gb;
          const int nr = static_cast<int>(std::min<int64_t>(8, sh.rows - gi * 8));
          float res[kMaxRows][8];
          if (pf) pf->start(group, sh.gb);
          if (!sb || !group_dot_rows_sb(sh.qtype, group, K, &rows[m0], mr, res, pf))
            group_dot_rows(sh.qtype, group, K, &rows[m0], mr, fine, res, pf);
          const int64_t col = sh.first + gi * 8;
          for (int64_t m = 0; m < mr; ++m) {
            if (ol.n) ol.add<8>(res[m], m0 + m, col);
            for (int r = 0; r < nr; ++r)
              out[(m0 + m) * ldo + col + r] = static_cast<TO>(res[m][r] + (bias ? bias[col + r] : 0.f));
          }
        }
      }
    }
  });
}

template <typename T>
void dequant_shard(const Shard& sh, int64_t K, int64_t r0, int64_t r1, T* dst) {
  at::parallel_for(r0 / 8, (r1 + 7) / 8, 4, [&](int64_t b, int64_t e) {
    const int64_t lo = std::max(r0, b * 8), hi = std::min(r1, e * 8);
    dequant_rows<T>(sh.w, sh.qtype, K, lo, hi, dst + (lo - r0) * K);
  });
}

// out: [M, N] (float, or x's dtype); x: [M, K] float or bf16. With M >= dense_min_rows > 0, W is
// dequantized slab by slab and multiplied by the dense GEMM instead of the packed kernel.
void qlinear(at::Tensor out, const at::Tensor& x, std::vector<at::Tensor> weights, at::IntArrayRef qtypes,
             at::IntArrayRef rows, const std::optional<at::Tensor>& bias, int64_t dense_min_rows, int64_t act_bits,
             const std::optional<at::Tensor>& outlier_cols, const std::optional<at::Tensor>& outlier_w) {
  TORCH_CHECK(act_bits == 8 || act_bits == 16, "qlinear: act_bits must be 8 or 16");
  const bool fine = act_bits == 16;
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && out.dim() == 2 && out.is_contiguous(), "qlinear: layout");
  const int64_t M = x.size(0), K = x.size(1);
  const auto shards = make_shards(weights, qtypes, rows, K);
  const int64_t N = shards.back().first + shards.back().rows;
  TORCH_CHECK(out.size(0) == M && out.size(1) == N, "qlinear: out must be [", M, ", ", N, "]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "qlinear: x must be float or bf16");
  if (M == 0) return;
  if (dense_min_rows > 0 && M >= dense_min_rows) {
    // slabs of ~4 MiB of dense weights (a multiple of 8 rows), reused by every row of x
    const int64_t slab = std::max<int64_t>(64, (4 << 20) / (K * x.element_size())) / 8 * 8;
    at::Tensor buf = at::empty({std::min(slab, N + 8), K}, x.options());
    for (const Shard& sh : shards) {
      for (int64_t r0 = 0; r0 < sh.rows; r0 += slab) {
        const int64_t r1 = std::min(sh.rows, r0 + slab);
        at::Tensor wd = buf.narrow(0, 0, r1 - r0);
        if (x.scalar_type() == at::kFloat) dequant_shard(sh, K, r0, r1, wd.data_ptr<float>());
        else dequant_shard(sh, K, r0, r1, wd.data_ptr<at::BFloat16>());
        out.narrow(1, sh.first + r0, r1 - r0).copy_(at::linear(x, wd));
      }
    }
    if (bias) out.add_(*bias);
    return;
  }
  at::Tensor bias_f;
  if (bias) {
    TORCH_CHECK(bias->numel() == N, "qlinear: bias must have ", N, " elements");
    bias_f = bias->to(at::kFloat).contiguous();
  }
  const float* bp = bias ? bias_f.data_ptr<float>() : nullptr;
  Outliers ol = fine ? Outliers{} : Outliers::from(outlier_cols, outlier_w, N, K);  // 16-bit codes: exact already
  auto run = [&](auto xtag) {
    using TX = decltype(xtag);
    switch (out.scalar_type()) {
      case at::kFloat: qgemm_native(x.data_ptr<TX>(), M, K, shards, out.data_ptr<float>(), N, bp, fine, ol); break;
      case at::kBFloat16: qgemm_native(x.data_ptr<TX>(), M, K, shards, out.data_ptr<at::BFloat16>(), N, bp, fine, ol); break;
      default: TORCH_CHECK(false, "qlinear: out must be float or bf16");
    }
  };
  if (x.scalar_type() == at::kFloat) run(float{});
  else run(at::BFloat16{});
}

// Bytes of N rows in the x8 layout (whole groups of 8)
int64_t x8_bytes(int64_t qtype, int64_t N, int64_t K) {
  return (N + 7) / 8 * x8_group_bytes(static_cast<int>(qtype), K);
}

// GGUF rows [N, rb] -> x8 groups, into `out` (x8_bytes of them): the loader writes each shard
// straight from the mapped file into the weight it ends in.
void repack_into(at::Tensor out, const at::Tensor& w, int64_t qtype, int64_t N, int64_t K) {
  const int qt = static_cast<int>(qtype);
  const X8Geom g = x8_geom(qt);
  TORCH_CHECK(g.qk > 0 && K % g.qk == 0, "repack: unsupported type ", qt, " or K=", K);
  const int64_t rb = row_bytes(qt, K);
  TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() && w.numel() == N * rb, "repack: expected ", N,
              " rows of ", rb, " bytes");
  const int64_t groups = (N + 7) / 8;
  TORCH_CHECK(out.scalar_type() == at::kByte && out.is_contiguous() && out.numel() == x8_bytes(qt, N, K),
              "repack: the output needs ", x8_bytes(qt, N, K), " bytes");
  const uint8_t* src = w.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  at::parallel_for(0, groups, 1, [&](int64_t b, int64_t e) {
    dispatch_format(qt, [&](auto fmt) {
      for (int64_t gi = b; gi < e; ++gi) x8_repack_group<decltype(fmt)>(src, rb, N, K, qt, gi, dst);
    });
  });
}

at::Tensor repack(const at::Tensor& w, int64_t qtype, int64_t N, int64_t K) {
  at::Tensor out = at::empty({x8_bytes(qtype, N, K)}, w.options());
  repack_into(out, w, qtype, N, K);
  return out;
}

// [rows, K] dequantized (dtype of out)
void dequantize(at::Tensor out, const at::Tensor& w, int64_t qtype, int64_t K) {
  const int64_t rows = out.size(0);
  const auto shards = make_shards({w}, {qtype}, {rows}, K);
  TORCH_CHECK(out.is_contiguous() && out.size(1) == K, "dequantize: out must be [rows, K] contiguous");
  if (out.scalar_type() == at::kFloat) dequant_shard(shards[0], K, 0, rows, out.data_ptr<float>());
  else if (out.scalar_type() == at::kBFloat16) dequant_shard(shards[0], K, 0, rows, out.data_ptr<at::BFloat16>());
  else TORCH_CHECK(false, "dequantize: out must be float or bf16");
}

// out[t] = row ids[t] of W (vocab rows), dequantized
void embedding(at::Tensor out, const at::Tensor& ids, const at::Tensor& w, int64_t qtype, int64_t K) {
  TORCH_CHECK(ids.scalar_type() == at::kLong && out.is_contiguous() && out.size(1) == K, "embedding: layout");
  const int64_t gb = x8_group_bytes(static_cast<int>(qtype), K);
  TORCH_CHECK(gb > 0 && w.numel() % gb == 0, "embedding: unsupported type or size");
  const int64_t vocab = w.numel() / gb * 8, T_ = ids.numel();
  auto idc = ids.contiguous();
  const int64_t* id = idc.data_ptr<int64_t>();
  for (int64_t t = 0; t < T_; ++t) TORCH_CHECK(id[t] >= 0 && id[t] < vocab, "embedding: token id ", id[t], " out of range");
  const uint8_t* wp = w.data_ptr<uint8_t>();
  at::parallel_for(0, T_, 16, [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      if (out.scalar_type() == at::kFloat) dequant_rows<float>(wp, qtype, K, id[t], id[t] + 1, out.data_ptr<float>() + t * K);
      else dequant_rows<at::BFloat16>(wp, qtype, K, id[t], id[t] + 1, out.data_ptr<at::BFloat16>() + t * K);
    }
  });
}

// Which ISA this variant was compiled for (tests check the dispatch).
std::string variant() {
#if defined(__AVX512VNNI__)
  return "avx512_vnni";
#elif defined(__AVX512F__)
  return "avx512";
#elif defined(__AVX2__)
  return "avx2";
#else
  return "scalar";
#endif
}

}  // namespace

#define TM_LIBRARY(ns, m) TORCH_LIBRARY(ns, m)
#define TM_LIBRARY_IMPL(ns, k, m) TORCH_LIBRARY_IMPL(ns, k, m)

TM_LIBRARY(TM_QUANT_NS, m) {
  m.def("qlinear(Tensor(a!) out, Tensor x, Tensor[] weights, int[] qtypes, int[] rows, Tensor? bias, "
        "int dense_min_rows, int act_bits=8, Tensor? outlier_cols=None, Tensor? outlier_w=None) -> ()");
  m.def("repack(Tensor w, int qtype, int N, int K) -> Tensor");
  m.def("repack_into(Tensor(a!) out, Tensor w, int qtype, int N, int K) -> ()");
  m.def("x8_bytes(int qtype, int N, int K) -> int", &x8_bytes);
  m.def("dequantize(Tensor(a!) out, Tensor w, int qtype, int K) -> ()");
  m.def("embedding(Tensor(a!) out, Tensor ids, Tensor w, int qtype, int K) -> ()");
  m.def("variant() -> str", &variant);
  m.def("set_prefetch_ahead(int bytes, int level=1) -> ()", &set_prefetch_ahead);
}

TM_LIBRARY_IMPL(TM_QUANT_NS, CPU, m) {
  m.impl("qlinear", &qlinear);
  m.impl("repack", &repack);
  m.impl("repack_into", &repack_into);
  m.impl("dequantize", &dequantize);
  m.impl("embedding", &embedding);
}

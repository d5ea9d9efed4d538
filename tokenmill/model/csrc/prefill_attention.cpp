// Causal attention of a prompt chunk in fp32 with AVX2 + FMA, flash-attention style: the chunk's
// q_len rows are the last positions of a sequence of ctx_len keys in the paged cache (a fresh prompt
// has q_len == ctx_len; a chunk after cached context or a prefix-cache hit has fewer). SDPA's CPU
// flash attention ran SmolLM2's prompts at ~20-24 G multiply-adds/s on an AVX2 EPYC, the decode
// kernel (one row at a time, paged_attention.cpp) at ~30; blocked as a GEMM this runs at twice that.
// - The keys are packed once per call: K transposed in steps of 32 keys ([D][32], the keys in the
//   lanes, so a score needs no horizontal sum) and V as rows, both out of the block-paged cache.
// - A task is (kv head, tile of query rows): its G query heads of those rows are the query vectors,
//   3 at a time in one micro-kernel (micro_gemm) with 12 accumulators: 3 vectors x 32 keys for the
//   scores, 3 x 32 dims for the values (each K or V vector loaded once for 3 vectors, each broadcast
//   used 4 times; 6 x 16 ran ~10% slower, its broadcasts twice as many).
// - An online softmax over steps of 32 keys, as in FlashAttention-2: each row's running maximum
//   and sum rescale its output when the maximum rises.
// Its rounding differs from SDPA's as SDPA's does from the decode kernel's (fp32; tests/test_prefill_attention.py).
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define TM_HAVE_PREFILL_AVX2 1
#endif

namespace tm_prefill {  // named: the library compiles as one unit (kernels.py)

#ifdef TM_HAVE_PREFILL_AVX2
constexpr int64_t kStep = 32;   // keys of an online-softmax step (one packed K tile)
constexpr int kMR = 3;          // query vectors of a micro-kernel
constexpr int64_t kVectors = 36;  // query vectors of a task (rows x G), about

// c[m][0..31] (+)= sum_j a[m lda + j] b[j ldb + 0..31], m < MR: each b vector loaded once for MR
// rows, each broadcast of a used four times. The scores (a: queries, b: a step's K packed [D][32])
// and the weighted values (a: numerators, b: V rows from dimension d0).
template <int MR, bool kAccumulate>
__attribute__((always_inline)) inline void micro_gemm(const float* a, int64_t lda, const float* b, int64_t ldb,
                                                      int64_t n, float* c, int64_t ldc) {
  __m256 acc[MR][4];
#pragma GCC unroll 4
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) acc[m][v] = kAccumulate ? _mm256_loadu_ps(c + m * ldc + 8 * v) : _mm256_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    __m256 bv[4];
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) bv[v] = _mm256_loadu_ps(b + j * ldb + 8 * v);
#pragma GCC unroll 4
    for (int m = 0; m < MR; ++m) {
      const __m256 am = _mm256_broadcast_ss(a + m * lda + j);
#pragma GCC unroll 4
      for (int v = 0; v < 4; ++v) acc[m][v] = _mm256_fmadd_ps(am, bv[v], acc[m][v]);
    }
  }
#pragma GCC unroll 4
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int v = 0; v < 4; ++v) _mm256_storeu_ps(c + m * ldc + 8 * v, acc[m][v]);
}

// Runs f<MR>(m0) over the query vectors [0, M) in blocks of kMR (the last one shorter).
template <typename F>
inline void by_blocks(int64_t M, F&& f) {
  int64_t m0 = 0;
  for (; m0 + kMR <= M; m0 += kMR) f(std::integral_constant<int, kMR>{}, m0);
  if (M - m0 == 1) f(std::integral_constant<int, 1>{}, m0);
  else if (M - m0 == 2) f(std::integral_constant<int, 2>{}, m0);
}

// One step's scores s (M x kStep) into softmax numerators, keys past each vector's position masked;
// updates its running maximum mx and sum l and rescales its output row when the maximum rises.
inline void softmax_step(float* s, int64_t M, int64_t G, int64_t first_pos, int64_t t0, int64_t D, float* mx,
                         float* l, float* o) {
  using fVec = at::vec::Vectorized<float>;  // 8 lanes in an AVX2 build, 16 in an AVX-512 one
  constexpr int64_t kVec = fVec::size();
  static_assert(kStep % kVec == 0, "a step is whole vectors");
  for (int64_t m = 0; m < M; ++m) {
    float* sm = s + m * kStep;
    const int64_t visible = first_pos + m / G - t0 + 1;  // keys t0.. this vector attends to in the step
    if (visible <= 0) {  // a row before the step's keys (the causal diagonal): nothing to add
      std::fill(sm, sm + kStep, 0.f);
      continue;
    }
    for (int64_t j = visible; j < kStep; ++j) sm[j] = -INFINITY;
    fVec vmax = fVec::loadu(sm);
    for (int64_t j = kVec; j < kStep; j += kVec) vmax = at::vec::maximum(vmax, fVec::loadu(sm + j));
    const float step_max = vmax.reduce_max();
    const float new_max = std::max(mx[m], step_max);
    fVec vsum(0.f);
    for (int64_t j = 0; j < kStep; j += kVec) {
      const fVec e = (fVec::loadu(sm + j) - fVec(new_max)).exp_u20();
      e.store(sm + j);
      vsum = vsum + e;
    }
    const float sum = vsum.reduce_add();
    if (new_max > mx[m]) {
      const float alpha = std::exp(mx[m] - new_max);  // 0 at the first step (mx = -inf, o and l = 0)
      l[m] *= alpha;
      float* om = o + m * D;
      for (int64_t d = 0; d < D; d += kVec) (fVec::loadu(om + d) * fVec(alpha)).store(om + d);
      mx[m] = new_max;
    }
    l[m] += sum;
  }
}

// q: [q_len, H, D] rows q_stride apart; out likewise (out_stride); caches [blocks, BS, Hkv, D].
void prefill_attention_avx2(float* out, int64_t out_stride, const float* q, int64_t q_stride, const float* k_cache,
                            const float* v_cache, const int64_t* table, int64_t q_len, int64_t ctx, int64_t H,
                            int64_t Hkv, int64_t D, int64_t BS, float scale) {
  const int64_t G = H / Hkv, tiles = (ctx + kStep - 1) / kStep, padded = tiles * kStep;
  // not zeroed: the packing writes every element, padding keys included
  std::unique_ptr<float[]> kt(new float[Hkv * padded * D]), vp(new float[Hkv * padded * D]);
  at::parallel_for(0, Hkv * tiles, 4, [&](int64_t b, int64_t e) {
    for (int64_t task = b; task < e; ++task) {
      const int64_t h = task / tiles, tile = task % tiles;
      float* kd = kt.get() + (h * tiles + tile) * D * kStep;
      float* vd = vp.get() + (h * padded + tile * kStep) * D;
      for (int64_t j = 0; j < kStep; ++j) {
        const int64_t t = tile * kStep + j;
        if (t >= ctx) {
          for (int64_t d = 0; d < D; ++d) kd[d * kStep + j] = 0.f;
          std::fill(vd + j * D, vd + (j + 1) * D, 0.f);
          continue;
        }
        const int64_t at = ((table[t / BS] * BS + t % BS) * Hkv + h) * D;
        for (int64_t d = 0; d < D; ++d) kd[d * kStep + j] = k_cache[at + d];
        std::copy(v_cache + at, v_cache + at + D, vd + j * D);
      }
    }
  });
  const int64_t rows = std::max<int64_t>(1, kVectors / G), qtiles = (q_len + rows - 1) / rows;
  const int64_t first = ctx - q_len;  // position of the chunk's first row
  // tasks in the order first, last, second, second last, ...: a causal tile's cost grows with its
  // position, and parallel_for hands each thread a contiguous range
  at::parallel_for(0, Hkv * qtiles, 1, [&](int64_t b, int64_t e) {
    const int64_t M_max = rows * G;
    std::vector<float> qs(M_max * D), o(M_max * D), s(M_max * kStep), mx(M_max), l(M_max);
    for (int64_t task = b; task < e; ++task) {
      const int64_t h = task % Hkv, z = task / Hkv;
      const int64_t qt = z % 2 == 0 ? z / 2 : qtiles - 1 - z / 2;
      const int64_t r0 = qt * rows, nr = std::min(rows, q_len - r0), M = nr * G;
      for (int64_t r = 0; r < nr; ++r)
        for (int64_t g = 0; g < G; ++g) {
          const float* src = q + (r0 + r) * q_stride + (h * G + g) * D;
          for (int64_t d = 0; d < D; ++d) qs[(r * G + g) * D + d] = src[d] * scale;
        }
      std::fill(o.begin(), o.begin() + M * D, 0.f);
      std::fill(mx.begin(), mx.begin() + M, -INFINITY);
      std::fill(l.begin(), l.begin() + M, 0.f);
      const int64_t last_pos = first + r0 + nr - 1;
      for (int64_t t0 = 0; t0 <= last_pos; t0 += kStep) {
        const float* ktile = kt.get() + (h * tiles + t0 / kStep) * D * kStep;
        by_blocks(M, [&](auto mr, int64_t m0) {
          micro_gemm<decltype(mr)::value, false>(qs.data() + m0 * D, D, ktile, kStep, D, s.data() + m0 * kStep, kStep);
        });
        softmax_step(s.data(), M, G, first + r0, t0, D, mx.data(), l.data(), o.data());
        const int64_t n = std::min(kStep, last_pos + 1 - t0);
        const float* vt = vp.get() + (h * padded + t0) * D;
        by_blocks(M, [&](auto mr, int64_t m0) {
          for (int64_t d0 = 0; d0 < D; d0 += 32)
            micro_gemm<decltype(mr)::value, true>(s.data() + m0 * kStep, kStep, vt + d0, D, n,
                                                  o.data() + m0 * D + d0, D);
        });
      }
      for (int64_t r = 0; r < nr; ++r)
        for (int64_t g = 0; g < G; ++g) {
          const int64_t m = r * G + g;
          const float inv = 1.f / l[m];
          float* dst = out + (r0 + r) * out_stride + (h * G + g) * D;
          for (int64_t d = 0; d < D; ++d) dst[d] = o[m * D + d] * inv;
        }
    }
  });
}
#endif

// out, q: [q_len, H, D] fp32 (rows may be strided, heads contiguous); caches [blocks, BS, Hkv, D]
// fp32; block_table: int64 blocks covering ctx_len keys, the rows being positions ctx_len - q_len
// onwards. Returns false where this build has no such kernel (no AVX2), the caller then runs SDPA.
bool prefill_attention(at::Tensor out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                       const at::Tensor& block_table, int64_t ctx_len, double scale) {
#ifdef TM_HAVE_PREFILL_AVX2
  TORCH_CHECK(q.dim() == 3 && out.sizes() == q.sizes() && q.scalar_type() == at::kFloat &&
                  out.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat &&
                  v_cache.scalar_type() == at::kFloat,
              "prefill_attention: fp32 q, out [q_len, H, D] and caches");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == q.size(2) && out.stride(2) == 1 && out.stride(1) == out.size(2) &&
                  k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.sizes() == v_cache.sizes(),
              "prefill_attention: heads must be contiguous, caches [blocks, block_size, Hkv, D]");
  const int64_t q_len = q.size(0), H = q.size(1), D = q.size(2), BS = k_cache.size(1), Hkv = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == D && D % 32 == 0 && H % Hkv == 0, "prefill_attention: head_dim ", D,
              " must be a multiple of 32, and H of Hkv");
  TORCH_CHECK(q_len <= ctx_len && block_table.scalar_type() == at::kLong && block_table.dim() == 1 &&
                  block_table.size(0) * BS >= ctx_len,
              "prefill_attention: the block table must cover ctx_len >= q_len keys");
  const auto table = block_table.contiguous();
  const int64_t* tp = table.data_ptr<int64_t>();
  for (int64_t i = 0; i < (ctx_len + BS - 1) / BS; ++i)
    TORCH_CHECK(tp[i] >= 0 && tp[i] < k_cache.size(0), "prefill_attention: block ", tp[i], " out of range");
  if (q_len == 0) return true;
  prefill_attention_avx2(out.data_ptr<float>(), out.stride(0), q.data_ptr<float>(), q.stride(0),
                         k_cache.data_ptr<float>(), v_cache.data_ptr<float>(), tp, q_len, ctx_len, H, Hkv, D, BS,
                         static_cast<float>(scale));
  return true;
#else
  (void)out, (void)q, (void)k_cache, (void)v_cache, (void)block_table, (void)ctx_len, (void)scale;
  return false;
#endif
}

}  // namespace tm_prefill

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("prefill_attention(Tensor(a!) out, Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, "
        "int ctx_len, float scale) -> bool");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("prefill_attention", &tm_prefill::prefill_attention);
}

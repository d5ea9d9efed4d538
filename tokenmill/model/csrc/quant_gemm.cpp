// Matrix products with quantized weights that stay packed (GGUF blocks, tokenmill's int8/int4):
//   qlinear:   out[M, N] = x[M, K] . W^T (+ bias), W given as one or more row shards of any format
//              (a merged qkv whose q/k are Q4_K and v is Q6_K is one call, one thread fork).
//   dequantize / embedding: rows of W as floats (tests, the many-row path, token embeddings).
// Few rows (decode): activations are quantized to int8 in blocks of 32 (scale dx) and each chunk
// of 32 weights is an integer dot product (VNNI vpdpbusd, or vpmaddubsw + vpmaddwd on AVX2), so
// the weights are read once per step, as packed as they are stored. Up to 4 activation rows share
// each decoded chunk. Many rows (prefill): dequantize a slab of W to the activation dtype and hand
// it to the dense GEMM (oneDNN), whose throughput wins once the weights are reused enough.
// See quant_blocks.h for the formats. Compiled once per ISA variant (quant_kernels.py).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "quant_blocks.h"

#ifndef TM_QUANT_NS
#define TM_QUANT_NS tokenmill_q_scalar
#endif
#define TM_STR2(x) #x
#define TM_STR(x) TM_STR2(x)

namespace {

using namespace tmq;

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
constexpr bool kVNNI = true;
#else
constexpr bool kVNNI = false;
#endif

// One quantized activation row: xq[K] int8 (|xq| <= 127), and per 32 its scale dx. For the SIMD
// kernels, per 4 elements (one int32 lane of a dot product): dx (`dl`) and dx * sum(xq) (`sl`);
// for the scalar kernel, per 16: dx * sum(xq) (`s`).
struct ActRow {
  const int8_t* q;
  const float* d;
  const float* s;
  const float* dl;
  const float* sl;
};

inline int64_t act_row_bytes(int64_t K) { return K + K / 32 * 4 + K / 16 * 4 + 2 * (K / 4) * 4; }

inline ActRow act_row(const uint8_t* base, int64_t K) {
  const float* f = reinterpret_cast<const float*>(base + K);
  return {reinterpret_cast<const int8_t*>(base), f, f + K / 32, f + K / 32 + K / 16, f + K / 32 + K / 16 + K / 4};
}

template <typename T>
void quantize_row(const T* x, int64_t K, uint8_t* dst) {
  int8_t* q = reinterpret_cast<int8_t*>(dst);
  float* d = reinterpret_cast<float*>(dst + K);
  float* s = d + K / 32;
  float* dl = s + K / 16;
  float* sl = dl + K / 4;
  float xf[32];
  for (int64_t b = 0; b < K / 32; ++b) {
    float amax = 0.f;
    for (int i = 0; i < 32; ++i) {
      xf[i] = static_cast<float>(x[b * 32 + i]);
      amax = std::max(amax, std::fabs(xf[i]));
    }
    const float scale = amax / 127.f;
    const float inv = amax > 0.f ? 127.f / amax : 0.f;
    int sums[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int i = 0; i < 32; ++i) {
      const int v = static_cast<int>(std::nearbyint(xf[i] * inv));  // |v| <= 127: never -128
      q[b * 32 + i] = static_cast<int8_t>(v);
      sums[i / 4] += v;
    }
    d[b] = scale;
    s[2 * b] = scale * (sums[0] + sums[1] + sums[2] + sums[3]);
    s[2 * b + 1] = scale * (sums[4] + sums[5] + sums[6] + sums[7]);
    for (int l = 0; l < 8; ++l) {
      dl[b * 8 + l] = scale;
      sl[b * 8 + l] = scale * sums[l];
    }
  }
}

#if defined(__AVX2__)
// 8 int32 lanes; lane i holds the dot of bytes 4i..4i+3 (lanes 0-3: weights 0-15, 4-7: 16-31).
template <bool kSigned>
inline __m256i dot32(__m256i u, __m256i x) {
  if constexpr (kSigned) {
    if constexpr (kVNNI) {  // as unsigned q + 128; the kernel adds -128 * d * sum(x)
      return _mm256_dpbusd_epi32(_mm256_setzero_si256(), _mm256_xor_si256(u, _mm256_set1_epi8(-128)), x);
    } else {
      const __m256i p = _mm256_maddubs_epi16(_mm256_sign_epi8(u, u), _mm256_sign_epi8(x, u));
      return _mm256_madd_epi16(p, _mm256_set1_epi16(1));
    }
  } else {
    if constexpr (kVNNI) {
      return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, x);
    } else {
      return _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1));
    }
  }
}

inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

template <typename F>
inline void signed_offsets(ChunkScale& s) {
  if constexpr (F::kSigned && kVNNI) {  // the dot ran on q + 128
    s.off[0] -= 128.f * s.d[0];
    s.off[1] -= 128.f * s.d[1];
  }
}
#endif

#if defined(__AVX512F__) && defined(__AVX512BW__)
// 16 int32 lanes over 64 bytes (two chunks): lanes 4h..4h+3 hold half h (16 weights) of the pair.
template <bool kSigned>
inline __m512i dot64(__m512i u, __m512i x) {
  if constexpr (kSigned) {
    if constexpr (kVNNI) {
      return _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_xor_si512(u, _mm512_set1_epi8(-128)), x);
    } else {  // |q| . (x with the sign of q)
      const __mmask64 neg = _mm512_movepi8_mask(u);
      const __m512i xs = _mm512_mask_sub_epi8(x, neg, _mm512_setzero_si512(), x);
      return _mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_abs_epi8(u), xs), _mm512_set1_epi16(1));
    }
  } else {
    if constexpr (kVNNI) {
      return _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, x);
    } else {
      return _mm512_madd_epi16(_mm512_maddubs_epi16(u, x), _mm512_set1_epi16(1));
    }
  }
}

// The four halves' values of a chunk pair, each spread over its 4 lanes.
inline __m512 spread4(float a, float b, float c, float d) {
  const __m512i idx = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
  return _mm512_permutexvar_ps(idx, _mm512_castps128_ps512(_mm_set_ps(d, c, b, a)));
}

// Dot products of one weight row with MR activation rows, two chunks at a time.
template <typename F, int MR>
inline void row_dot(const uint8_t* row, int64_t chunks, const ActRow* a, float* res) {
  __m512 acc[MR], aco[MR];
  for (int m = 0; m < MR; ++m) acc[m] = aco[m] = _mm512_setzero_ps();
  int64_t c = 0;
  for (; c + 2 <= chunks; c += 2) {
    ChunkScale s0, s1;
    F::scales(row, static_cast<int>(c), s0);
    F::scales(row, static_cast<int>(c + 1), s1);
    signed_offsets<F>(s0);
    signed_offsets<F>(s1);
    const __m512i u = _mm512_inserti64x4(_mm512_castsi256_si512(simd_bytes<F>(row, static_cast<int>(c))),
                                         simd_bytes<F>(row, static_cast<int>(c + 1)), 1);
    const __m512 dv = spread4(s0.d[0], s0.d[1], s1.d[0], s1.d[1]);
    const __m512 ov = spread4(s0.off[0], s0.off[1], s1.off[0], s1.off[1]);
    for (int m = 0; m < MR; ++m) {
      const __m512i x = _mm512_loadu_si512(a[m].q + c * 32);
      const __m512 p = _mm512_cvtepi32_ps(dot64<F::kSigned>(u, x));
      acc[m] = _mm512_fmadd_ps(p, _mm512_mul_ps(dv, _mm512_loadu_ps(a[m].dl + c * 8)), acc[m]);
      aco[m] = _mm512_fmadd_ps(ov, _mm512_loadu_ps(a[m].sl + c * 8), aco[m]);
    }
  }
  float tail[MR];
  for (int m = 0; m < MR; ++m) tail[m] = 0.f;
  for (; c < chunks; ++c) {  // an odd last chunk
    ChunkScale s;
    F::scales(row, static_cast<int>(c), s);
    signed_offsets<F>(s);
    const __m256i u = simd_bytes<F>(row, static_cast<int>(c));
    const __m256 dv = _mm256_set_m128(_mm_set1_ps(s.d[1]), _mm_set1_ps(s.d[0]));
    for (int m = 0; m < MR; ++m) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a[m].q + c * 32));
      const __m256 p = _mm256_mul_ps(_mm256_cvtepi32_ps(dot32<F::kSigned>(u, x)), dv);
      tail[m] += a[m].d[c] * hsum(p) + s.off[0] * a[m].s[2 * c] + s.off[1] * a[m].s[2 * c + 1];
    }
  }
  for (int m = 0; m < MR; ++m) res[m] = _mm512_reduce_add_ps(_mm512_add_ps(acc[m], aco[m])) + tail[m];
}
#elif defined(__AVX2__)
template <typename F, int MR>
inline void row_dot(const uint8_t* row, int64_t chunks, const ActRow* a, float* res) {
  __m256 acc[MR], aco[MR];
  for (int m = 0; m < MR; ++m) acc[m] = aco[m] = _mm256_setzero_ps();
  for (int64_t c = 0; c < chunks; ++c) {
    ChunkScale s;
    F::scales(row, static_cast<int>(c), s);
    signed_offsets<F>(s);
    const __m256i u = simd_bytes<F>(row, static_cast<int>(c));
    const __m256 dv = _mm256_set_m128(_mm_set1_ps(s.d[1]), _mm_set1_ps(s.d[0]));
    const __m256 ov = _mm256_set_m128(_mm_set1_ps(s.off[1]), _mm_set1_ps(s.off[0]));
    for (int m = 0; m < MR; ++m) {
      const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a[m].q + c * 32));
      const __m256 p = _mm256_cvtepi32_ps(dot32<F::kSigned>(u, x));
      acc[m] = _mm256_fmadd_ps(p, _mm256_mul_ps(dv, _mm256_loadu_ps(a[m].dl + c * 8)), acc[m]);
      aco[m] = _mm256_fmadd_ps(ov, _mm256_loadu_ps(a[m].sl + c * 8), aco[m]);
    }
  }
  for (int m = 0; m < MR; ++m) res[m] = hsum(_mm256_add_ps(acc[m], aco[m]));
}
#else
template <typename F, int MR>
inline void row_dot(const uint8_t* row, int64_t chunks, const ActRow* a, float* res) {
  float acc[MR], offs[MR];
  for (int m = 0; m < MR; ++m) acc[m] = offs[m] = 0.f;
  uint8_t u[32];
  for (int64_t c = 0; c < chunks; ++c) {
    ChunkScale s;
    F::scales(row, static_cast<int>(c), s);
    F::bytes(row, static_cast<int>(c), u);
    for (int m = 0; m < MR; ++m) {
      const int8_t* x = a[m].q + c * 32;
      int d0 = 0, d1 = 0;
      for (int i = 0; i < 16; ++i) {
        const int w0 = F::kSigned ? static_cast<int8_t>(u[i]) : u[i];
        const int w1 = F::kSigned ? static_cast<int8_t>(u[i + 16]) : u[i + 16];
        d0 += w0 * x[i];
        d1 += w1 * x[i + 16];
      }
      acc[m] += a[m].d[c] * (s.d[0] * d0 + s.d[1] * d1);
      offs[m] += s.off[0] * a[m].s[2 * c] + s.off[1] * a[m].s[2 * c + 1];
    }
  }
  for (int m = 0; m < MR; ++m) res[m] = acc[m] + offs[m];
}
#endif

// Decode weight rows [n0, n1) of one format to floats (dst: (n1 - n0) x K, row stride ldd).
template <typename F, typename T>
void dequant_rows(const uint8_t* w, int64_t rb, int64_t K, int64_t n0, int64_t n1, T* dst, int64_t ldd) {
  const int64_t chunks = K / 32;
  float tmp[32];
  uint8_t u[32];
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = w + n * rb;
    T* o = dst + (n - n0) * ldd;
    for (int64_t c = 0; c < chunks; ++c) {
      ChunkScale s;
      F::scales(row, static_cast<int>(c), s);
#if defined(__AVX2__)
      const __m256i v = simd_bytes<F>(row, static_cast<int>(c));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(u), v);
      for (int h = 0; h < 2; ++h) {
        const __m256 d = _mm256_set1_ps(s.d[h]), off = _mm256_set1_ps(s.off[h]);
        for (int j = 0; j < 16; j += 8) {
          const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(u + 16 * h + j));
          const __m256i i32 = F::kSigned ? _mm256_cvtepi8_epi32(b) : _mm256_cvtepu8_epi32(b);
          _mm256_storeu_ps(tmp + 16 * h + j, _mm256_fmadd_ps(_mm256_cvtepi32_ps(i32), d, off));
        }
      }
#else
      F::bytes(row, static_cast<int>(c), u);
      for (int i = 0; i < 32; ++i) {
        const int h = i >> 4;
        const float q = F::kSigned ? static_cast<float>(static_cast<int8_t>(u[i])) : static_cast<float>(u[i]);
        tmp[i] = s.d[h] * q + s.off[h];
      }
#endif
      for (int i = 0; i < 32; ++i) o[c * 32 + i] = static_cast<T>(tmp[i]);
    }
  }
}

struct Shard {
  const uint8_t* w;
  int qtype;
  int64_t rows, rb, first;  // rows, bytes per row, first output column
};

std::vector<Shard> make_shards(const std::vector<at::Tensor>& weights, at::IntArrayRef qtypes,
                               at::IntArrayRef rows, int64_t K) {
  TORCH_CHECK(weights.size() == qtypes.size() && weights.size() == rows.size(), "qlinear: shard lists differ in length");
  std::vector<Shard> shards;
  int64_t first = 0;
  for (size_t i = 0; i < weights.size(); ++i) {
    const int qt = static_cast<int>(qtypes[i]);
    const int64_t rb = row_bytes(qt, K);
    TORCH_CHECK(rb > 0, "quantized weight: unsupported type ", qt);
    TORCH_CHECK(K % block_size(qt) == 0, "quantized weight: K=", K, " is not a multiple of the block size ",
                block_size(qt));
    const auto& w = weights[i];
    TORCH_CHECK(w.scalar_type() == at::kByte && w.is_contiguous() && w.numel() == rows[i] * rb,
                "quantized weight: expected ", rows[i], " x ", rb, " contiguous bytes for type ", qt);
    shards.push_back({w.data_ptr<uint8_t>(), qt, rows[i], rb, first});
    first += rows[i];
  }
  return shards;
}

template <typename TX>
void qgemm_native(const TX* x, int64_t M, int64_t K, const std::vector<Shard>& shards, float* out, int64_t ldo) {
  const int64_t arb = act_row_bytes(K);
  std::vector<uint8_t> act(M * arb);
  at::parallel_for(0, M, 16, [&](int64_t b, int64_t e) {
    for (int64_t m = b; m < e; ++m) quantize_row(x + m * K, K, act.data() + m * arb);
  });
  std::vector<ActRow> rows(M);
  for (int64_t m = 0; m < M; ++m) rows[m] = act_row(act.data() + m * arb, K);
  const int64_t N = shards.back().first + shards.back().rows;
  const int64_t chunks = K / 32;
  constexpr int64_t kRowBlock = 16;
  at::parallel_for(0, (N + kRowBlock - 1) / kRowBlock, 1, [&](int64_t b, int64_t e) {
    size_t si = 0;
    for (int64_t n0 = b * kRowBlock; n0 < std::min(N, e * kRowBlock); n0 += kRowBlock) {
      const int64_t n1 = std::min(N, n0 + kRowBlock);
      for (int64_t n = n0; n < n1;) {  // rows of one shard at a time
        while (n >= shards[si].first + shards[si].rows) ++si;
        while (n < shards[si].first) --si;
        const Shard& sh = shards[si];
        const int64_t stop = std::min(n1, sh.first + sh.rows);
        dispatch_format(sh.qtype, [&](auto fmt) {
          using F = decltype(fmt);
          for (int64_t m0 = 0; m0 < M; m0 += 4) {
            const int64_t mr = std::min<int64_t>(4, M - m0);
            for (int64_t r = n; r < stop; ++r) {
              const uint8_t* row = sh.w + (r - sh.first) * sh.rb;
              float res[4];
              switch (mr) {
                case 4: row_dot<F, 4>(row, chunks, &rows[m0], res); break;
                case 3: row_dot<F, 3>(row, chunks, &rows[m0], res); break;
                case 2: row_dot<F, 2>(row, chunks, &rows[m0], res); break;
                default: row_dot<F, 1>(row, chunks, &rows[m0], res); break;
              }
              for (int64_t m = 0; m < mr; ++m) out[(m0 + m) * ldo + r] = res[m];
            }
          }
        });
        n = stop;
      }
    }
  });
}

template <typename T>
void dequant_shard(const Shard& sh, int64_t K, int64_t r0, int64_t r1, T* dst) {
  at::parallel_for(r0, r1, 8, [&](int64_t b, int64_t e) {
    dispatch_format(sh.qtype, [&](auto fmt) { dequant_rows<decltype(fmt), T>(sh.w, sh.rb, K, b, e, dst + (b - r0) * K, K); });
  });
}

// out: [M, N] (float, or x's dtype); x: [M, K] float or bf16. Rows of x above `dense_min_rows`
// go through dequantize + dense GEMM instead of the packed kernel.
void qlinear(at::Tensor out, const at::Tensor& x, std::vector<at::Tensor> weights, at::IntArrayRef qtypes,
             at::IntArrayRef rows, const std::optional<at::Tensor>& bias, int64_t dense_min_rows) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && out.dim() == 2 && out.is_contiguous(), "qlinear: layout");
  const int64_t M = x.size(0), K = x.size(1);
  const auto shards = make_shards(weights, qtypes, rows, K);
  const int64_t N = shards.back().first + shards.back().rows;
  TORCH_CHECK(out.size(0) == M && out.size(1) == N, "qlinear: out must be [", M, ", ", N, "]");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "qlinear: x must be float or bf16");
  if (M == 0) return;
  if (dense_min_rows > 0 && M >= dense_min_rows) {
    // slabs of at most ~4 MiB of dense weights, so the slab stays in cache while the GEMM reads it
    const int64_t slab = std::max<int64_t>(64, (4 << 20) / (K * x.element_size()));
    at::Tensor buf = at::empty({std::min(slab, N), K}, x.options());
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
  const bool direct = out.scalar_type() == at::kFloat;
  at::Tensor acc = direct ? out : at::empty({M, N}, x.options().dtype(at::kFloat));
  if (x.scalar_type() == at::kFloat) qgemm_native(x.data_ptr<float>(), M, K, shards, acc.data_ptr<float>(), N);
  else qgemm_native(x.data_ptr<at::BFloat16>(), M, K, shards, acc.data_ptr<float>(), N);
  if (bias) acc.add_(*bias);
  if (!direct) out.copy_(acc);
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

// out[t] = row ids[t] of W, dequantized
void embedding(at::Tensor out, const at::Tensor& ids, const at::Tensor& w, int64_t qtype, int64_t K) {
  TORCH_CHECK(ids.scalar_type() == at::kLong && out.is_contiguous() && out.size(1) == K, "embedding: layout");
  const int64_t rb = row_bytes(static_cast<int>(qtype), K);
  TORCH_CHECK(rb > 0 && w.numel() % rb == 0, "embedding: unsupported type or size");
  const int64_t vocab = w.numel() / rb, T_ = ids.numel();
  auto idc = ids.contiguous();
  const int64_t* id = idc.data_ptr<int64_t>();
  for (int64_t t = 0; t < T_; ++t) TORCH_CHECK(id[t] >= 0 && id[t] < vocab, "embedding: token id ", id[t], " out of range");
  const uint8_t* wp = w.data_ptr<uint8_t>();
  at::parallel_for(0, T_, 16, [&](int64_t b, int64_t e) {
    dispatch_format(static_cast<int>(qtype), [&](auto fmt) {
      using F = decltype(fmt);
      for (int64_t t = b; t < e; ++t) {
        if (out.scalar_type() == at::kFloat) dequant_rows<F, float>(wp + id[t] * rb, rb, K, 0, 1, out.data_ptr<float>() + t * K, K);
        else dequant_rows<F, at::BFloat16>(wp + id[t] * rb, rb, K, 0, 1, out.data_ptr<at::BFloat16>() + t * K, K);
      }
    });
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
        "int dense_min_rows) -> ()");
  m.def("dequantize(Tensor(a!) out, Tensor w, int qtype, int K) -> ()");
  m.def("embedding(Tensor(a!) out, Tensor ids, Tensor w, int qtype, int K) -> ()");
  m.def("variant() -> str", &variant);
}

TM_LIBRARY_IMPL(TM_QUANT_NS, CPU, m) {
  m.impl("qlinear", &qlinear);
  m.impl("dequantize", &dequantize);
  m.impl("embedding", &embedding);
}

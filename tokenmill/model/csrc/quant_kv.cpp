// Quantized KV cache: int8, fp8 e4m3 or fp8 e5m2 values with one float scale per token and kv head
// (absmax / 127, / 448 or / 57344), written by kv_write_quant and read in place by the paged decode
// kernel below; the same kernel also reads a bf16 cache under fp32 queries. Caches: data
// [num_blocks, block_size, Hkv, D] (int8, float8_e4m3fn, float8_e5m2 or bf16), scale [num_blocks,
// block_size, Hkv] float.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#ifndef TM_QUANT_NS
#define TM_QUANT_NS tokenmill_q_scalar
#endif

namespace {

template <typename C>
constexpr float kMaxCode = std::is_same_v<C, int8_t> ? 127.f : std::is_same_v<C, c10::Float8_e5m2> ? 57344.f : 448.f;

template <typename T, typename C>
void write_quant(const T* src, int64_t src_stride, C* data, float* scale, const int64_t* slots, int64_t n,
                 int64_t Hkv, int64_t D) {
  at::parallel_for(0, n * Hkv, 64, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const int64_t t = i / Hkv, h = i % Hkv;
      const T* x = src + t * src_stride + h * D;
      float amax = 0.f;
      for (int64_t d = 0; d < D; ++d) amax = std::max(amax, std::fabs(static_cast<float>(x[d])));
      const float qmax = kMaxCode<C>;
      const float s = amax / qmax, inv = amax > 0.f ? qmax / amax : 0.f;
      C* out = data + (slots[t] * Hkv + h) * D;
      for (int64_t d = 0; d < D; ++d) {
        const float v = static_cast<float>(x[d]) * inv;
        if constexpr (std::is_same_v<C, int8_t>) out[d] = static_cast<int8_t>(std::nearbyint(std::clamp(v, -qmax, qmax)));
        else out[d] = static_cast<C>(std::clamp(v, -qmax, qmax));
      }
      scale[slots[t] * Hkv + h] = s;
    }
  });
}

template <typename F>
void dispatch_cache(const at::Tensor& data, F&& f) {
  switch (data.scalar_type()) {
    case at::kChar: f(int8_t{}); break;
    case at::kFloat8_e4m3fn: f(c10::Float8_e4m3fn{}); break;
    case at::kFloat8_e5m2: f(c10::Float8_e5m2{}); break;
    default: TORCH_CHECK(false, "quantized KV cache: unsupported dtype ", data.scalar_type());
  }
}

// k, v: [T, Hkv, D] (rows may be strided, heads contiguous); slot_mapping: [T] int64.
void kv_write_quant(const at::Tensor& k, const at::Tensor& v, at::Tensor k_data, at::Tensor v_data, at::Tensor k_scale,
                    at::Tensor v_scale, const at::Tensor& slot_mapping) {
  const int64_t n = k.size(0), Hkv = k.size(1), D = k.size(2);
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == D && v.stride(2) == 1 && v.stride(1) == D, "kv_write_quant: layout");
  TORCH_CHECK(k_data.is_contiguous() && k_scale.is_contiguous() && slot_mapping.scalar_type() == at::kLong,
              "kv_write_quant: cache layout");
  auto slots = slot_mapping.contiguous();
  dispatch_cache(k_data, [&](auto ctag) {
    using C = decltype(ctag);
    auto run = [&](auto xtag) {
      using T = decltype(xtag);
      write_quant(k.data_ptr<T>(), k.stride(0), k_data.data_ptr<C>(), k_scale.data_ptr<float>(),
                  slots.data_ptr<int64_t>(), n, Hkv, D);
      write_quant(v.data_ptr<T>(), v.stride(0), v_data.data_ptr<C>(), v_scale.data_ptr<float>(),
                  slots.data_ptr<int64_t>(), n, Hkv, D);
    };
    if (k.scalar_type() == at::kFloat) run(float{});
    else if (k.scalar_type() == at::kBFloat16) run(at::BFloat16{});
    else TORCH_CHECK(false, "kv_write_quant: k/v must be float or bf16");
  });
}

// q . k in 16 lanes of partial sums folded in a fixed order: GCC vectorizes this (two FMA chains a
// row), where a plain float sum is one serial chain it may not reorder.
inline float dot_lanes(const float* a, const float* b, int64_t D) {
  float p[16] = {};
  int64_t d = 0;
  for (; d + 16 <= D; d += 16)
    for (int j = 0; j < 16; ++j) p[j] += a[d + j] * b[d + j];
  float tail = 0.f;
  for (; d < D; ++d) tail += a[d] * b[d];
  for (int j = 0; j < 8; ++j) p[j] += p[j + 8];
  return ((p[0] + p[4]) + (p[1] + p[5])) + ((p[2] + p[6]) + (p[3] + p[7])) + tail;
}

// Decode attention over a quantized (or bf16) paged cache. out, q: [B, H, D]; block_tables [B, max_blocks],
// seq_lens [B] int64; scales may be empty for a bf16 cache.
template <typename T, typename C>
void decode_q(T* out, const T* q, const C* kd, const C* vd, const float* ks, const float* vs, const int64_t* tables,
              const int64_t* lens, int64_t B, int64_t H, int64_t Hkv, int64_t D, int64_t BS, int64_t max_blocks,
              float scale) {
  const int64_t G = H / Hkv;
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(G * D), acc(G * D), scores, kv(D);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / Hkv, h = task % Hkv, L = lens[b];
      const int64_t* table = tables + b * max_blocks;
      for (int64_t i = 0; i < G * D; ++i) qf[i] = static_cast<float>(q[(b * H + h * G) * D + i]) * scale;
      scores.assign(G * L, 0.f);
      for (int64_t t = 0; t < L; ++t) {
        const int64_t slot = table[t / BS] * BS + t % BS;
        const C* kp = kd + (slot * Hkv + h) * D;
        const float s = ks ? ks[slot * Hkv + h] : 1.f;
        for (int64_t d = 0; d < D; ++d) kv[d] = static_cast<float>(kp[d]);
        for (int64_t g = 0; g < G; ++g) scores[g * L + t] = dot_lanes(qf.data() + g * D, kv.data(), D) * s;
      }
      std::vector<float> inv(G);
      for (int64_t g = 0; g < G; ++g) {
        float* sc = scores.data() + g * L;
        const float m = *std::max_element(sc, sc + L);
        float sum = 0.f;
        for (int64_t t = 0; t < L; ++t) sum += (sc[t] = std::exp(sc[t] - m));
        inv[g] = 1.f / sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < L; ++t) {
        const int64_t slot = table[t / BS] * BS + t % BS;
        const C* vp = vd + (slot * Hkv + h) * D;
        const float s = vs ? vs[slot * Hkv + h] : 1.f;
        for (int64_t d = 0; d < D; ++d) kv[d] = static_cast<float>(vp[d]) * s;
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * L + t];
          for (int64_t d = 0; d < D; ++d) acc[g * D + d] += p * kv[d];
        }
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) out[(b * H + h * G + g) * D + d] = static_cast<T>(acc[g * D + d] * inv[g]);
    }
  });
}

void paged_decode_attention_q(at::Tensor out, const at::Tensor& q, const at::Tensor& k_data, const at::Tensor& v_data,
                              const at::Tensor& k_scale, const at::Tensor& v_scale, const at::Tensor& block_tables,
                              const at::Tensor& seq_lens, double scale) {
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && k_data.is_contiguous() && v_data.is_contiguous(),
              "paged_decode_attention_q: tensors must be contiguous");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), BS = k_data.size(1), Hkv = k_data.size(2);
  auto bt = block_tables.contiguous();
  auto sl = seq_lens.contiguous();
  const bool scaled = k_scale.numel() > 0;
  auto run = [&](auto ttag, auto ctag) {
    using T = decltype(ttag);
    using C = decltype(ctag);
    decode_q<T, C>(out.data_ptr<T>(), q.data_ptr<T>(), k_data.data_ptr<C>(), v_data.data_ptr<C>(),
                   scaled ? k_scale.data_ptr<float>() : nullptr, scaled ? v_scale.data_ptr<float>() : nullptr,
                   bt.data_ptr<int64_t>(), sl.data_ptr<int64_t>(), B, H, Hkv, D, BS, bt.size(1),
                   static_cast<float>(scale));
  };
  auto by_cache = [&](auto ttag) {
    switch (k_data.scalar_type()) {
      case at::kChar: run(ttag, int8_t{}); break;
      case at::kFloat8_e4m3fn: run(ttag, c10::Float8_e4m3fn{}); break;
      case at::kFloat8_e5m2: run(ttag, c10::Float8_e5m2{}); break;
      case at::kBFloat16: run(ttag, at::BFloat16{}); break;
      default: TORCH_CHECK(false, "paged_decode_attention_q: unsupported cache dtype ", k_data.scalar_type());
    }
  };
  if (q.scalar_type() == at::kFloat) by_cache(float{});
  else if (q.scalar_type() == at::kBFloat16) by_cache(at::BFloat16{});
  else TORCH_CHECK(false, "paged_decode_attention_q: q must be float or bf16");
}

}  // namespace

#define TM_KV_FRAGMENT(ns, m) TORCH_LIBRARY_FRAGMENT(ns, m)
#define TM_KV_IMPL(ns, k, m) TORCH_LIBRARY_IMPL(ns, k, m)

TM_KV_FRAGMENT(TM_QUANT_NS, m) {
  m.def("kv_write_quant(Tensor k, Tensor v, Tensor(a!) k_data, Tensor(b!) v_data, Tensor(c!) k_scale, "
        "Tensor(d!) v_scale, Tensor slot_mapping) -> ()");
  m.def("paged_decode_attention_q(Tensor(a!) out, Tensor q, Tensor k_data, Tensor v_data, Tensor k_scale, "
        "Tensor v_scale, Tensor block_tables, Tensor seq_lens, float scale) -> ()");
}

TM_KV_IMPL(TM_QUANT_NS, CPU, m) {
  m.impl("kv_write_quant", &kv_write_quant);
  m.impl("paged_decode_attention_q", &paged_decode_attention_q);
}

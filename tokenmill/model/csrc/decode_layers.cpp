// Decoder layers of a decode-only step in one call (Llama / Qwen2 with packed quantized weights):
// per layer rms_norm (+ residual) -> qkv qlinear -> rotary -> K/V write -> paged attention ->
// o_proj qlinear -> rms_norm (+ residual) -> gate_up qlinear -> SiLU * up -> down qlinear.
// One stream's token on a small model spends as much in Python as in these kernels (a dozen ops
// per layer, each with its views and allocations); here each layer is the same kernels, called
// from C++ in the same order on the same buffers, so the result is bit for bit that of the
// Python layers (llama.py). The packed GEMV lives in the per-ISA quantized library: it is called
// through the dispatcher by its qualified name.
// The layers' weights and caches are read once into a DecodePlan (a torch custom class, built by
// fused_decode.py); a step calls its run() with the step's activations and metadata.
// Compiled into the kernels library as one unit with paged_attention.cpp and elementwise.cpp.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <torch/custom_class.h>

#include <cstring>
#include <string>

namespace tm_layers {

using QLinearFn = void(at::Tensor, const at::Tensor&, std::vector<at::Tensor>, at::IntArrayRef, at::IntArrayRef,
                       const std::optional<at::Tensor>&, int64_t, int64_t, const std::optional<at::Tensor>&,
                       const std::optional<at::Tensor>&);
// quant_kv.cpp's ops, in the per-ISA library like qlinear: a quantized cache's write and portable decode
using KVWriteFn = void(const at::Tensor&, const at::Tensor&, at::Tensor, at::Tensor, at::Tensor, at::Tensor,
                       const at::Tensor&);
using KVDecodeFn = void(at::Tensor, const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                        const at::Tensor&, const at::Tensor&, const at::Tensor&, double);

// One packed linear layer: shards and their formats, read from the flat per-layer lists.
struct Packed {
  std::vector<at::Tensor> w;
  std::vector<int64_t> qtypes, rows;
  int64_t out = 0, dense_min_rows = 0, act_bits = 16;
  std::optional<at::Tensor> outlier_cols, outlier_w;  // 8-bit codes' outlier channels (quant_outliers.h)

  // From flat lists: ints dense_min_rows, act_bits, has outliers, n, then n (qtype, rows); tensors
  // [outlier cols, outlier w], then the n shards.
  template <typename Int, typename Tensor>
  static Packed read(Int integer, Tensor tensor) {
    Packed p;
    p.dense_min_rows = integer();
    p.act_bits = integer();
    if (integer()) p.outlier_cols = tensor(), p.outlier_w = tensor();
    for (int64_t s = 0, n = integer(); s < n; ++s) {
      p.w.push_back(tensor());
      p.qtypes.push_back(integer());
      p.rows.push_back(integer());
      p.out += p.rows.back();
    }
    return p;
  }

  void call(const c10::TypedOperatorHandle<QLinearFn>& op, at::Tensor& y, const at::Tensor& x,
            const std::optional<at::Tensor>& bias) const {
    op.call(y, x, w, qtypes, rows, bias, dense_min_rows, act_bits, outlier_cols, outlier_w);
  }
};

// The first n values of each row of src (contiguous rows) into dst's rows, back to back.
void copy_rows(const at::Tensor& dst, const at::Tensor& src, int64_t n) {
  const int64_t es = src.element_size(), bytes = n * es;
  char* d = static_cast<char*>(dst.data_ptr());
  const char* s = static_cast<const char*>(src.data_ptr());
  for (int64_t t = 0; t < src.size(0); ++t) std::memcpy(d + t * bytes, s + t * src.size(1) * es, bytes);
}

// This step's K/V rows of a cache in the model's dtype into their slots, before attention reads them.
void write_plain_kv(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& qkv, const int64_t* slots,
                    int64_t q_size, int64_t kv_size) {
  const int64_t es = qkv.element_size();
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const char* src = static_cast<const char*>(qkv.data_ptr());
  const int64_t row_bytes = qkv.size(1) * es, kv_bytes = kv_size * es;
  for (int64_t t = 0; t < qkv.size(0); ++t) {
    std::memcpy(kc + slots[t] * kv_bytes, src + t * row_bytes + q_size * es, kv_bytes);
    std::memcpy(vc + slots[t] * kv_bytes, src + t * row_bytes + (q_size + kv_size) * es, kv_bytes);
  }
}

// The same into a bf16 cache under an fp32 model, each value rounded to nearest even as cpu_paged.py's
// .to(bfloat16): its index_copy_ and conversions through the dispatcher cost ~24 us a layer (an AVX2
// EPYC), more than the half of the cache's bytes they were to save SmolLM2's one stream.
void write_bf16_kv(const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& qkv, const int64_t* slots,
                   int64_t q_size, int64_t kv_size) {
  TORCH_CHECK(qkv.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kBFloat16,
              "decode_layers: a bf16 cache without scales is written from an fp32 model");
  at::BFloat16* kc = k_cache.data_ptr<at::BFloat16>();
  at::BFloat16* vc = v_cache.data_ptr<at::BFloat16>();
  const float* src = qkv.data_ptr<float>();
  const int64_t row = qkv.size(1);
  for (int64_t t = 0; t < qkv.size(0); ++t) {
    const float* kv = src + t * row + q_size;  // this token's K, then its V
    for (int64_t d = 0; d < kv_size; ++d) {
      kc[slots[t] * kv_size + d] = at::BFloat16(kv[d]);
      vc[slots[t] * kv_size + d] = at::BFloat16(kv[kv_size + d]);
    }
  }
}

// Every layer's weights, norms and cache, read once from fused_decode.py's flat lists, with the
// kernels' dispatcher handles: a step then passes only its activations and metadata. Passing the
// ~400 tensors and ~800 ints on every call, and reading them back into vectors, cost one stream
// ~0.2 ms a step (2% of a SmolLM2 token on Zen 3).
struct DecodePlan : torch::CustomClassHolder {
  struct Layer {
    at::Tensor in_norm, post_norm, k_cache, v_cache, k_scale, v_scale;
    std::optional<at::Tensor> qkv_bias;
    Packed qkv, o, gate_up, down;
  };
  std::vector<Layer> layers;
  int64_t H, Hkv, D;
  double eps, scale;
  c10::TypedOperatorHandle<QLinearFn> qlinear_op;
  // a quantized KV cache's kernels (quant_kv.cpp), absent for a cache in the model's dtype
  std::optional<c10::TypedOperatorHandle<KVWriteFn>> kv_write;
  std::optional<c10::TypedOperatorHandle<KVDecodeFn>> kv_decode;

  // ints per layer: has_bias, then per linear (qkv, o, gate_up, down) Packed::read's (act_bits: each
  // kind has its own, act_bits.py); tensors per layer: in_norm, post_norm, k_cache, v_cache, k_scale,
  // v_scale (empty for a plain cache, or a bf16 one under fp32), [qkv bias], then per linear
  // Packed::read's.
  DecodePlan(std::vector<at::Tensor> t, std::vector<int64_t> ints, int64_t num_layers, int64_t num_heads,
             int64_t num_kv_heads, int64_t head_dim, double eps_, double scale_, std::string qlinear_name,
             std::string kv_ops)
      : H(num_heads), Hkv(num_kv_heads), D(head_dim), eps(eps_), scale(scale_),
        qlinear_op(c10::Dispatcher::singleton().findSchemaOrThrow(qlinear_name.c_str(), "").typed<QLinearFn>()) {
    auto& dispatcher = c10::Dispatcher::singleton();
    if (!kv_ops.empty()) {
      kv_write = dispatcher.findSchemaOrThrow((kv_ops + "::kv_write_quant").c_str(), "").typed<KVWriteFn>();
      kv_decode = dispatcher.findSchemaOrThrow((kv_ops + "::paged_decode_attention_q").c_str(), "").typed<KVDecodeFn>();
    }
    size_t ti = 0, ii = 0;
    auto tensor = [&] {
      TORCH_CHECK(ti < t.size(), "DecodePlan: fewer tensors than the layers need");
      return t[ti++];
    };
    auto integer = [&] {
      TORCH_CHECK(ii < ints.size(), "DecodePlan: fewer ints than the layers need");
      return ints[ii++];
    };
    auto linear = [&] { return Packed::read(integer, tensor); };
    const int64_t q_size = H * D, kv_size = Hkv * D;
    for (int64_t i = 0; i < num_layers; ++i) {
      Layer ly;
      ly.in_norm = tensor(), ly.post_norm = tensor(), ly.k_cache = tensor(), ly.v_cache = tensor();
      ly.k_scale = tensor(), ly.v_scale = tensor();
      if (integer()) ly.qkv_bias = tensor();
      ly.qkv = linear(), ly.o = linear(), ly.gate_up = linear(), ly.down = linear();
      TORCH_CHECK(ly.qkv.out == q_size + 2 * kv_size && ly.k_cache.is_contiguous() && ly.v_cache.is_contiguous() &&
                      ly.k_cache.dim() == 4 && ly.k_cache.size(2) == Hkv && ly.k_cache.size(3) == D &&
                      ly.v_cache.sizes() == ly.k_cache.sizes(),
                  "DecodePlan: layer ", i, ": qkv size or KV cache layout does not match the heads");
      layers.push_back(std::move(ly));
    }
    TORCH_CHECK(!layers.empty(), "DecodePlan: no layers");
    TORCH_CHECK(ti == t.size() && ii == ints.size(), "DecodePlan: layer lists longer than the layers");
  }

  // Returns the last layer's MLP output; residual is updated in place (pass zeros before the first
  // layer: x + 0 is x, so the first norm sees x itself, as in llama.py).
  at::Tensor run(at::Tensor hidden, at::Tensor residual, const at::Tensor& positions, const at::Tensor& cos,
                 const at::Tensor& sin, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                 const at::Tensor& seq_lens) {
    TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous() && residual.is_contiguous() &&
                    residual.sizes() == hidden.sizes() && residual.scalar_type() == hidden.scalar_type(),
                "decode_layers: hidden and residual must be contiguous [T, hidden] of one dtype");
    TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == hidden.size(0),
                "decode_layers: one int64 slot per token");
    const bool plain_kv = !kv_write.has_value();
    TORCH_CHECK((layers[0].k_cache.scalar_type() == hidden.scalar_type()) == plain_kv,
                "decode_layers: the KV cache's dtype does not match the plan");
    auto qlinear = [&](at::Tensor& y, const Packed& p, const at::Tensor& x, const std::optional<at::Tensor>& bias) {
      if (!y.defined() || y.size(1) != p.out) y = at::empty({x.size(0), p.out}, x.options());
      p.call(qlinear_op, y, x, bias);
    };
    const int64_t T_ = hidden.size(0), q_size = H * D, kv_size = Hkv * D;
    const int64_t* slots = slot_mapping.data_ptr<int64_t>();
    const int64_t slots_total = layers[0].k_cache.numel() / kv_size;  // every layer's cache has as many
    for (int64_t t = 0; t < T_; ++t)
      TORCH_CHECK(slots[t] >= 0 && slots[t] < slots_total, "decode_layers: slot ", slots[t], " out of range");
    at::Tensor x = hidden;
    // One set of activations for all layers, made at the first: a dozen tensor allocations and views
    // a layer through the dispatcher cost ~10 us of one stream's ~150 us SmolLM2 layer. The layer's
    // output `down` is read by the next layer's first norm before its down product rewrites it.
    at::Tensor normed = at::empty_like(x), qkv, o, gate_up, act, down, q, k, v;
    at::Tensor attn = at::empty({T_, H, D}, x.options());
    const at::Tensor attn_rows = attn.view({T_, q_size});
    // the queries as contiguous rows for the kernels: row copies into one buffer, where q.contiguous()
    // through the dispatcher took 7-10 us of a 4-row verification's layer, the copies 1-4 (Zen 4)
    const at::Tensor q_rows = T_ == 1 ? at::Tensor() : at::empty({T_, H, D}, x.options());
    for (const Layer& ly : layers) {
      tm_elementwise::rms_norm(normed, x, residual, ly.in_norm, eps);
      const bool fresh_qkv = !qkv.defined();
      qlinear(qkv, ly.qkv, normed, ly.qkv_bias);
      if (fresh_qkv) {
        q = qkv.narrow(1, 0, q_size).view({T_, H, D});
        k = qkv.narrow(1, q_size, kv_size).view({T_, Hkv, D});
        v = qkv.narrow(1, q_size + kv_size, kv_size).view({T_, Hkv, D});
      }
      tm_elementwise::rotary_embedding(q, k, cos, sin, positions);
      if (T_ > 1) copy_rows(q_rows, qkv, q_size);
      const at::Tensor& q_in = T_ == 1 ? q : q_rows;
      if (plain_kv) {
        write_plain_kv(ly.k_cache, ly.v_cache, qkv, slots, q_size, kv_size);
        tm_paged::paged_decode_attention(attn, q_in, ly.k_cache, ly.v_cache, block_tables, seq_lens, scale);
      } else {  // as cpu_paged.py's quantized path: the same values written, the same kernels in the same order
        if (ly.k_scale.numel()) kv_write->call(k, v, ly.k_cache, ly.v_cache, ly.k_scale, ly.v_scale, slot_mapping);
        else write_bf16_kv(ly.k_cache, ly.v_cache, qkv, slots, q_size, kv_size);
        if (!tm_paged::paged_decode_attention_scaled(attn, q_in, ly.k_cache, ly.v_cache, ly.k_scale, ly.v_scale,
                                                     block_tables, seq_lens, scale))
          kv_decode->call(attn, q_in, ly.k_cache, ly.v_cache, ly.k_scale, ly.v_scale, block_tables, seq_lens, scale);
      }
      qlinear(o, ly.o, attn_rows, std::nullopt);
      tm_elementwise::rms_norm(normed, o, residual, ly.post_norm, eps);
      qlinear(gate_up, ly.gate_up, normed, std::nullopt);
      if (!act.defined() || act.size(1) != ly.gate_up.out / 2) act = at::empty({T_, ly.gate_up.out / 2}, x.options());
      tm_elementwise::silu_and_mul(act, gate_up);
      qlinear(down, ly.down, act, std::nullopt);
      x = down;
    }
    return x;
  }
};

}  // namespace tm_layers

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.class_<tm_layers::DecodePlan>("DecodePlan")
      .def(torch::init<std::vector<at::Tensor>, std::vector<int64_t>, int64_t, int64_t, int64_t, int64_t, double,
                       double, std::string, std::string>())
      .def("run", &tm_layers::DecodePlan::run);
}

// Decoder layers of a decode-only step in one call (Llama / Qwen2 with packed quantized weights):
// per layer rms_norm (+ residual) -> qkv qlinear -> rotary -> K/V write -> paged attention ->
// o_proj qlinear -> rms_norm (+ residual) -> gate_up qlinear -> SiLU * up -> down qlinear.
// One stream's token on a small model spends as much in Python as in these kernels (a dozen ops
// per layer, each with its views and allocations); here each layer is the same kernels, called
// from C++ in the same order on the same buffers, so the result is bit for bit that of the
// Python layers (llama.py). The packed GEMV lives in the per-ISA quantized library: it is called
// through the dispatcher by its qualified name.
// Compiled into the kernels library as one unit with paged_attention.cpp and elementwise.cpp.
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>

#include <cstring>
#include <string>

namespace tm_layers {

using QLinearFn = void(at::Tensor, const at::Tensor&, std::vector<at::Tensor>, at::IntArrayRef, at::IntArrayRef,
                       const std::optional<at::Tensor>&, int64_t, int64_t);
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
};

// ints per layer: has_bias, then per linear (qkv, o, gate_up, down): dense_min_rows, act_bits (each
// kind has its own: act_bits.py), n, then n (qtype, rows); tensors per layer: in_norm, post_norm,
// k_cache, v_cache, k_scale, v_scale (empty for a plain cache, or a bf16 one under fp32), [qkv bias],
// shards in order.
struct LayerReader {
  const std::vector<at::Tensor>& t;
  at::IntArrayRef ints;
  size_t ti = 0, ii = 0;
  Packed linear() {
    Packed p;
    p.dense_min_rows = ints[ii++];
    p.act_bits = ints[ii++];
    const int64_t n = ints[ii++];
    for (int64_t s = 0; s < n; ++s) {
      p.w.push_back(t[ti++]);
      p.qtypes.push_back(ints[ii++]);
      p.rows.push_back(ints[ii++]);
      p.out += p.rows.back();
    }
    return p;
  }
};

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

// Returns the last layer's MLP output; residual is updated in place (pass zeros before the first
// layer: x + 0 is x, so the first norm sees x itself, as in llama.py).
at::Tensor decode_layers(at::Tensor hidden, at::Tensor residual, const at::Tensor& positions, const at::Tensor& cos,
                         const at::Tensor& sin, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                         const at::Tensor& seq_lens, std::vector<at::Tensor> tensors, at::IntArrayRef ints,
                         int64_t num_layers, int64_t H, int64_t Hkv, int64_t D, double eps, double scale,
                         std::string qlinear_op, std::string kv_ops) {
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous() && residual.is_contiguous() &&
                  residual.sizes() == hidden.sizes() && residual.scalar_type() == hidden.scalar_type(),
              "decode_layers: hidden and residual must be contiguous [T, hidden] of one dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == hidden.size(0),
              "decode_layers: one int64 slot per token");
  auto& dispatcher = c10::Dispatcher::singleton();
  const auto op = dispatcher.findSchemaOrThrow(qlinear_op.c_str(), "").typed<QLinearFn>();
  // kv_ops: the quantized KV cache kernels' namespace, empty for a cache in the model's dtype
  const bool plain_kv = kv_ops.empty();
  std::optional<c10::TypedOperatorHandle<KVWriteFn>> kv_write;
  std::optional<c10::TypedOperatorHandle<KVDecodeFn>> kv_decode;
  if (!plain_kv) {
    kv_write = dispatcher.findSchemaOrThrow((kv_ops + "::kv_write_quant").c_str(), "").typed<KVWriteFn>();
    kv_decode = dispatcher.findSchemaOrThrow((kv_ops + "::paged_decode_attention_q").c_str(), "").typed<KVDecodeFn>();
  }
  auto qlinear = [&](at::Tensor& y, const Packed& p, const at::Tensor& x, const std::optional<at::Tensor>& bias) {
    if (!y.defined() || y.size(1) != p.out) y = at::empty({x.size(0), p.out}, x.options());
    op.call(y, x, p.w, p.qtypes, p.rows, bias, p.dense_min_rows, p.act_bits);
  };
  const int64_t T_ = hidden.size(0), q_size = H * D, kv_size = Hkv * D;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  TORCH_CHECK(tensors.size() > 2, "decode_layers: no layers");
  for (int64_t t = 0, slots_total = tensors[2].numel() / kv_size; t < T_; ++t)  // every layer's cache has as many
    TORCH_CHECK(slots[t] >= 0 && slots[t] < slots_total, "decode_layers: slot ", slots[t], " out of range");
  LayerReader rd{tensors, ints};
  at::Tensor x = hidden;
  // One set of activations for all layers, made at the first: a dozen tensor allocations and views
  // a layer through the dispatcher cost ~10 us of one stream's ~150 us SmolLM2 layer. The layer's
  // output `down` is read by the next layer's first norm before its down product rewrites it.
  at::Tensor normed = at::empty_like(x), qkv, o, gate_up, act, down, q, k, v;
  at::Tensor attn = at::empty({T_, H, D}, x.options());
  const at::Tensor attn_rows = attn.view({T_, q_size});
  for (int64_t layer = 0; layer < num_layers; ++layer) {
    const at::Tensor &in_norm = tensors[rd.ti], &post_norm = tensors[rd.ti + 1];
    const at::Tensor &k_cache = tensors[rd.ti + 2], &v_cache = tensors[rd.ti + 3];
    const at::Tensor &k_scale = tensors[rd.ti + 4], &v_scale = tensors[rd.ti + 5];
    rd.ti += 6;
    std::optional<at::Tensor> qkv_bias;
    if (rd.ints[rd.ii++]) qkv_bias = tensors[rd.ti++];
    const Packed qkv_p = rd.linear(), o_p = rd.linear(), gu_p = rd.linear(), down_p = rd.linear();
    TORCH_CHECK(qkv_p.out == q_size + 2 * kv_size && k_cache.is_contiguous() && v_cache.is_contiguous() &&
                    k_cache.size(2) == Hkv && k_cache.size(3) == D &&
                    (k_cache.scalar_type() == x.scalar_type()) == plain_kv,
                "decode_layers: layer ", layer, ": qkv size or KV cache layout does not match the heads");

    tm_elementwise::rms_norm(normed, x, residual, in_norm, eps);
    const bool fresh_qkv = !qkv.defined();
    qlinear(qkv, qkv_p, normed, qkv_bias);
    if (fresh_qkv) {
      q = qkv.narrow(1, 0, q_size).view({T_, H, D});
      k = qkv.narrow(1, q_size, kv_size).view({T_, Hkv, D});
      v = qkv.narrow(1, q_size + kv_size, kv_size).view({T_, Hkv, D});
    }
    tm_elementwise::rotary_embedding(q, k, cos, sin, positions);
    const at::Tensor q_rows = T_ == 1 ? q : q.contiguous();
    if (plain_kv) {
      write_plain_kv(k_cache, v_cache, qkv, slots, q_size, kv_size);
      tm_paged::paged_decode_attention(attn, q_rows, k_cache, v_cache, block_tables, seq_lens, scale);
    } else {  // as cpu_paged.py's quantized path: the same kernels in the same order
      if (k_scale.numel()) {
        kv_write->call(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping);
      } else {
        k_cache.view({-1, Hkv, D}).index_copy_(0, slot_mapping, k.to(k_cache.scalar_type()));
        v_cache.view({-1, Hkv, D}).index_copy_(0, slot_mapping, v.to(v_cache.scalar_type()));
      }
      if (!tm_paged::paged_decode_attention_scaled(attn, q_rows, k_cache, v_cache, k_scale, v_scale, block_tables,
                                                   seq_lens, scale))
        kv_decode->call(attn, q_rows, k_cache, v_cache, k_scale, v_scale, block_tables, seq_lens, scale);
    }
    qlinear(o, o_p, attn_rows, std::nullopt);
    tm_elementwise::rms_norm(normed, o, residual, post_norm, eps);
    qlinear(gate_up, gu_p, normed, std::nullopt);
    if (!act.defined() || act.size(1) != gu_p.out / 2) act = at::empty({T_, gu_p.out / 2}, x.options());
    tm_elementwise::silu_and_mul(act, gate_up);
    qlinear(down, down_p, act, std::nullopt);
    x = down;
  }
  TORCH_CHECK(rd.ti == tensors.size() && rd.ii == ints.size(), "decode_layers: layer lists longer than the layers");
  return x;
}

}  // namespace tm_layers

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.def("decode_layers(Tensor hidden, Tensor(a!) residual, Tensor positions, Tensor cos, Tensor sin, "
        "Tensor slot_mapping, Tensor block_tables, Tensor seq_lens, Tensor[] tensors, int[] ints, int num_layers, "
        "int num_heads, int num_kv_heads, int head_dim, float eps, float scale, str qlinear_op, "
        "str kv_ops) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(tokenmill, CPU, m) {
  m.impl("decode_layers", &tm_layers::decode_layers);
}

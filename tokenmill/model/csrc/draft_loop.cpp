// A draft model's passes of one proposal in one call (draft_model.py, through draft_loop.py): per
// pass the embedding, the fused layers (decode_layers.cpp's DecodePlan), the final norm, the LM head
// (packed), each row's argmax and its probability, then the p_min test; the next pass feeds each
// request's draft back. The same kernels in the same order on the same shapes as the Python loop, so
// the drafts are bit for bit the same. Between a drafted token and its next pass the Python loop
// spent ~0.4 ms of one stream in views, metadata and dispatch: 4-6% of a 0.5B int4 draft's pass.
// Compiled after decode_layers.cpp and sampling.cpp in the one unit of the kernels library.
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>
#include <ATen/ops/zeros_like.h>

namespace tm_draft {

using EmbeddingFn = void(at::Tensor, const at::Tensor&, const at::Tensor&, int64_t, int64_t);

template <typename Fn>
c10::TypedOperatorHandle<Fn> find(const std::string& name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name.c_str(), "").typed<Fn>();
}

struct DraftLoop : torch::CustomClassHolder {
  c10::intrusive_ptr<tm_layers::DecodePlan> plan;
  at::Tensor embed, norm, cos, sin, vocab_ids;  // vocab_ids empty: the head scores every token
  int64_t embed_qtype, block_size;
  double eps;
  tm_layers::Packed head;
  c10::TypedOperatorHandle<tm_layers::QLinearFn> head_qlinear;
  c10::TypedOperatorHandle<EmbeddingFn> embedding_op;

  // head_ints and head_weights: the head's Packed::read lists
  DraftLoop(c10::intrusive_ptr<tm_layers::DecodePlan> plan_, at::Tensor embed_, int64_t embed_qtype_,
            std::string embedding_name, at::Tensor norm_, double eps_, std::vector<at::Tensor> head_weights,
            std::vector<int64_t> head_ints, std::string qlinear_name, at::Tensor vocab_ids_, at::Tensor cos_,
            at::Tensor sin_, int64_t block_size_)
      : plan(std::move(plan_)), embed(embed_), norm(norm_), cos(cos_), sin(sin_), vocab_ids(vocab_ids_),
        embed_qtype(embed_qtype_), block_size(block_size_), eps(eps_),
        head_qlinear(find<tm_layers::QLinearFn>(qlinear_name)), embedding_op(find<EmbeddingFn>(embedding_name)) {
    size_t ii = 0, ti = 0;
    head = tm_layers::Packed::read(
        [&] {
          TORCH_CHECK(ii < head_ints.size(), "DraftLoop: fewer head ints than its shards need");
          return head_ints[ii++];
        },
        [&] {
          TORCH_CHECK(ti < head_weights.size(), "DraftLoop: fewer head tensors than its shards need");
          return head_weights[ti++];
        });
    TORCH_CHECK(ii == head_ints.size() && ti == head_weights.size(), "DraftLoop: head lists longer than its shards");
    TORCH_CHECK(vocab_ids.numel() == 0 || (vocab_ids.numel() == head.out && vocab_ids.scalar_type() == at::kLong),
                "DraftLoop: one int64 token id per head row");
  }

  at::Tensor embed_rows(const at::Tensor& ids) const {
    at::Tensor x = at::empty({ids.size(0), norm.size(0)}, norm.options());
    embedding_op.call(x, ids, embed, embed_qtype, norm.size(0));
    return x;
  }

  // The first pass feeds `tokens` at `positions`, each request's rows back to back (query_lens, one
  // per request); tables [requests, blocks] holds each request's blocks up to its last draft's slot.
  // A request drafts budgets[r] tokens, or fewer: a draft the model gives less than p_min is its
  // last. Returns [requests, max budget] token ids, -1 after each request's last.
  at::Tensor run(at::Tensor tokens, at::Tensor positions, const at::Tensor& query_lens, const at::Tensor& tables,
                 const at::Tensor& budgets, double p_min) {
    const int64_t R = query_lens.numel(), nb = tables.size(1);
    TORCH_CHECK(tokens.scalar_type() == at::kLong && positions.scalar_type() == at::kLong &&
                    query_lens.scalar_type() == at::kLong && budgets.scalar_type() == at::kLong &&
                    tables.scalar_type() == at::kLong && tables.is_contiguous() && tables.size(0) == R &&
                    budgets.numel() == R && tokens.numel() == positions.numel() && tokens.is_contiguous() &&
                    positions.is_contiguous() && query_lens.is_contiguous() && budgets.is_contiguous(),
                "DraftLoop.run: contiguous int64 tokens, positions, tables [requests, blocks], budgets");
    const int64_t* qlen = query_lens.data_ptr<int64_t>();
    const int64_t* budget = budgets.data_ptr<int64_t>();
    const int64_t* table = tables.data_ptr<int64_t>();
    int64_t max_budget = 0, rows_total = 0;
    for (int64_t r = 0; r < R; ++r) {
      TORCH_CHECK(budget[r] >= 1 && qlen[r] >= 1, "DraftLoop.run: every request feeds a token and drafts one");
      max_budget = std::max(max_budget, budget[r]), rows_total += qlen[r];
    }
    TORCH_CHECK(rows_total == tokens.numel(), "DraftLoop.run: query_lens do not add up to the tokens");
    at::Tensor drafts = at::full({R, max_budget}, -1, tokens.options());
    int64_t* out = drafts.data_ptr<int64_t>();
    std::vector<int64_t> active(R), rows(qlen, qlen + R);  // the requests of this pass, and their rows
    for (int64_t r = 0; r < R; ++r) active[r] = r;
    const auto long_opts = tokens.options();
    for (int64_t pass = 0; !active.empty(); ++pass) {
      const int64_t T_ = tokens.numel();
      const int64_t* pos = positions.data_ptr<int64_t>();
      // every row is a decode query over its request's blocks, seeing the keys up to itself
      int64_t width = 0;
      for (int64_t t = 0; t < T_; ++t) {
        TORCH_CHECK(pos[t] >= 0, "DraftLoop.run: a negative position");
        width = std::max(width, (pos[t] + block_size) / block_size);
      }
      TORCH_CHECK(width <= nb, "DraftLoop.run: a position past the request's blocks");
      at::Tensor slots = at::empty({T_}, long_opts), seq_lens = at::empty({T_}, long_opts);
      at::Tensor row_tables = at::zeros({T_, width}, long_opts);
      int64_t* sl = slots.data_ptr<int64_t>();
      int64_t* len = seq_lens.data_ptr<int64_t>();
      int64_t* rt = row_tables.data_ptr<int64_t>();
      for (int64_t a = 0, t = 0; a < static_cast<int64_t>(active.size()); ++a) {
        const int64_t* tab = table + active[a] * nb;
        for (int64_t j = 0; j < rows[a]; ++j, ++t) {
          sl[t] = tab[pos[t] / block_size] * block_size + pos[t] % block_size;
          len[t] = pos[t] + 1;
          std::memcpy(rt + t * width, tab, (pos[t] / block_size + 1) * sizeof(int64_t));
        }
      }
      at::Tensor x = embed_rows(tokens);
      at::Tensor residual = at::zeros_like(x);
      x = plan->run(x, residual, positions, cos, sin, slots, row_tables, seq_lens);
      at::Tensor hidden = at::empty_like(x);
      tm_elementwise::rms_norm(hidden, x, residual, norm, eps);
      if (T_ > static_cast<int64_t>(active.size())) {  // the first pass: each request's last row
        at::Tensor last = at::empty({static_cast<int64_t>(active.size()), hidden.size(1)}, hidden.options());
        const int64_t bytes = hidden.size(1) * hidden.element_size();
        for (int64_t a = 0, t = 0; a < static_cast<int64_t>(active.size()); t += rows[a], ++a)
          std::memcpy(static_cast<char*>(last.data_ptr()) + a * bytes,
                      static_cast<const char*>(hidden.data_ptr()) + (t + rows[a] - 1) * bytes, bytes);
        hidden = last;
      }
      at::Tensor logits = at::empty({hidden.size(0), head.out}, hidden.options().dtype(at::kFloat));
      head.call(head_qlinear, logits, hidden, std::nullopt);
      auto [picked, prob] = tm_sampling::argmax_prob_rows(logits);
      const int64_t* pk = picked.data_ptr<int64_t>();
      const float* pr = prob.data_ptr<float>();
      const int64_t* ids = vocab_ids.numel() ? vocab_ids.data_ptr<int64_t>() : nullptr;
      std::vector<int64_t> next_active, next_tokens, next_positions;
      for (int64_t a = 0, t = 0; a < static_cast<int64_t>(active.size()); t += rows[a], ++a) {
        const int64_t r = active[a], tok = ids ? ids[pk[a]] : pk[a];
        out[r * max_budget + pass] = tok;
        if (pass + 1 < budget[r] && (p_min <= 0 || pr[a] >= static_cast<float>(p_min))) {  // NaN: the last
          next_active.push_back(r);
          next_tokens.push_back(tok);
          next_positions.push_back(pos[t + rows[a] - 1] + 1);
        }
      }
      active.swap(next_active);
      rows.assign(active.size(), 1);
      const int64_t n = active.size();
      tokens = at::empty({n}, long_opts), positions = at::empty({n}, long_opts);
      std::copy(next_tokens.begin(), next_tokens.end(), tokens.data_ptr<int64_t>());
      std::copy(next_positions.begin(), next_positions.end(), positions.data_ptr<int64_t>());
    }
    return drafts;
  }
};

}  // namespace tm_draft

TORCH_LIBRARY_FRAGMENT(tokenmill, m) {
  m.class_<tm_draft::DraftLoop>("DraftLoop")
      .def(torch::init<c10::intrusive_ptr<tm_layers::DecodePlan>, at::Tensor, int64_t, std::string, at::Tensor,
                       double, std::vector<at::Tensor>, std::vector<int64_t>, std::string, at::Tensor, at::Tensor,
                       at::Tensor, int64_t>())
      .def("run", &tm_draft::DraftLoop::run);
}

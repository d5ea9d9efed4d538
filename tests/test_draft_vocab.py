"""The draft model's reduced vocabulary (tokenmill/worker/spec_decode/draft_vocab.py): the head
scores the subset's rows as the full head does, and greedy output with speculation stays that of
decoding without it, however small the subset."""

from __future__ import annotations

import gc

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.model.layers.embedding import LMHead
from tokenmill.model.layers.quantization.formats import FORMATS
from tokenmill.model.layers.quantization.weight_only import QuantizeAtLoadMethod
from tokenmill.worker.spec_decode.draft_vocab import ReducedLMHead, draft_vocab_ids


def test_the_subset_is_the_lowest_ids_and_the_special_ones():
    ids = draft_vocab_ids(4, 100, [99, 3, 150, -1])
    assert ids.tolist() == [0, 1, 2, 3, 99]
    assert draft_vocab_ids(200, 10, []).tolist() == list(range(10))


def _head(method, vocab=300, hidden=256, dtype=torch.float32):
    torch.manual_seed(0)
    head = LMHead(vocab, hidden, dtype)
    weight = torch.randn(vocab, hidden)
    if method is not None:
        head.method = method
        method.create_weights(head, hidden, [vocab], dtype, None)
        head.weight.data.copy_(weight)
    else:
        head.weight.data.copy_(weight.to(dtype))
    head.process_weights_after_loading()
    return head


@pytest.mark.parametrize("kind", ["dense-fp32", "dense-bf16", "int4"])
def test_reduced_head_scores_the_rows_of_the_full_head(kind):
    if kind == "int4":
        head = _head(QuantizeAtLoadMethod(FORMATS["I4_G128"].id, None, 16))
    else:
        head = _head(None, dtype=torch.float32 if kind == "dense-fp32" else torch.bfloat16)
    ids = draft_vocab_ids(100, 300, [250, 299])
    reduced = ReducedLMHead(head, ids)
    x = torch.randn(3, 256).to(head.dtype)
    full, sub = head(x), reduced(x)
    assert sub.shape == (3, len(ids)) and sub.dtype == torch.float32
    if kind == "int4":  # requantized from the dequantized rows: the same int4 grid
        torch.testing.assert_close(sub, full[:, ids], rtol=1e-3, atol=1e-2)
    else:
        torch.testing.assert_close(sub, full[:, ids], rtol=1e-5, atol=1e-4)


def test_reduced_head_keeps_the_full_heads_outlier_channels():
    """A packed head with 8-bit codes and outlier channels (act_bits.py): the reduced head leaves the
    same columns out of its codes and adds them back from its own rows, so a few columns 40x the
    others' size cost it no more accuracy than they cost the full head."""
    head = _head(QuantizeAtLoadMethod(FORMATS["I4_G128"].id, None, 8))
    cols = [3, 77, 200]
    head.method.set_outliers(head, cols)
    ids = draft_vocab_ids(100, 300, [250, 299])
    reduced = ReducedLMHead(head, ids)
    got, _ = reduced.method.outliers(reduced)
    assert got is not None and got.tolist() == cols
    torch.manual_seed(1)
    x = torch.randn(5, 256)
    x[:, cols] *= 40
    exact = x @ torch.from_numpy(_dense(head)).t()
    full, sub = head(x)[:, ids], reduced(x)
    torch.testing.assert_close(sub, full, rtol=1e-3, atol=5e-2)  # the same int4 grid, requantized
    # without the channels, the 8-bit codes of those rows lose what the channels kept
    reduced.method.set_outliers(reduced, None)
    plain = reduced(x)
    assert (plain - exact[:, ids]).abs().mean() > 2 * (sub - exact[:, ids]).abs().mean()


def _dense(head):
    out = torch.empty(head.q_out, head.q_in)
    head.method.ops.dequantize(out, head.q_views[0], head.method.qtypes[0], head.q_in)
    return out.numpy()


@pytest.mark.parametrize("vocab_size", [512, 8192])
def test_greedy_identical_with_a_reduced_draft_vocabulary(vocab_size, smol_path):
    """SmolLM2 (49k tokens) drafting for itself, its head cut to 512 (most drafts miss the target's
    token) or 8192 tokens: every output token is still the target's."""
    args = dict(model=str(smol_path), dtype="float32", max_model_len=512, kv_cache_memory="64MiB", progress=False)
    prompts = ["def fibonacci(n):\n    ", "The capital of France is", "import numpy as np\n\nx = np.",
               "Once upon a time, in a small village,"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    llm = LLM(**args)
    ref = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    del llm
    spec = f'{{"model": "{smol_path}", "num_speculative_tokens": 4, "draft_vocab_size": {vocab_size}, ' \
           f'"draft_p_min": 0, "adaptive": false}}'
    llm = LLM(speculative_config=spec, **args)
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outs == ref
    stats = llm.engine.core.stats().spec_decoding
    assert stats.num_accepted_tokens > 0
    if vocab_size == 512:  # tokens outside the subset are never drafted, so many drafts miss
        assert any(t >= 512 for r in ref for t in r) and stats.num_accepted_tokens < stats.num_draft_tokens
    del llm
    gc.collect()

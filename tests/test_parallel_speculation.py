"""Speculative decoding under parallelism: TP=2 with n-gram drafts, PP=2 with a draft model; greedy
tokens as one process without speculation."""

from __future__ import annotations

import gc

import pytest

from tokenmill import LLM, SamplingParams

from .parallel_utils import GREEDY, STRESS, assert_same, close, kv_bytes, random_prompts, run_greedy

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'


@pytest.mark.slow
def test_tp2_ngram_speculation_greedy_identical_to_tp1():
    """Speculative decoding under TP=2 (each rank drafts and verifies alike, the last one reports):
    SmolLM2's greedy tokens without speculation in one process, with drafts accepted. (The tiny
    random models never repeat themselves, so an n-gram proposer drafts nothing for them.)"""
    from tests.test_engine_consistency import _prompts as text_prompts

    args = dict(dtype="float32", quantization="none", kv_cache_memory="64MiB", max_model_len=512, progress=False)
    params = SamplingParams(temperature=0, max_tokens=32)
    llm = LLM(**args)
    prompts = text_prompts(llm.get_tokenizer())[:16]
    ref = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    del llm
    gc.collect()
    llm = LLM(tensor_parallel_size=2, speculative_config=NGRAM, **args)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        core = llm.engine.core
        spec = core.stats().spec_decoding
        assert spec is not None and spec.num_accepted_tokens > 0
        assert core.kv.pool.num_free_blocks == core.kv.num_blocks
    finally:
        close(llm)
    assert_same(ref, got)


@pytest.mark.parametrize("draft", ["itself", "another"])
def test_pp2_speculation_greedy_identical_to_pp1(draft, tiny_llama_dir, tiny_qwen2_dir):
    """Speculative decoding over two stages: both run the drafts through their layers, the last one
    verifies and drafts (the draft model whole there), the first gets the kept tokens with the next
    step. The tiny Llama drafting for itself keeps nearly every draft; a random Qwen2 with the same
    vocabulary has nearly all rejected. Greedy tokens as one process without speculation, with chunked
    prefill and preemption."""
    model = str(tiny_llama_dir)
    prompts = random_prompts(48)
    drafter = model if draft == "itself" else str(tiny_qwen2_dir)
    ref, _ = run_greedy(model, 1, kv_bytes(3, 2, 64), prompts)
    # the draft's K/V (3 layers, 2 KV heads, like the target's) share the target's blocks
    llm = LLM(model, progress=False, pipeline_parallel_size=2, kv_cache_memory=2 * kv_bytes(3, 2, 64, blocks=28),
              # draft_p_min 0: the random tiny models are never confident, and the test needs drafts
              speculative_config=f'{{"model": "{drafter}", "num_speculative_tokens": 3, "adaptive": false, '
                                 f'"draft_p_min": 0}}', **STRESS)
    try:
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        core = llm.engine.core
        stats = core.stats().spec_decoding
        assert stats is not None and stats.num_draft_tokens >= len(prompts)
        if draft == "itself":
            assert stats.acceptance_rate > 0.8
        else:
            assert stats.acceptance_rate < 0.2
        assert core.scheduler.num_preemptions > 0
        assert core.kv.pool.num_free_blocks == core.kv.num_blocks
    finally:
        close(llm)
    assert_same(ref, got)

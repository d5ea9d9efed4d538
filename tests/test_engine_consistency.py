"""Greedy results never depend on batch composition, chunk size, prefix hits or preemption.

64 requests of mixed lengths (half sharing a long system prompt) run concurrently under several
engine configurations; in fp32 (dense weights), and in bf16 with `batch_invariant=True` (the GGUF's
own packed weights: every product takes the packed kernel), every request's tokens
equal its tokens when run alone. In default bf16, batch shape changes rounding, so the test checks
the weaker property that holds there: every batched greedy token is, teacher-forced through the
model alone, within a near-tie of the top token. An int8 KV cache in batch-invariant mode is exact
too, logprobs included.
"""

from __future__ import annotations

import gc
import random

import pytest

from tokenmill import LLM, SamplingParams

SYSTEM = ("You are a meticulous assistant. Answer precisely, cite your reasoning, and keep answers short. "
          "Never invent facts; say you do not know instead. ") * 6
TOPICS = ["the moon landing", "photosynthesis", "a binary search", "the French revolution", "prime numbers",
          "how vaccines work", "the water cycle", "black holes", "sorting algorithms", "the stock market",
          "plate tectonics", "the printing press", "neural networks", "volcanoes", "the Roman roads", "jazz"]
PARAMS = SamplingParams(temperature=0, max_tokens=24)


def _prompts(tok, n=64):
    rng = random.Random(0)
    prompts = []
    for i in range(n):
        topic = TOPICS[i % len(TOPICS)]
        body = f"Explain {topic} in simple words." + " Please be thorough." * rng.randint(0, 30)
        text = (SYSTEM + body) if i % 2 == 0 else body
        ids = tok.encode(text)[: rng.choice([5, 17, 64, 200, 400])]
        prompts.append(ids)
    return prompts


def _alone(llm: LLM, prompts: list[list[int]]) -> list:
    """Each prompt's greedy completion run alone; a prompt that repeats (short cuts of the shared
    system prompt or of one topic: 21 of the 64) runs once."""
    done: dict[tuple[int, ...], object] = {}
    for p in prompts:
        if tuple(p) not in done:
            done[tuple(p)] = llm.generate([p], PARAMS, use_tqdm=False)[0].outputs[0]
    return [done[tuple(p)] for p in prompts]


@pytest.fixture(scope="module")
def reference():
    llm = LLM(dtype="float32", quantization="none", enable_prefix_caching=False, kv_cache_memory="128MiB",
              max_model_len=512, progress=False)
    prompts = _prompts(llm.get_tokenizer())
    alone = _alone(llm, prompts)
    del llm
    gc.collect()
    return prompts, alone


CONFIGS = {
    "prefix-cache-on": dict(enable_prefix_caching=True),
    "prefix-cache-off": dict(enable_prefix_caching=False),  # prompts in one chunk (the 2048-token default)
    "chunk-16": dict(max_num_batched_tokens=16),
    # ~700 tokens of KV for 64 requests of up to 424 tokens: constant preemption
    "tiny-pool": dict(kv_cache_memory=45 * 16 * 46080, max_model_len=512),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_identical_alone_and_among_64(reference, name):
    prompts, alone = reference
    args = dict(dtype="float32", quantization="none", kv_cache_memory="128MiB", max_model_len=512, max_num_seqs=64)
    args.update(CONFIGS[name])
    llm = LLM(progress=False, **args)
    outs = llm.generate(prompts, PARAMS, use_tqdm=False)
    for i, (out, ref) in enumerate(zip(outs, alone)):
        assert out.outputs[0].token_ids == ref.token_ids, f"request {i} ({len(prompts[i])} prompt tokens)"
        assert out.outputs[0].finish_reason == ref.finish_reason
    core = llm.engine.core
    if name == "tiny-pool":
        assert core.scheduler.num_preemptions > 0
    if name == "prefix-cache-on":
        assert core.kv.prefix_hits > 0
    assert core.kv.pool.num_free_blocks == core.kv.num_blocks  # nothing leaked
    assert not core.worker.runner.requests  # the runner dropped every finished request's state
    del llm
    gc.collect()


@pytest.fixture(scope="module")
def reference_bf16_invariant():
    llm = LLM(dtype="bfloat16", batch_invariant=True, enable_prefix_caching=False, kv_cache_memory="128MiB",
              max_model_len=512, progress=False)
    prompts = _prompts(llm.get_tokenizer())
    alone = _alone(llm, prompts)
    del llm
    gc.collect()
    return prompts, alone


@pytest.mark.slow
@pytest.mark.parametrize("name", ["prefix-cache-on", "chunk-16", "tiny-pool"])
def test_bf16_batch_invariant_mode_is_exact(reference_bf16_invariant, name):
    prompts, alone = reference_bf16_invariant
    args = dict(dtype="bfloat16", batch_invariant=True, kv_cache_memory="128MiB", max_model_len=512, max_num_seqs=64)
    args.update(CONFIGS[name])
    if name == "tiny-pool":
        args["kv_cache_memory"] = 45 * 16 * 23040  # bf16: half the bytes per token of fp32
    llm = LLM(progress=False, **args)
    outs = llm.generate(prompts, PARAMS, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [a.token_ids for a in alone]
    if name == "tiny-pool":
        assert llm.engine.core.scheduler.num_preemptions > 0
    del llm
    gc.collect()


@pytest.mark.slow
def test_bf16_batched_greedy_is_within_near_ties(smol_bf16):
    prompts = _prompts(smol_bf16.get_tokenizer())[:32]
    outs = smol_bf16.generate(prompts, PARAMS, use_tqdm=False)
    worst = 0.0
    for p, out in zip(prompts, outs):
        gen = out.outputs[0].token_ids
        scored = smol_bf16.generate([p + gen], SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
        for j, t in enumerate(gen):
            pos = scored.prompt_logprobs[len(p) + j]
            best = max(lp.logprob for lp in pos.values())
            worst = max(worst, best - pos[t].logprob)
    assert worst <= 0.5, worst  # nats between the batched token and the alone top token


@pytest.mark.slow
def test_an_int8_kv_cache_is_exact_under_chunking_prefix_hits_and_preemption():
    """batch_invariant: every token reads K/V as the cache stores them (its codes and scale), so with
    an int8 cache too, 16 of the requests alone and among each other, with prefix caching and
    16-token chunks or a pool that preempts, give the same tokens and logprobs bit for bit. (Without
    it, rounding that differs with the batch flips a code now and then: the cache amplifies it.)"""
    base = dict(dtype="float32", quantization="none", kv_cache_dtype="int8", batch_invariant=True,
                max_model_len=320, progress=False)  # the 16 prompts: up to 270 tokens, and 24 new ones
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=0)
    llm = LLM(kv_cache_memory="64MiB", enable_prefix_caching=False, **base)
    prompts = _prompts(llm.get_tokenizer())[:16]
    alone = [llm.generate([p], params, use_tqdm=False)[0].outputs[0] for p in prompts]
    per_token = llm.engine.core.worker.kv_bytes_per_token
    del llm
    gc.collect()
    for cfg in (dict(max_num_batched_tokens=16), dict(kv_cache_memory=30 * 16 * per_token)):
        llm = LLM(**{"kv_cache_memory": "64MiB", "enable_prefix_caching": True, **cfg, **base})
        outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        for i, (o, a) in enumerate(zip(outs, alone)):
            assert o.token_ids == a.token_ids, (cfg, i)
            assert [d[t].logprob for d, t in zip(o.logprobs, o.token_ids)] == \
                [d[t].logprob for d, t in zip(a.logprobs, a.token_ids)], (cfg, i)
        core = llm.engine.core
        assert core.kv.prefix_hits > 0 and (core.scheduler.num_preemptions > 0 or "kv_cache_memory" not in cfg)
        assert core.kv.pool.num_free_blocks == core.kv.num_blocks
        del llm
        gc.collect()

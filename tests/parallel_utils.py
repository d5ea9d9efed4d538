"""Shared by the parallelism tests: random prompts, a stress configuration (chunked prefill and
constant preemption), and a greedy run that checks nothing leaked."""

from __future__ import annotations

import gc
import random

from tokenmill import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12)

# chunks of 16 tokens, and a pool of ~40 blocks for 64 requests: constant preemption
STRESS = dict(dtype="float32", quantization="none", max_num_batched_tokens=64, max_num_seqs=64, max_model_len=256,
              enable_prefix_caching=True)


def random_prompts(n=64, vocab=49152, seed=0):
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab) for _ in range(40)]
    prompts = []
    for i in range(n):
        body = [rng.randrange(3, vocab) for _ in range(rng.choice([3, 17, 60, 150]))]
        prompts.append(shared + body if i % 2 == 0 else body)
    return prompts


def run_greedy(model, tp, kv_bytes, prompts, **kw):
    """Greedy tokens of every prompt under STRESS, and the number of preemptions."""
    llm = LLM(model, progress=False, tensor_parallel_size=tp, kv_cache_memory=kv_bytes, **STRESS, **kw)
    try:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        core = llm.engine.core
        assert core.kv.pool.num_free_blocks == core.kv.num_blocks  # nothing leaked
        return [o.outputs[0].token_ids for o in outs], core.scheduler.num_preemptions
    finally:
        close(llm)


def close(llm) -> None:
    """Stop the engine and its ranks (the caller's reference to `llm` goes when it returns)."""
    llm.engine.shutdown()
    gc.collect()


def assert_same(ref: list, got: list) -> None:
    assert len(ref) == len(got)
    for i, (a, b) in enumerate(zip(ref, got)):
        assert a == b, f"request {i}"


def kv_bytes(layers, kv_heads, head_dim, blocks=40):
    return blocks * 16 * 2 * layers * kv_heads * head_dim * 4

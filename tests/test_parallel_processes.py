"""The processes of a parallel engine: a killed rank is a clean error (in the engine, and from a real
server: a 500, then /health 503); the engine core in its own process drives TP=2 ranks alike; a
server stopped or killed leaves no core process and no rank behind."""

from __future__ import annotations

import os
import signal
import time

import pytest

from tokenmill import LLM
from tokenmill.errors import WorkerDiedError

from .parallel_utils import GREEDY, STRESS, assert_same, close, kv_bytes, random_prompts, run_greedy


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


@pytest.mark.slow
def test_tp2_with_the_core_in_its_own_process_identical_to_tp1(tiny_llama_dir):
    """TP=2 ranks under an engine core that runs in its own process (as `tokenmill serve` runs it)."""
    prompts = random_prompts()
    ref, _ = run_greedy(str(tiny_llama_dir), 1, kv_bytes(3, 2, 64), prompts)
    llm = LLM(str(tiny_llama_dir), progress=False, tensor_parallel_size=2, kv_cache_memory=kv_bytes(3, 2, 64),
              engine_core_process=True, **STRESS)
    try:
        assert not llm.engine.core_client.runs_in_process
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        assert llm.engine.scheduler_stats().num_preemptions > 0
    finally:
        close(llm)
    assert_same(ref, got)


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

"""The engine core in its own process (engine/core_proc.py, engine/core_client.py): the same results
as in process, and clean failure when that process dies or when the front end does."""

from __future__ import annotations

import asyncio
import gc
import json
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest

from tests.server_utils import ServerProcess, ipc_folders
from tokenmill import LLM, SamplingParams
from tokenmill.config import EngineConfig

ENGINE = dict(dtype="float32", quantization="none", kv_cache_memory="128MiB", max_model_len=512, max_num_seqs=64,
              progress=False)
WORDS = ["river", "engine", "stone", "garden", "quiet", "orbit", "paper", "signal", "copper", "harbor"]


def _mixed_requests(n=64):
    """64 requests of mixed prompt lengths and parameters: greedy, seeded sampling, logprobs, n=2,
    stop strings, penalties, prompt logprobs."""
    rng = random.Random(1)
    prompts, params = [], []
    for i in range(n):
        prompts.append("Write about " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 120))))
        kind = i % 6
        if kind == 0:
            p = SamplingParams(temperature=0, max_tokens=rng.randint(1, 32))
        elif kind == 1:
            p = SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=16)
        elif kind == 2:
            p = SamplingParams(temperature=0, max_tokens=12, logprobs=3)
        elif kind == 3:
            p = SamplingParams(temperature=1.0, n=2, seed=100 + i, max_tokens=10)
        elif kind == 4:
            p = SamplingParams(temperature=0, max_tokens=24, stop=["."], repetition_penalty=1.2)
        else:
            p = SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=2)
        params.append(p)
    return prompts, params


# fp32 logprobs move by up to ~1.5e-5 with the batch a request shares steps with (which requests
# arrived before a step, where a prefill chunk ends, prefix-cache hits): the GEMMs' and attention's
# sums run in another order (test_arrival_order.py). Tokens, ranks and top-N ids must still be equal.
LOGPROB_TOL = 1e-4


def _summary(outputs):
    rows = []
    for o in outputs:
        for c in o.outputs:
            rows.append((o.request_id, c.index, c.text, c.token_ids, c.finish_reason))
    return rows


def _logprobs(outputs):
    return [(o.request_id, [c.logprobs for c in o.outputs], [c.cumulative_logprob for c in o.outputs],
             o.prompt_logprobs) for o in outputs]


def assert_positions_close(a, b, what: str, tol: float = LOGPROB_TOL) -> None:
    """Lists of {token id: Logprob} (None where a position has none): the same ids and ranks, values
    within `tol`."""
    assert (a is None) == (b is None) and len(a or ()) == len(b or ()), what
    for j, (x, y) in enumerate(zip(a or (), b or ())):
        assert (x is None) == (y is None), f"{what}, position {j}"
        if x is None:
            continue
        assert x.keys() == y.keys(), f"{what}, position {j}: {x} != {y}"
        for t in x:
            assert x[t].rank == y[t].rank and abs(x[t].logprob - y[t].logprob) <= tol, \
                f"{what}, position {j}, token {t}: {x[t]} != {y[t]}"


def assert_logprobs_close(a, b, tol: float = LOGPROB_TOL) -> None:
    """`_logprobs` of two runs of the same requests."""
    for (rid, lps_a, cum_a, prompt_a), (_, lps_b, cum_b, prompt_b) in zip(a, b):
        for i, (x, y) in enumerate(zip(lps_a, lps_b)):
            assert_positions_close(x, y, f"request {rid} sample {i} logprobs", tol)
        for x, y in zip(cum_a, cum_b):
            assert (x is None) == (y is None) and (x is None or abs(x - y) <= 32 * tol), rid
        assert_positions_close(prompt_a, prompt_b, f"request {rid} prompt logprobs", tol)


@pytest.mark.slow
def test_multiprocess_core_matches_in_process():
    # in a fresh interpreter: after some other tests in the same pytest process the in-process
    # engine's logprobs came out different (tokens equal), a leak between tests not yet found
    code = "from tests.test_core_process import compare_in_and_out_of_process as f; f()"
    run = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parent.parent,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]


def compare_in_and_out_of_process():
    prompts, params = _mixed_requests()
    results = {}
    for multiprocess in (False, True):
        llm = LLM(engine_core_process=multiprocess, **ENGINE)
        assert llm.engine.core_client.runs_in_process is not multiprocess
        outs = llm.generate(prompts, params, use_tqdm=False)
        results[multiprocess] = _summary(outs), _logprobs(outs)
        if multiprocess:
            proc = llm.engine.core_client.proc
            assert proc.is_alive()
            llm.engine.shutdown()
            assert not proc.is_alive()
        del llm
        gc.collect()
    in_proc, multi = results[False], results[True]
    assert len(in_proc[0]) == 64 + 64 // 6 + 1  # the n=2 requests give two completions each
    for a, b in zip(in_proc[0], multi[0]):
        assert a == b, f"request {a[0]} differs"
    # generate() hands the core its whole batch in one message, so both cores step through the same
    # batches: the same sums in the same order, bit for bit
    assert_logprobs_close(in_proc[1], multi[1], tol=0.0)


def _core_pid(server: ServerProcess) -> int:
    kids = [p for p in psutil.Process(server.proc.pid).children()
            if any("spawn_main" in part for part in p.cmdline())]
    assert len(kids) == 1, kids
    return kids[0].pid


def _stream(url: str, results: list, i: int) -> None:
    body = {"prompt": f"Count slowly to one hundred, request {i}:", "max_tokens": 400, "temperature": 0,
            "ignore_eos": True, "stream": True}
    events, status = [], None
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as r:
            status = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))
    except httpx.HTTPError as e:
        events.append({"transport_error": repr(e)})
    results[i] = (status, events)


@pytest.mark.slow
def test_core_death_fails_requests_cleanly_and_health_turns_503():
    server = ServerProcess("--dtype", "float32").wait_ready()
    try:
        core = _core_pid(server)
        results: list = [None] * 4
        threads = [threading.Thread(target=_stream, args=(server.url, results, i)) for i in range(4)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while server.metrics().get("tokenmill:generation_tokens_total", 0) < 40 and time.monotonic() < deadline:
            time.sleep(0.1)
        psutil.Process(core).send_signal(signal.SIGKILL)
        for t in threads:
            t.join(30)
            assert not t.is_alive(), "a stream hung after the core died"
        for status, events in results:
            assert status == 200  # streaming: the headers went out before the core died
            assert any("choices" in e for e in events)  # some tokens streamed first
            err = events[-1].get("error")
            assert err is not None, events[-1]
            assert "engine core process" in err["message"] and "SIGKILL" in err["message"]
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=10)
        assert r.status_code in (500, 503) and "error" in r.json()
        assert httpx.get(server.url + "/health", timeout=5).status_code == 503
        assert server.stop() == 0
    finally:
        server.stop(signal.SIGKILL)


@pytest.mark.slow
def test_core_death_fails_a_waiting_non_streaming_request_with_500():
    server = ServerProcess("--dtype", "float32").wait_ready()
    try:
        core = _core_pid(server)
        box = {}

        def call():
            box["r"] = httpx.post(server.url + "/v1/completions", timeout=60, json={
                "prompt": "Tell a long story", "max_tokens": 400, "temperature": 0, "ignore_eos": True})

        t = threading.Thread(target=call)
        t.start()
        time.sleep(1.5)
        psutil.Process(core).kill()
        t.join(30)
        assert not t.is_alive()
        r = box["r"]
        assert r.status_code == 500
        assert "engine core process" in r.json()["error"]["message"]
    finally:
        server.stop()  # not SIGKILL: with its core dead, only the front end can remove their sockets


@pytest.mark.slow
def test_no_orphan_core_when_the_front_end_is_killed():
    server = ServerProcess().wait_ready()
    core = psutil.Process(_core_pid(server))
    folders = ipc_folders(server.proc.pid)
    assert len(folders) == 1 and all(f.is_dir() for f in folders), folders
    server.stop(signal.SIGKILL)
    core.wait(timeout=10)  # the core sees its parent's sentinel and exits
    assert not any(f.exists() for f in folders), "the killed front end's sockets were left in /tmp"


@pytest.mark.slow
def test_sigterm_stops_the_core_process():
    server = ServerProcess().wait_ready()
    core = psutil.Process(_core_pid(server))
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 4}, timeout=60)
    assert r.status_code == 200
    assert server.stop(signal.SIGTERM) == 0
    core.wait(timeout=10)
    # the core froze its start-up objects (the model's) out of the garbage collector's full passes
    frozen = re.search(r"froze (\d+) start-up objects", server.log())
    assert frozen and int(frozen.group(1)) > 50_000, server.log()[-2000:]


def test_load_tracker_counts_what_a_stale_report_leaves_out():
    """A report that predates requests already sent must not count them as taken in (the race
    in the load the SLO gate reads): it says how many sequences the core had received."""
    from tokenmill.core.messages import SchedulerLoad, SchedulerStats
    from tokenmill.engine.load_tracker import LoadTracker

    tracker = LoadTracker()
    for prompt in (10, 20, 30):
        tracker.submitted(prompt, 5, 1)
    tracker.submitted(40, 7, 2)  # n=2: two sequences
    stale = SchedulerStats(1, 0, 0.0, 0, 0, 0, 0, 0, SchedulerLoad(num_running=1, running_context_tokens=10),
                           num_received=1)
    tracker.reported(stale)
    load = tracker.load()
    assert (load.num_running, load.num_waiting) == (1, 4)
    assert (load.waiting_prompt_tokens, load.waiting_decode_tokens) == (20 + 30 + 2 * 40, 5 + 5 + 2 * 7)
    tracker.lost(2)  # the n=2 request was refused before reaching the core
    tracker.reported(SchedulerStats(2, 1, 0.0, 0, 0, 0, 0, 0, SchedulerLoad(2, 1), num_received=3))
    assert tracker.load() == SchedulerLoad(2, 1)


@pytest.mark.slow
def test_async_load_with_a_core_process_counts_every_request_in_flight():
    """With the core in its own process, every request in flight is counted once, running or
    waiting, whenever load() is read: none may vanish between being sent and being reported."""
    from tokenmill.engine.async_engine import AsyncLLMEngine
    from tokenmill.engine.llm_engine import LLMEngine

    kwargs = {k: v for k, v in ENGINE.items() if k != "progress"}
    config = EngineConfig.from_kwargs(**{**kwargs, "max_num_seqs": 2})
    aengine = AsyncLLMEngine(LLMEngine(config, progress=False, multiprocess=True))
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    async def main():
        aengine.start()
        streams, samples = [], []
        try:
            for wave in range(4):
                for i in range(2):
                    streams.append(aengine.generate(f"wave {wave} request {i}: count", params))
                for _ in range(20):
                    load = aengine.load()
                    samples.append((len(streams), load.num_running + load.num_waiting))
                    await asyncio.sleep(0.005)
        finally:
            for s in streams:
                aengine.release_request(s.request_id, abort=True)
            aengine.shutdown()
        wrong = [s for s in samples if s[0] != s[1]]
        assert not wrong, f"{len(wrong)} of {len(samples)} reads miscounted (in flight, counted): {wrong[:5]}"

    asyncio.run(main())

"""`tokenmill serve` started with its own flags, one server per test: an API key, a full queue, an
engine fault, a request timeout, a graceful shutdown."""

from __future__ import annotations

import json
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.server_utils import ServerProcess
from tests.test_server import MODEL, post


def test_api_key():
    srv = ServerProcess("--api-key", "sekret").wait_ready()
    try:
        assert post(srv, "/v1/completions", {"prompt": "x", "max_tokens": 1}).status_code == 401
        bad = post(srv, "/v1/completions", {"prompt": "x"}, headers={"Authorization": "Bearer nope"})
        assert bad.status_code == 401 and bad.json()["error"]["type"] == "authentication_error"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.base_url, api_key="wrong", max_retries=0).models.list()
        ok = openai.OpenAI(base_url=srv.base_url, api_key="sekret").completions.create(model=MODEL, prompt="Hi",
                                                                                       max_tokens=2)
        assert ok.usage.completion_tokens == 2
        assert httpx.get(srv.url + "/health").status_code == 200
        assert httpx.get(srv.url + "/metrics").status_code == 200
    finally:
        srv.stop()


def test_queue_full_is_429_with_retry_after():
    srv = ServerProcess("--max-num-seqs", "1", "--max-queue-len", "2").wait_ready()
    try:
        # 8 requests arrive within milliseconds; 100 tokens (over a second per request) keep the first
        # three in the engine until all 8 have arrived
        body = {"prompt": "Tell a long story.", "max_tokens": 100, "ignore_eos": True}
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda _: post(srv, "/v1/completions", body), range(8)))
        codes = sorted(r.status_code for r in results)
        rejected = [r for r in results if r.status_code == 429]
        assert codes.count(200) >= 3 and rejected, codes
        assert int(rejected[0].headers["Retry-After"]) >= 1
        assert rejected[0].json()["error"]["type"] == "rate_limit_error"
        srv.wait_idle()
    finally:
        srv.stop()


def test_engine_fault_is_500_and_the_server_keeps_serving():
    srv = ServerProcess(env={"TOKENMILL_DEBUG_FAIL_ON_TOKEN": "31999"}).wait_ready()
    try:
        r = post(srv, "/v1/completions", {"prompt": [100, 31999, 200], "max_tokens": 4})
        assert r.status_code == 500 and r.json()["error"]["type"] == "internal_error"
        ok = post(srv, "/v1/completions", {"prompt": "Still alive?", "max_tokens": 4})
        assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
        assert httpx.get(srv.url + "/health").status_code == 200
        srv.wait_idle()
    finally:
        srv.stop()


def test_exclude_tools_when_tool_choice_none():
    srv = ServerProcess("--exclude-tools-when-tool-choice-none").wait_ready()
    try:
        ask = [{"role": "user", "content": "Weather in Paris?"}]
        tool = {"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}}}}
        prompt_tokens = {}
        for name, extra in (("plain", {}), ("none", {"tools": [tool], "tool_choice": "none"}),
                            ("auto", {"tools": [tool]})):
            r = post(srv, "/v1/chat/completions", {"messages": ask, "max_tokens": 1, **extra})
            assert r.status_code == 200, r.text
            prompt_tokens[name] = r.json()["usage"]["prompt_tokens"]
        assert prompt_tokens["none"] == prompt_tokens["plain"] < prompt_tokens["auto"], prompt_tokens
    finally:
        srv.stop()


def test_request_timeout_aborts():
    srv = ServerProcess("--request-timeout", "1").wait_ready()
    try:
        r = post(srv, "/v1/completions", {"prompt": "Go on forever.", "max_tokens": 1500, "ignore_eos": True})
        assert r.status_code == 408 and "timeout" in r.json()["error"]["message"]
        srv.wait_idle()
    finally:
        srv.stop()


def test_graceful_shutdown_lets_the_stream_finish():
    srv = ServerProcess("--shutdown-grace", "60").wait_ready()
    try:
        lines: list[str] = []

        def stream():
            body = {"prompt": "Describe the sea.", "max_tokens": 400, "ignore_eos": True, "stream": True}
            with httpx.stream("POST", srv.base_url + "/completions", json=body, timeout=120) as r:
                lines.extend(line for line in r.iter_lines() if line)

        t = threading.Thread(target=stream)
        t.start()
        while not srv.metrics().get("tokenmill:num_requests_running"):
            time.sleep(0.05)
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        late = post(srv, "/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert late.status_code == 503 and late.json()["error"]["type"] == "service_unavailable"
        assert httpx.get(srv.url + "/ready").status_code == 503
        t.join(120)
        assert srv.proc.wait(60) == 0
        assert lines[-1] == "data: [DONE]"
        texts = [json.loads(line[6:]) for line in lines[:-1]]
        assert texts[-1]["choices"][0]["finish_reason"] == "length"
        assert sum(1 for x in texts if x["choices"][0]["text"]) >= 50
    finally:
        srv.stop()

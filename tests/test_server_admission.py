"""`tokenmill serve --slo ...` (SLO-aware admission) and `--scheduling-policy priority`, on a real
server on loopback. No calibration profile exists in the test's cache, so admission runs on the
roofline model and says so."""

from __future__ import annotations

import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.server_utils import ServerProcess

pytestmark = pytest.mark.slow


def post(server, path, body, **kw):
    return httpx.post(server.url + path, json=body, timeout=300, **kw)


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--slo", "ttft=400ms,tpot=300ms", "--scheduling-policy", "priority",
                        "--max-num-batched-tokens", "512").wait_ready()
    yield srv
    assert srv.stop() == 0, srv.log()
    assert "Traceback" not in srv.log(), srv.log()


def test_a_profile_missing_falls_back_to_the_roofline_with_a_warning(server):
    log = server.log()
    assert "no calibration profile for this machine and model: using the roofline model" in log
    assert "SLO admission (ttft 400 ms, tpot 300 ms) with the roofline" in log


def test_overload_is_rejected_at_once_and_admitted_again_once_drained(server):
    assert post(server, "/v1/completions", {"prompt": "Hello", "max_tokens": 4}).status_code == 200  # idle
    body = {"prompt": list(range(1000, 1400)), "max_tokens": 8, "ignore_eos": True}  # 400-token prompts
    with ThreadPoolExecutor(32) as pool:
        t0 = time.monotonic()
        results = list(pool.map(lambda _: (post(server, "/v1/completions", body), time.monotonic() - t0),
                                range(32)))
    admitted = [r for r, _ in results if r.status_code == 200]
    rejected = [(r, t) for r, t in results if r.status_code == 429]
    assert admitted and rejected and len(admitted) + len(rejected) == 32, [r.status_code for r, _ in results]
    for r, _ in rejected:
        err = r.json()["error"]
        assert err["type"] == "rate_limit_error" and "exceeds the SLO" in err["message"], err
        assert int(r.headers["Retry-After"]) >= 1
    assert all(r.json()["usage"]["completion_tokens"] == 8 for r in admitted)
    # a rejection does not wait for the queue: it comes back before the admitted work is done
    assert min(r.elapsed.total_seconds() for r, _ in rejected) < max(r.elapsed.total_seconds() for r in admitted)
    m = server.wait_idle(60)
    assert m["tokenmill:slo_admission_rejected_total"] == len(rejected)
    assert post(server, "/v1/completions", body).status_code == 200  # drained: admitted again
    # streaming requests are judged before their stream starts: a plain 429, not an SSE error
    with ThreadPoolExecutor(32) as pool:
        streamed = list(pool.map(lambda _: post(server, "/v1/completions", {**body, "stream": True}), range(32)))
    assert {r.status_code for r in streamed} == {200, 429}
    server.wait_idle(60)


def test_priority_on_both_endpoints(server):
    r = post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "priority": -3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
                                              "priority": 7})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "priority": [1]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority"


@pytest.mark.parametrize("flags, message", [
    (["--slo", "e2e=1s"], "NAME ttft and/or tpot"),
    (["--slo", "itl=50ms"], "NAME ttft and/or tpot"),
    (["--slo", "ttft=fast"], "--slo"),
    (["--scheduling-policy", "lifo"], "invalid choice"),
    (["--priority-aging", "-1"], "priority_aging"),
])
def test_bad_flags_exit_with_a_clear_message(flags, message):
    r = subprocess.run([sys.executable, "-m", "tokenmill.entrypoints.cli.main", "serve", *flags],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and message in r.stderr, r.stderr

"""Faults fail only what they touch: an exception while scheduling, detokenizing or stop-checking
one request fails that request alone; a client that never reads stalls nobody; SIGTERM with 64
streams in flight ends every stream with its last token or an explicit error, then exits 0; a
server killed with SIGKILL (even mid kernel build) starts again."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.server_utils import ServerProcess, ipc_folders, private_cache
from tokenmill.model.quant_kernels import variant_for
from tokenmill.utils.cpu import active_isa

pytestmark = pytest.mark.slow
FAULTS = {"schedule": 31999, "detokenize": 31998, "stop_check": 31997}


def stream_events(url: str, body: dict, timeout: float = 120) -> list[str]:
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=timeout) as r:
        assert r.status_code == 200, r.read()
        return [line[6:] for line in r.iter_lines() if line.startswith("data: ")]


@pytest.fixture(scope="module", params=[1, 2], ids=["one-core", "two-replicas"])
def faulty(request):
    """With two data-parallel replicas, a request's failure crosses the DP client's merge of the
    replicas' outputs (and an n=2 request's samples may sit on different replicas)."""
    spec = ",".join(f"{k}:{v}" for k, v in FAULTS.items())
    srv = ServerProcess("--data-parallel-size", str(request.param), env={"TOKENMILL_DEBUG_FAULTS": spec}).wait_ready()
    yield srv
    assert srv.stop() == 0
    assert "Traceback" not in srv.log(), srv.log()


@pytest.mark.parametrize("place", list(FAULTS))
def test_a_fault_fails_only_its_request(faulty, place):
    healthy = {"prompt": "Tell me about the sea.", "max_tokens": 40, "ignore_eos": True}
    bad = {"prompt": [100, FAULTS[place], 200], "max_tokens": 8, "stop": ["zzz"], "n": 2}
    with ThreadPoolExecutor(4) as pool:
        others = [pool.submit(stream_events, faulty.url, healthy) for _ in range(3)]
        time.sleep(0.3)  # the healthy streams are running when the fault hits
        r = httpx.post(faulty.url + "/v1/completions", json=bad, timeout=60)
        events = stream_events(faulty.url, bad)
        assert r.status_code == 500 and r.json()["error"]["type"] == "internal_error"
        assert "injected" in r.json()["error"]["message"]
        assert json.loads(events[-2])["error"]["code"] == 500 and events[-1] == "[DONE]"
        for f in others:  # the others did not notice
            done = f.result()
            assert done[-1] == "[DONE]" and json.loads(done[-2])["choices"][0]["finish_reason"] == "length"
    assert httpx.get(faulty.url + "/health").status_code == 200
    faulty.wait_idle()


def test_a_client_that_never_reads_stalls_nobody(faulty):
    body = json.dumps({"prompt": "Write a long story.", "max_tokens": 600, "ignore_eos": True, "stream": True,
                       "logprobs": 5}).encode()
    slow = socket.socket()
    slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    slow.connect(("127.0.0.1", faulty.port))
    slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    try:
        time.sleep(1.0)  # the slow stream is generating and its socket fills up
        for _ in range(3):  # meanwhile other streams run to the end
            events = stream_events(faulty.url, {"prompt": "Hi", "max_tokens": 20, "ignore_eos": True})
            assert events[-1] == "[DONE]"
        data = b""  # the slow client finally reads: nothing was lost
        slow.settimeout(120)
        while not data.endswith(b"\r\n0\r\n\r\n"):  # the last chunk of a chunked response
            chunk = slow.recv(1 << 16)
            assert chunk, data[-300:]
            data += chunk
        assert b"data: [DONE]" in data[-64:]
        tokens = sum(len(json.loads(line[6:])["choices"][0]["logprobs"]["tokens"])
                     for line in data.decode(errors="replace").splitlines()
                     if line.startswith("data: {"))
        assert tokens == 600
    finally:
        slow.close()
    faulty.wait_idle()


def test_sigterm_with_64_streams_in_flight():
    srv = ServerProcess("--shutdown-grace", "3", "--max-num-seqs", "64", "--kv-cache-memory", "1GiB").wait_ready()
    results: list[list[str] | BaseException] = []

    def run(i):
        try:
            results.append(stream_events(srv.url, {"prompt": f"Story {i}:", "max_tokens": 4 if i % 8 == 0 else 400,
                                                   "ignore_eos": True}))
        except BaseException as e:  # noqa: BLE001
            results.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(64)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    while True:  # every stream is admitted (the short ones may already be done)
        m = srv.metrics()
        if m.get("tokenmill:num_requests_running", 0) + m.get("tokenmill:num_requests_waiting", 0) >= 56:
            break
        assert time.monotonic() < deadline, m
        time.sleep(0.05)
    srv.proc.send_signal(signal.SIGTERM)
    for t in threads:
        t.join(120)
    assert srv.proc.wait(60) == 0, srv.log()
    finished = cut = 0
    for events in results:
        assert not isinstance(events, BaseException), events
        assert events[-1] == "[DONE]", events[-3:]
        last = json.loads(events[-2])
        if "error" in last:
            assert last["error"]["type"] == "service_unavailable" and "shut down" in last["error"]["message"]
            cut += 1
        else:
            assert last["choices"][0]["finish_reason"] == "length"
            finished += 1
    assert len(results) == 64 and finished and cut, (finished, cut)
    srv.stop()  # it has exited: keeps its log, removes the file
    assert "Traceback" not in srv.log()


def test_idle_sigterm_exits_at_once():
    srv = ServerProcess().wait_ready()
    try:
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(30) == 0
        assert time.monotonic() - t0 < 5, srv.log()
    finally:
        srv.stop()


def _own_builds(cache) -> list:
    """Build folders in this cache's own kernel folders (not in those linked to the session's)."""
    return [p for p in cache.glob("kernels/*/build-*") if not p.parent.is_symlink()]


def _processes_naming(path) -> list[str]:
    """Command lines of running processes that mention `path` (a build's ninja and compilers)."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            cmd = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # it exited meanwhile
            continue
        if str(path) in cmd and cmdline.parent.name != str(os.getpid()):
            found.append(cmd[:200])
    return found


def test_sigkill_mid_kernel_build_then_restart(tmp_path):
    # only the int8 KV cache's kernels are built here (the others and the model files are the
    # session's): a kill mid-build and the restart's rebuild are the same, at a fraction of the cost
    # of the attention kernels' (~8 s a build against ~20)
    library = f"tokenmill_quant_kv_{variant_for(active_isa())}"
    env = {"TOKENMILL_CACHE_DIR": str(private_cache(tmp_path, rebuild=library, model_files=True))}
    args = ("--kv-cache-dtype", "int8")
    srv = ServerProcess(*args, env=env)
    try:
        deadline = time.monotonic() + 120
        while f"building {library}" not in srv.log():
            assert time.monotonic() < deadline and srv.proc.poll() is None, srv.log()
            time.sleep(0.05)
        # killed as soon as a process builds in the build's folder: a fixed wait could outlast a fast
        # compile, and the kill would then find the build done
        while not ((builds := _own_builds(tmp_path)) and _processes_naming(builds[0])):
            assert time.monotonic() < deadline and srv.proc.poll() is None, "no build ran: test the wrong thing"
            time.sleep(0.01)
        folders = ipc_folders(srv.proc.pid)
        assert len(folders) == 1, folders  # the core runs the build, the front end waits on it
    finally:
        srv.stop(signal.SIGKILL)
    assert _own_builds(tmp_path), "the kill left no half-built kernels: test the wrong thing"
    deadline = time.monotonic() + 10  # the build's process group dies with the server
    while _processes_naming(tmp_path):
        assert time.monotonic() < deadline, f"orphaned build processes: {_processes_naming(tmp_path)}"
        time.sleep(0.1)
    deadline = time.monotonic() + 10  # the core, still starting, removes the killed front end's sockets
    while any(f.exists() for f in folders):
        assert time.monotonic() < deadline, f"the killed front end's sockets were left: {folders}"
        time.sleep(0.1)
    again = ServerProcess(*args, env=env).wait_ready(timeout=300)  # the kernel lock died with its holder
    try:
        assert "cpu_paged attention" in again.log() and "int8 (" in again.log()
        assert not _own_builds(tmp_path)
        r = httpx.post(again.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 3}, timeout=60)
        assert r.status_code == 200
        again.stop(signal.SIGKILL)  # and once more, warm
        third = ServerProcess(*args, env=env).wait_ready()
        assert third.stop() == 0
    finally:
        again.stop()

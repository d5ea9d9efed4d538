"""What the standalone router adds per request (issue 9): one `tokenmill serve`, and `tokenmill
router --replica` in front of it; 100 sequential 1-token completions (a 64-token prompt) straight to
the server and 100 through the router, alternated in blocks of 10 after 10 unrecorded warm-ups each.

    cpu-lock bench .venv/bin/python benchmarks/router_overhead.py
"""

from __future__ import annotations

import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

BIN = Path(sys.executable).parent


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(url: str) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(url)


def main() -> None:
    print(f"load before: {os.getloadavg()[0]:.2f}", flush=True)
    sp, rp = _port(), _port()
    server_url, router_url = f"http://127.0.0.1:{sp}", f"http://127.0.0.1:{rp}"
    server = subprocess.Popen([BIN / "tokenmill", "serve", "--port", str(sp)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    router = subprocess.Popen([BIN / "tokenmill", "router", "--port", str(rp), "--replica", server_url],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    body = {"prompt": list(range(1000, 1064)), "max_tokens": 1, "temperature": 0}
    times: dict[str, list[float]] = {"direct": [], "router": []}
    try:
        _wait(server_url)
        _wait(router_url)
        with httpx.Client(timeout=60) as client:
            for url in (server_url, router_url):
                for _ in range(10):
                    client.post(url + "/v1/completions", json=body).raise_for_status()
            for _ in range(10):
                for name, url in (("direct", server_url), ("router", router_url)):
                    for _ in range(10):
                        t0 = time.perf_counter()
                        client.post(url + "/v1/completions", json=body).raise_for_status()
                        times[name].append(time.perf_counter() - t0)
    finally:
        for p in (router, server):
            p.send_signal(signal.SIGTERM)
            p.wait(60)
    d, r = statistics.median(times["direct"]), statistics.median(times["router"])
    print("| path | p50 latency (ms) | mean (ms) |\n|---|---|---|")
    for name, ts in times.items():
        print(f"| {name} | {1000 * statistics.median(ts):.2f} | {1000 * statistics.mean(ts):.2f} |")
    print(f"router overhead per request (p50): {1000 * (r - d):.2f} ms")
    print(f"load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()

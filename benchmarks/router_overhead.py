"""What the standalone router adds per request (issue 9): one `tokenmill serve`, and `tokenmill
router --replica` in front of it; 100 sequential 1-token completions (a 64-token prompt) straight to
the server and 100 through the router, alternated in blocks of 10 after 10 unrecorded warm-ups each.

    cpu-lock bench .venv/bin/python benchmarks/router_overhead.py
"""

from __future__ import annotations

import os
import statistics
import time

import httpx

from tokenmill.bench.server_process import ServerProcess


def main() -> None:
    print(f"load before: {os.getloadavg()[0]:.2f}", flush=True)
    body = {"prompt": list(range(1000, 1064)), "max_tokens": 1, "temperature": 0}
    times: dict[str, list[float]] = {"direct": [], "router": []}
    with ServerProcess(log_path=os.devnull) as server, \
            ServerProcess("--replica", server.url, command="router", log_path=os.devnull) as router, \
            httpx.Client(timeout=60) as client:
        for url in (server.url, router.url):
            for _ in range(10):
                client.post(url + "/v1/completions", json=body).raise_for_status()
        for _ in range(10):
            for name, url in (("direct", server.url), ("router", router.url)):
                for _ in range(10):
                    t0 = time.perf_counter()
                    client.post(url + "/v1/completions", json=body).raise_for_status()
                    times[name].append(time.perf_counter() - t0)
    d, r = statistics.median(times["direct"]), statistics.median(times["router"])
    print("| path | p50 latency (ms) | mean (ms) |\n|---|---|---|")
    for name, ts in times.items():
        print(f"| {name} | {1000 * statistics.median(ts):.2f} | {1000 * statistics.mean(ts):.2f} |")
    print(f"router overhead per request (p50): {1000 * (r - d):.2f} ms")
    print(f"load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()

"""What an open dashboard costs the engine: `tokenmill bench serve` against one `tokenmill serve`, in
alternating rounds without and with a poller reading /dashboard/api/state once a second (what an
open /dashboard tab does), plus the recorder's own time on the engine thread. Then the same rounds
against a server started with --disable-dashboard, as the baseline of the recorder itself.

    python benchmarks/dashboard_overhead.py [--rounds 3] [--num-prompts 64]     (results: bench-results/)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def serve(port: int, *flags: str) -> subprocess.Popen:
    proc = subprocess.Popen([str(BIN / "tokenmill"), "serve", "--port", str(port), *flags],
                            stdout=open(REPO / "bench-results" / f"dashboard-serve-{port}.log", "w"),
                            stderr=subprocess.STDOUT)
    for _ in range(600):
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            time.sleep(0.3)
    raise TimeoutError("server did not start")


def bench(url: str, args, seed: int) -> float:
    out = REPO / "bench-results" / "dashboard-overhead-run.json"
    subprocess.run([str(BIN / "tokenmill"), "bench", "serve", "--base-url", url, "--local-only", "--no-progress",
                    "--num-prompts", str(args.num_prompts), "--concurrency", "16", "--input-len", "128",
                    "--output-len", "64", "--ignore-eos", "--seed", str(seed), "--output-json", str(out)],
                   check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())["runs"][0]["output_token_throughput"]


def poll(url: str, stop: threading.Event, count: list[int]) -> None:
    with httpx.Client() as client:
        while not stop.wait(1.0):
            assert client.get(url + "/dashboard/api/state", timeout=30).status_code == 200
            count[0] += 1


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=64)
    args = p.parse_args()
    (REPO / "bench-results").mkdir(exist_ok=True)
    results = {}
    seed = 1000
    for label, flags in (("dashboard on", ()), ("--disable-dashboard", ("--disable-dashboard",))):
        port = 8130 + len(results)
        url = f"http://127.0.0.1:{port}"
        server = serve(port, *flags)
        try:
            bench(url, args, seed := seed + 1)  # warm-up round, not counted
            rows = {"not polled": [], "polled 1/s": []}
            for _ in range(args.rounds):
                for polled in (False, True):
                    if polled and flags:
                        continue
                    stop, count = threading.Event(), [0]
                    poller = threading.Thread(target=poll, args=(url, stop, count)) if polled else None
                    if poller:
                        poller.start()
                    rows["polled 1/s" if polled else "not polled"].append(bench(url, args, seed := seed + 1))
                    if poller:
                        stop.set()
                        poller.join()
            if not flags:
                state = httpx.get(url + "/dashboard/api/state", timeout=30).json()
                rows["recorder engine-thread s"] = state["dashboard_cost"]["recorder_engine_thread_s_total"]
                rows["uptime s"] = state["uptime_s"]
            results[label] = rows
        finally:
            server.terminate()
            server.wait(60)
    print(json.dumps(results, indent=1))
    for label, rows in results.items():
        for name, values in rows.items():
            if isinstance(values, list) and values:
                print(f"{label:>20} {name:>11}: output tok/s median {statistics.median(values):.1f} "
                      f"({', '.join(f'{v:.1f}' for v in values)})")
    on = results["dashboard on"]
    print(f"recorder on the engine thread: {on['recorder engine-thread s']:.3f} s over {on['uptime s']:.0f} s "
          f"({100 * on['recorder engine-thread s'] / on['uptime s']:.3f} %)")


if __name__ == "__main__":
    main()

"""What an open dashboard costs the engine: `tokenmill bench serve` against one `tokenmill serve`, in
alternating rounds without and with a poller reading /dashboard/api/state once a second (what an
open /dashboard tab does), plus the recorder's own time on the engine thread. Then the same rounds
against a server started with --disable-dashboard (both stay up; the arms alternate).

    python benchmarks/dashboard_overhead.py [--rounds 3] [--num-prompts 64]     (results: bench-results/)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from tokenmill.bench.server_process import ServerProcess

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def serve(port: int, *flags: str) -> ServerProcess:
    return ServerProcess(*flags, port=port, log_path=str(REPO / "bench-results" / f"dashboard-serve-{port}.log"))


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
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--off-first", action="store_true", help="start the --disable-dashboard server first")
    args = p.parse_args()
    (REPO / "bench-results").mkdir(exist_ok=True)
    # both servers stay up (an idle one uses no CPU) and the arms alternate, so drift hits all of them
    on, off = "http://127.0.0.1:8130", "http://127.0.0.1:8131"
    starts = [(8130, ("--kv-cache-memory", "1GiB")), (8131, ("--kv-cache-memory", "1GiB", "--disable-dashboard"))]
    arms = {"dashboard on, page closed": [], "dashboard on, polled 1/s": [], "--disable-dashboard": []}
    with contextlib.ExitStack() as servers:
        for port, flags in starts[::-1] if args.off_first else starts:
            servers.enter_context(serve(port, *flags))
        seed = 1000
        for url in (on, off):
            bench(url, args, seed := seed + 1)  # warm-up, not counted
        for _ in range(args.rounds):
            for arm, values in arms.items():
                stop, count = threading.Event(), [0]
                poller = threading.Thread(target=poll, args=(on, stop, count)) if "polled" in arm else None
                if poller:
                    poller.start()
                values.append(bench(off if arm.startswith("--") else on, args, seed := seed + 1))
                if poller:
                    stop.set()
                    poller.join()
        state = httpx.get(on + "/dashboard/api/state", timeout=30).json()
    for arm, values in arms.items():
        runs = ", ".join(f"{v:.1f}" for v in values)
        print(f"{arm:>28}: output tok/s median {statistics.median(values):.1f} ({runs})")
    spent, up = state["dashboard_cost"]["recorder_engine_thread_s_total"], state["uptime_s"]
    print(f"recorder on the engine thread: {spent:.3f} s over {up:.0f} s ({100 * spent / up:.3f} %)")
    from tokenmill.core.block_pool import BlockPool

    pool = BlockPool(state["kv"]["blocks_total"])
    start = time.perf_counter()
    for _ in range(20):
        pool.block_states()
    print(f"block map of {pool.num_blocks} blocks: {(time.perf_counter() - start) / 20 * 1000:.2f} ms on the engine "
          "thread per poll")


if __name__ == "__main__":
    main()

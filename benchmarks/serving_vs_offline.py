"""Serving at concurrency 64 against offline throughput on the same workload (issue 9).

One workload: 64 requests, 128 prompt tokens, 128 output tokens (EOS ignored), temperature 1.
Three arms, alternated for --rounds rounds: `tokenmill bench throughput` (the offline LLM), and
`tokenmill serve` + `tokenmill bench serve --concurrency 64` (client on the same machine) with the
engine core in its own process (the default) and in the server's process (--no-engine-core-process).

    cpu-lock bench .venv/bin/python benchmarks/serving_vs_offline.py
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

BIN = Path(sys.executable).parent
WORKLOAD = ["--num-prompts", "64", "--input-len", "128", "--output-len", "128"]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def offline(out: Path) -> float:
    subprocess.run([BIN / "tokenmill", "bench", "throughput", *WORKLOAD, "--output-json", str(out)], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return json.loads(out.read_text())["output_tokens_per_s"]


def serving(out: Path, extra: list[str]) -> float:
    port = _port()
    url = f"http://127.0.0.1:{port}"
    log = open(out.with_suffix(".log"), "w")
    server = subprocess.Popen([BIN / "tokenmill", "serve", "--port", str(port), *extra], stdout=log,
                              stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        subprocess.run([BIN / "tokenmill", "bench", "serve", "--base-url", url, *WORKLOAD, "--concurrency", "64",
                        "--ignore-eos", "--temperature", "1.0", "--warmup", "4", "--no-progress",
                        "--output-json", str(out)], check=True, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())["runs"][0]["output_token_throughput"]
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(60)
        log.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args()
    out_dir = Path(args.out_dir or tempfile.mkdtemp(prefix="serving-vs-offline-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"load before: {os.getloadavg()[0]:.2f}; raw results in {out_dir}", flush=True)
    arms = {"offline LLM": lambda o: offline(o),
            "serve, core in its own process": lambda o: serving(o, []),
            "serve, core in the server process": lambda o: serving(o, ["--no-engine-core-process"])}
    results: dict[str, list[float]] = {name: [] for name in arms}
    for r in range(args.rounds):
        for i, (name, run) in enumerate(arms.items()):
            tps = run(out_dir / f"r{r}-arm{i}.json")
            results[name].append(tps)
            print(f"round {r}: {name}: {tps:.1f} output tok/s", flush=True)
    base = statistics.median(results["offline LLM"])
    print("\n| arm | output tok/s per round | median | vs offline |\n|---|---|---|---|")
    for name, values in results.items():
        med = statistics.median(values)
        print(f"| {name} | {', '.join(f'{v:.1f}' for v in values)} | {med:.1f} | {100 * med / base:.1f}% |")
    print(f"load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()

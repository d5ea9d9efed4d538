"""Serving at concurrency 64 against offline throughput on the same workload (issue 9).

One workload: 64 requests, 128 prompt tokens, 128 output tokens (EOS ignored), temperature 1.
Arms, alternated for --rounds rounds: `tokenmill bench throughput` (the offline LLM), and
`tokenmill serve` + `tokenmill bench serve --concurrency 64` (client on the same machine) with its
defaults (engine core in its own process, every token streamed) and with each --stream-interval
given (tokens gathered per streamed chunk).

    cpu-lock bench .venv/bin/python benchmarks/serving_vs_offline.py
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from tokenmill.bench.server_process import ServerProcess

BIN = Path(sys.executable).parent
WORKLOAD = ["--num-prompts", "64", "--input-len", "128", "--output-len", "128"]


def offline(out: Path) -> float:
    subprocess.run([BIN / "tokenmill", "bench", "throughput", *WORKLOAD, "--output-json", str(out)], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return json.loads(out.read_text())["output_tokens_per_s"]


def serving(out: Path, extra: list[str]) -> float:
    with ServerProcess(*extra, log_path=str(out.with_suffix(".log"))) as server:
        subprocess.run([BIN / "tokenmill", "bench", "serve", "--base-url", server.url, *WORKLOAD, "--concurrency",
                        "64", "--ignore-eos", "--temperature", "1.0", "--warmup", "4", "--no-progress",
                        "--output-json", str(out)], check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())["runs"][0]["output_token_throughput"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--stream-intervals", type=int, nargs="*", default=[4])
    ap.add_argument("--out-dir", default=None)
    args = ap.parse_args()
    out_dir = Path(args.out_dir or tempfile.mkdtemp(prefix="serving-vs-offline-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    print(f"load before: {os.getloadavg()[0]:.2f}; raw results in {out_dir}", flush=True)
    arms = {"offline LLM": lambda o: offline(o),
            "serve, defaults": lambda o: serving(o, [])}
    for n in args.stream_intervals:
        arms[f"serve --stream-interval {n}"] = lambda o, n=n: serving(o, ["--stream-interval", str(n)])
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

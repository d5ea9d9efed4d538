"""Serving: `tokenmill serve` vs a naive Hugging Face server (one request at a time), measured by
the same client (`tokenmill bench serve`) in the same run, at several concurrencies.

    python benchmarks/serving_vs_hf.py --concurrency 1,4,16,64 --input-len 128 --output-len 128

Each server runs alone on the machine (the other is stopped), with the client as the only other
process. Prints a markdown table (with the machine load) and writes the raw results as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from tokenmill.bench.server_process import free_port

ROOT = Path(__file__).resolve().parent.parent


def start(cmd: list[str], port: int, log: Path) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=ROOT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[:3]} exited: {log.read_text()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise TimeoutError(f"{cmd[:3]} not ready")


def bench(port: int, concurrency: int, num_prompts: int, args, out: Path) -> dict:
    cmd = [sys.executable, "-m", "tokenmill.entrypoints.cli.main", "bench", "serve", "--base-url",
           f"http://127.0.0.1:{port}", "--concurrency", str(concurrency), "--num-prompts", str(num_prompts),
           "--input-len", str(args.input_len), "--output-len", str(args.output_len), "--ignore-eos",
           "--temperature", "1.0", "--slo", args.slo, "--warmup", "2", "--no-progress", "--output-json", str(out),
           "--seed", str(concurrency)]
    load_before = os.getloadavg()[0]
    subprocess.run(cmd, check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    run = json.loads(out.read_text())["runs"][0]
    run["loadavg_before"] = load_before
    return run


def row(name: str, c: int, r: dict) -> str:
    return (f"| {name} | {c} | {r['completed']} | {r['request_throughput']:.2f} | {r['output_token_throughput']:.1f} | "
            f"{r['goodput']:.2f} | {r['ttft_ms']['median']:.0f} | {r['ttft_ms']['p99']:.0f} | "
            f"{r['tpot_ms']['median']:.1f} | {r['tpot_ms']['p99']:.1f} | {r['itl_ms']['p99']:.1f} | "
            f"{r['e2e_ms']['median'] / 1000:.2f} | {r['loadavg_before']:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--concurrency", default="1,4,16,64")
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--slo", default="ttft=1000ms,tpot=100ms")
    ap.add_argument("--prompts-per-slot", type=int, default=2,
                    help="tokenmill runs max(16, this x concurrency) prompts per point")
    ap.add_argument("--hf-prompts", type=int, default=16,
                    help="prompts per point for the one-at-a-time baseline (at least the concurrency)")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--output-json", default="bench-results/serving_vs_hf.json")
    args = ap.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="serving-bench-"))
    results: dict[str, dict] = {"tokenmill": {}, "hf_naive": {}}

    port = free_port()
    proc = start([sys.executable, "-m", "tokenmill.entrypoints.cli.main", "serve", "--port", str(port)], port,
                 tmp / "tokenmill.log")
    try:
        for c in levels:
            results["tokenmill"][c] = bench(port, c, max(16, args.prompts_per_slot * c), args, tmp / f"tm{c}.json")
    finally:
        proc.terminate()
        proc.wait(60)
    if not args.skip_hf:
        port = free_port()
        proc = start([sys.executable, str(ROOT / "benchmarks" / "hf_server.py"), "--port", str(port)], port,
                     tmp / "hf.log")
        try:
            for c in levels:
                results["hf_naive"][c] = bench(port, c, max(c, args.hf_prompts), args, tmp / f"hf{c}.json")
        finally:
            proc.terminate()
            proc.wait(60)

    print(f"\n{args.input_len} in / {args.output_len} out, sampling at temperature 1, SLO {args.slo}")
    print("| server | concurrency | requests | req/s | out tok/s | goodput req/s | TTFT p50 ms | TTFT p99 ms | "
          "TPOT p50 ms | TPOT p99 ms | ITL p99 ms | E2E p50 s | load before |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name, runs in results.items():
        for c, r in runs.items():
            print(row(name, c, r))
    Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output_json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()

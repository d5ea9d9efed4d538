"""Prefix-affinity routing against round-robin over 2 data-parallel replicas (issue 9).

Workload: 8 distinct system prompts of 1000 tokens; 64 requests, 8 per system prompt in a shuffled
order, each the system prompt + a 32-token question, 16 output tokens, 8 in flight. For each policy a
fresh `tokenmill serve --data-parallel-size 2 --kv-cache-memory 128MiB --max-model-len 2048
--router-policy P` (`--kv-cache-memory 256MiB` holds as many tokens in an fp32 cache); reported:
the prefix-cache hit rate (the servers' own counters) and TTFT p50/p99 (streamed, client-side).

    cpu-lock bench .venv/bin/python benchmarks/router_affinity.py [--kv-cache-memory 128MiB]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

from tokenmill.bench.server_process import ServerProcess

BIN = Path(sys.executable).parent
VOCAB_LO, VOCAB_HI = 1000, 40000  # ordinary tokens of SmolLM2's vocabulary


def workload(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    systems = [[rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(1000)] for _ in range(8)]
    prompts = [s + [rng.randrange(VOCAB_LO, VOCAB_HI) for _ in range(32)] for s in systems for _ in range(8)]
    rng.shuffle(prompts)
    return prompts


def _counters(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        for name in ("prefix_cache_queries_total", "prefix_cache_hits_total"):
            if line.startswith(f"tokenmill:{name}"):
                out[name] = float(line.rsplit(" ", 1)[1])
    return out


async def _one(client: httpx.AsyncClient, url: str, prompt: list[int]) -> float:
    t0 = time.perf_counter()
    body = {"prompt": prompt, "max_tokens": 16, "temperature": 0, "ignore_eos": True, "stream": True}
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data: ") and '"text"' in line:
                return time.perf_counter() - t0
    raise RuntimeError("no token")


async def _drive(url: str, prompts: list[list[int]], concurrency: int = 8) -> list[float]:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=300) as client:
        async def run(p):
            async with sem:
                return await _one(client, url, p)

        return await asyncio.gather(*(run(p) for p in prompts))


def measure(policy: str, prompts: list[list[int]], kv_cache_memory: str) -> dict:
    args = ["--data-parallel-size", "2", "--kv-cache-memory", kv_cache_memory, "--max-model-len", "2048",
            "--router-policy", policy]
    with ServerProcess(*args, log_path=f"/tmp/router-affinity-{policy}.log") as server:
        url = server.url
        asyncio.run(_drive(url, [[7, 8, 9, 10]] * 2, 1))  # warm-up, shares nothing with the workload
        before = _counters(url)
        t0 = time.perf_counter()
        ttfts = asyncio.run(_drive(url, prompts))
        total = time.perf_counter() - t0
        after = _counters(url)
    q = after["prefix_cache_queries_total"] - before["prefix_cache_queries_total"]
    h = after["prefix_cache_hits_total"] - before["prefix_cache_hits_total"]
    ttfts.sort()
    return {"hit_rate": h / q if q else 0.0, "ttft_p50": statistics.median(ttfts),
            "ttft_p99": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))], "total_s": total}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv-cache-memory", default="128MiB", help="each replica's KV budget")
    kv = ap.parse_args().kv_cache_memory
    print(f"load before: {os.getloadavg()[0]:.2f}, KV {kv} a replica", flush=True)
    prompts = workload()
    rows = {}
    for policy in ("round_robin", "affinity"):
        rows[policy] = measure(policy, prompts, kv)
        print(policy, rows[policy], flush=True)
    print("\n| policy | prefix-cache hit rate | TTFT p50 (ms) | TTFT p99 (ms) | all 64 (s) |\n|---|---|---|---|---|")
    for policy, r in rows.items():
        print(f"| {policy} | {100 * r['hit_rate']:.1f}% | {1000 * r['ttft_p50']:.0f} | {1000 * r['ttft_p99']:.0f} "
              f"| {r['total_s']:.1f} |")
    print(f"load after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()

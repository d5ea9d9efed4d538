"""The paged decode attention kernel alone, one layer's call, on model-like shapes: B sequences of
`ctx` tokens each, H query heads over Hkv kv heads of D dims, blocks of 16 in a shuffled pool (as
a long-running engine leaves them). Pools of at least --min-kv-mib in all are used in turn (a
model's layers), so that a call does not find an earlier call's KV in the L3 and reads it from
DRAM. Prints the median time per call, the KV bytes it read per second and its multiply-adds
(scores and weighted values) per second. A shape ending in +R gives each sequence R query rows
of lengths ctx - R + 1 .. ctx over one block table: a speculative verification of R - 1 drafts,
which the kernel runs together, reading each sequence's K/V once.

    python benchmarks/paged_decode.py [--shapes "64x9/3x64@512,16x12/2x128@2048"] [--reps 7] [--dtype float32]
    python benchmarks/paged_decode.py --dtype float32 --shapes "1x9/3x64@700,1x9/3x64@700+16"
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from tokenmill.model.kernels import load_cpu_kernels
from tokenmill.utils.cpu import describe
from tokenmill.worker.cpu_env import configure_cpu

# B x H/Hkv x D @ ctx [+ R rows a sequence]: SmolLM2 (9/3 heads of 64) and Qwen2.5-1.5B (12/2 heads of 128)
SHAPES = ("64x9/3x64@512,16x9/3x64@2048,16x12/2x128@2048,4x12/2x128@8192,64x12/2x128@512,1x12/2x128@4096,"
          "1x9/3x64@512,1x9/3x64@2048")


def parse(shape: str) -> tuple[int, int, int, int, int, int]:
    b, rest = shape.split("x", 1)
    heads, rest = rest.split("x", 1)
    d, ctx = rest.split("@")
    ctx, _, rows = ctx.partition("+")
    h, hkv = heads.split("/")
    r = int(rows or 1)
    if not 1 <= r <= int(ctx):
        raise SystemExit(f"{shape}: a sequence's rows must be 1..ctx")
    return int(b), int(h), int(hkv), int(d), int(ctx), r


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=SHAPES)
    ap.add_argument("--reps", type=int, default=7, help="timed passes of 20 calls; the median is reported")
    ap.add_argument("--min-kv-mib", type=int, default=64, help="KV of all pools together (above the L3)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="queries and cache (float32: what a CPU without AVX512-BF16 runs)")
    args = ap.parse_args()
    configure_cpu(None)
    if not load_cpu_kernels():
        raise SystemExit("the CPU kernels could not be built")
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    print(f"{describe()}, {torch.get_num_threads()} threads, {args.dtype}, load {os.getloadavg()[0]:.2f}")
    print("| B x H/Hkv x D @ ctx [+R] | us per call | KV GB/s | G multiply-adds/s |")
    print("|---|---|---|---|")
    block = 16
    for shape in args.shapes.split(","):
        B, H, Hkv, D, ctx, R = parse(shape)
        nb = -(-ctx // block)
        pool_bytes = 2 * (B * nb + 1) * block * Hkv * D * dtype.itemsize
        pools = [(torch.randn(B * nb + 1, block, Hkv, D).to(dtype), torch.randn(B * nb + 1, block, Hkv, D).to(dtype))
                 for _ in range(max(2, -(-args.min_kv_mib * 2**20 // pool_bytes)))]
        # each sequence's R rows share its table, their lengths rising by one up to ctx
        tables = torch.randperm(B * nb).view(B, nb).repeat_interleave(R, dim=0)
        lens = torch.arange(ctx - R + 1, ctx + 1, dtype=torch.long).repeat(B)
        q = torch.randn(B * R, H, D).to(dtype)
        out = torch.empty_like(q)
        times = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            for i in range(20):
                k, v = pools[(len(times) * 20 + i) % len(pools)]
                torch.ops.tokenmill.paged_decode_attention(out, q, k, v, tables, lens, D ** -0.5)
            times.append((time.perf_counter() - t0) / 20)
        t = statistics.median(times)
        kv_bytes, macs = 2 * B * ctx * Hkv * D * dtype.itemsize, 2 * H * D * int(lens.sum())
        print(f"| {shape} | {t * 1e6:.0f} | {kv_bytes / t / 1e9:.1f} | {macs / t / 1e9:.0f} |", flush=True)


if __name__ == "__main__":
    main()

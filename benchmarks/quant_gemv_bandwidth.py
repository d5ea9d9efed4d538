"""How fast the packed one-row product streams its weights when they come from DRAM, as in decoding
a model larger than the last-level cache (Qwen2.5-Coder-1.5B: 1.04 GiB per token against a few
hundred MiB of L3).

Cycles through enough copies of one layer's packed weight to exceed the cache many times over (so
every call reads DRAM), one activation row per call, and reports GB/s of weight bytes read; for
reference, the same copies summed by torch (a plain streaming read) in the same run.

    python benchmarks/quant_gemv_bandwidth.py [--shapes qwen1.5b gate_up,qwen1.5b down] [--gib 1.5]
    python benchmarks/quant_gemv_bandwidth.py --prefetch 1024,4096   # distances side by side, alternating
    python benchmarks/quant_gemv_bandwidth.py --prefetch 16384:1,16384:2   # into L1 against into L2
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch
from single_stream import parse_prefetch

from tokenmill.model.layers.quantization.formats import FORMATS, random_blocks
from tokenmill.model.quant_kernels import quant_ops
from tokenmill.utils.cpu import describe

SHAPES = {  # name: (format, N, K)
    "smollm2 gate_up": ("Q4_1", 3072, 576),
    "smollm2 qkv": ("Q4_1", 960, 576),
    "smollm2 o": ("Q4_1", 576, 576),
    "smollm2 down": ("Q4_1", 576, 1536),
    "smollm2 lm_head": ("Q8_0", 49152, 576),
    "qwen1.5b gate_up": ("Q4_K", 17920, 1536),
    "qwen1.5b down": ("Q6_K", 1536, 8960),
    "qwen1.5b lm_head": ("Q6_K", 151936, 1536),
    "qwen0.5b gate_up i4": ("I4_G128", 9728, 896),
    "qwen0.5b down i4": ("I4_G128", 896, 4864),
    "qwen0.5b qkv i4": ("I4_G128", 1152, 896),
}


def best_rate(fn, copies, nbytes: int, rounds: int) -> float:
    """GB/s of the best of `rounds` passes over all copies."""
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for c in copies:
            fn(c)
        best = min(best, time.perf_counter() - t0)
    return nbytes * len(copies) / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="qwen1.5b gate_up,qwen1.5b down,qwen1.5b lm_head")
    ap.add_argument("--gib", type=float, default=1.5, help="total bytes of the copies cycled through")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--act-bits", type=int, default=16)
    ap.add_argument("--prefetch", default="", help="comma-separated prefetch distances (bytes) to compare, "
                    "each timed in turn within every round (default: the one set for this CPU); 16384:2 "
                    "prefetches into L2, 16384:1 into L1")
    args = ap.parse_args()
    ops = quant_ops()
    dists = [d for d in args.prefetch.split(",") if d]
    rng = np.random.default_rng(0)
    print(f"{describe()}, {torch.get_num_threads()} threads, load {os.getloadavg()[0]:.2f}")
    cols = [f"prefetch {d}" for d in dists] or ["packed GEMV"]
    print(f"| shape | copies x MiB | {' | '.join(c + ' GB/s (DRAM)' for c in cols)} | same matrix again GB/s (cache) "
          f"| torch.sum GB/s (DRAM) |")
    print("|---|---|" + "---|" * (len(cols) + 2))
    for name in args.shapes.split(","):
        fmt, n, k = SHAPES[name]
        qt = FORMATS[fmt].id
        w = ops.repack(torch.from_numpy(random_blocks(fmt, n, k, rng)), qt, n, k)
        count = max(2, int(args.gib * 2**30 / w.numel()))
        copies = [w.clone() for _ in range(count)]
        x = torch.randn(1, k).bfloat16()
        out = torch.empty(1, n, dtype=torch.bfloat16)

        def gemv(wc, out=out, x=x, qt=qt, n=n):
            ops.qlinear(out, x, [wc], [qt], [n], None, 0, args.act_bits)

        cold = {d: 0.0 for d in dists or [None]}
        for _ in range(args.rounds):  # distances interleaved, so that a change of load hits all alike
            for d in cold:
                if d is not None:
                    ops.set_prefetch_ahead(*parse_prefetch(d))
                cold[d] = max(cold[d], best_rate(gemv, copies, w.numel(), 1))
        hot = best_rate(gemv, [w] * count, w.numel(), args.rounds)
        as_u64 = [c.view(torch.int64) for c in copies]  # sum over 8-byte words: a read-bound pass
        stream = best_rate(lambda c: c.sum(), as_u64, w.numel(), args.rounds)
        rates = " | ".join(f"{r:.1f}" for r in cold.values())
        print(f"| {name} ({fmt} {n}x{k}) | {count} x {w.numel() / 2**20:.1f} | {rates} | {hot:.1f} | "
              f"{stream:.1f} |", flush=True)
        del copies, as_u64


if __name__ == "__main__":
    main()

"""The packed K-quant kernels' arithmetic rate per row count: x[M, K] . W^T on one thread, with a
weight small enough to stay in cache (Q4_K and Q6_K, 1024 x 4096: 2.3 and 3.4 MB), so that the
figure is the kernel's own (decode, dot products, epilogue) and not the memory's. G multiply-adds/s,
best of 5 windows of 0.1 s. Run it for two builds in turn (PYTHONPATH=<tree>) to compare them.

    python benchmarks/kquant_rows.py [--rows 1,2,4,6,8,64] [--threads 1]
"""

from __future__ import annotations

import argparse
import os
import time
from functools import partial

import numpy as np
import torch

from tokenmill.model.layers.quantization.formats import FORMATS, random_blocks
from tokenmill.model.quant_kernels import quant_ops
from tokenmill.utils.cpu import describe
from tokenmill.worker.cpu_env import configure_cpu


def best_time(fn, windows: int = 5, window_s: float = 0.1) -> float:
    best = float("inf")
    for _ in range(windows):
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < window_s:
            fn()
            n += 1
        best = min(best, (time.perf_counter() - t0) / n)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,6,8,64")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--formats", default="Q4_K,Q6_K")
    args = ap.parse_args()
    configure_cpu(args.threads)
    ops = quant_ops()
    rng = np.random.default_rng(0)
    rows = [int(r) for r in args.rows.split(",")]
    print(f"{describe()}, {args.threads} thread(s), load {os.getloadavg()[0]:.2f}, 8-bit activation codes")
    print("| format | " + " | ".join(f"{m} rows" for m in rows) + " |")
    print("|---|" + "---|" * len(rows))
    n, k = 1024, 4096
    for fmt in args.formats.split(","):
        qt = FORMATS[fmt].id
        w = ops.repack(torch.from_numpy(random_blocks(fmt, n, k, rng)), qt, n, k)
        rates = []
        for m in rows:
            x = torch.randn(m, k).to(torch.bfloat16)
            out = torch.empty(m, n, dtype=torch.bfloat16)
            t = best_time(partial(ops.qlinear, out, x, [w], [qt], [n], None, 0, 8))
            rates.append(f"{m * n * k / t / 1e9:.0f}")
        print(f"| {fmt} {n}x{k} | " + " | ".join(rates) + " |", flush=True)


if __name__ == "__main__":
    main()

"""The fused elementwise kernels (RMSNorm with its residual add, SiLU-and-mul, rotary embedding) at the
row counts of one stream (1), a speculative verification (4-6) and batched decode (16), with Qwen2.5-
Coder-1.5B's shapes (hidden 1536, intermediate 8960, 12 + 2 heads of 128), bf16. Microseconds per
call, best of 5 windows of 0.1 s, inputs in cache. Run it for two builds in turn (PYTHONPATH=<tree>)
to compare them.

    python benchmarks/elementwise_rows.py [--rows 1,4,6,16] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
from functools import partial

import torch
from kquant_rows import best_time

from tokenmill.model.kernels import load_cpu_kernels
from tokenmill.utils.cpu import describe
from tokenmill.worker.cpu_env import configure_cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,4,6,16")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    configure_cpu(args.threads)
    if not load_cpu_kernels():
        raise SystemExit("tokenmill's C++ kernels did not build")
    ops, bf16 = torch.ops.tokenmill, torch.bfloat16
    rows = [int(r) for r in args.rows.split(",")]
    print(f"{describe()}, {args.threads} thread(s), load {os.getloadavg()[0]:.2f}, bf16, us per call")
    print("| op | " + " | ".join(f"{m} rows" for m in rows) + " |")
    print("|---|" + "---|" * len(rows))
    hidden, inter, heads, kv_heads, dim = 1536, 8960, 12, 2, 128
    results: dict[str, list[str]] = {"rms_norm + residual": [], "silu_and_mul": [], "rotary_embedding": []}
    for m in rows:
        x, res, w = torch.randn(m, hidden).to(bf16), torch.randn(m, hidden).to(bf16), torch.randn(hidden).to(bf16)
        out = torch.empty_like(x)
        gate_up, act = torch.randn(m, 2 * inter).to(bf16), torch.empty(m, inter, dtype=bf16)
        qkv = torch.randn(m, (heads + 2 * kv_heads) * dim).to(bf16)
        q = qkv[:, :heads * dim].view(m, heads, dim)
        k = qkv[:, heads * dim:(heads + kv_heads) * dim].view(m, kv_heads, dim)
        cos, sin, pos = torch.randn(4096, dim // 2), torch.randn(4096, dim // 2), torch.arange(300, 300 + m)
        calls = {"rms_norm + residual": partial(ops.rms_norm, out, x, res, w, 1e-6),
                 "silu_and_mul": partial(ops.silu_and_mul, act, gate_up),
                 "rotary_embedding": partial(ops.rotary_embedding, q, k, cos, sin, pos)}
        for name, fn in calls.items():
            results[name].append(f"{best_time(fn) * 1e6:.1f}")
    for name, cells in results.items():
        print(f"| {name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()

"""Where the packed kernel stops paying: time x[M, K] . W^T for a growing number of rows M with
(a) the packed kernel, (b) dequantize slab + dense GEMM (the many-row path), (c) a dense bf16
weight pre-packed for oneDNN (what --quantization none runs), on the layer shapes of SmolLM2-135M
(Q4_1) and Qwen2.5-Coder-1.5B (Q4_K / Q6_K) and -0.5B (Q5_0 / Q6_K). The crossover (smallest M where (b) beats (a)) is
what packed.DENSE_MIN_ROWS holds per kind of CPU.

    python benchmarks/quant_crossover.py [--rows 1,2,4,8,16,32,64,128,512] [--act-bits 8]
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

SHAPES = {  # name: (format, N, K)
    "smollm2 gate_up": ("Q4_1", 3072, 576),
    "smollm2 down": ("Q4_1", 576, 1536),
    "smollm2 head": ("Q8_0", 49152, 576),
    "qwen1.5b gate_up": ("Q4_K", 17920, 1536),
    "qwen1.5b down": ("Q6_K", 1536, 8960),
    "qwen0.5b gate_up": ("Q5_0", 9728, 896),
    "qwen0.5b down": ("Q6_K", 896, 4864),
}


def timeit(fn, min_time=0.2) -> float:
    fn()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < min_time:
        fn()
        n += 1
    return (time.perf_counter() - t0) / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,2,4,8,16,24,32,48,64,128,512")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    # an AVX2 CPU runs the model in float32 (no fast bf16): emulate one with TOKENMILL_CPU_ISA=avx2,
    # ONEDNN_MAX_CPU_ISA=AVX2 and --dtype float32
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--act-bits", type=int, default=16, choices=[8, 16], help="the packed kernel's activation codes")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    configure_cpu(None)  # the engine's allocator settings: the many-row path's slab buffer is reused
    ops = quant_ops()
    rng = np.random.default_rng(0)
    print(f"{describe()}, {torch.get_num_threads()} threads, {args.act_bits}-bit codes, load {os.getloadavg()[0]:.2f}")
    print(f"| shape | M | packed ms | packed G multiply-adds/s | dequant+GEMM ms | dense {args.dtype} ms | "
          "fastest quantized |")
    print("|---|---|---|---|---|---|---|")
    for name in args.shapes.split(","):
        fmt, n, k = SHAPES[name]
        qt = FORMATS[fmt].id
        w = ops.repack(torch.from_numpy(random_blocks(fmt, n, k, rng)), qt, n, k)
        dense = torch.empty(n, k)
        ops.dequantize(dense, w, qt, k)
        packed_dense = torch.ops.mkldnn._reorder_linear_weight(dense.to(dtype))
        crossover = None
        for m in map(int, args.rows.split(",")):
            x = torch.randn(m, k).to(dtype)
            out = torch.empty(m, n, dtype=dtype)
            a = timeit(partial(ops.qlinear, out, x, [w], [qt], [n], None, 0, args.act_bits))
            b = timeit(partial(ops.qlinear, out, x, [w], [qt], [n], None, 1, args.act_bits))
            c = timeit(partial(torch.ops.mkldnn._linear_pointwise, x, packed_dense, None, "none", [], ""))
            if crossover is None and b < a:
                crossover = m
            print(f"| {name} ({fmt} {n}x{k}) | {m} | {a * 1e3:.3f} | {m * n * k / a / 1e9:.0f} | {b * 1e3:.3f} | "
                  f"{c * 1e3:.3f} | {'packed' if a <= b else 'dequant+GEMM'} |", flush=True)
        print(f"crossover for {name}: {crossover}")


if __name__ == "__main__":
    main()

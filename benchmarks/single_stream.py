"""One stream: prefill time of a prompt and decode tokens/s after it, through the engine.

    python benchmarks/single_stream.py --model smollm2-135m --input-len 128 --output-len 256 [engine flags]
    python benchmarks/single_stream.py --model qwen2.5-coder-1.5b --prefetch 4096,16384 --repeat 4
    python benchmarks/single_stream.py --model qwen2.5-coder-1.5b --prefetch 16384:1,16384:2  # L1 or L2

Prints one JSON line: prefill_tok_s (prompt tokens / time of the steps that prefill it),
decode_tok_s (new tokens after the first / their time), and the engine's settings. With
--prefetch, one line per distance of the packed GEMV's weight prefetch (bytes), the distances
taking turns in every repeat so that a change of machine load hits all alike.

llama.cpp on the same file at the same depth (its tg test starts from an empty context unless told;
at 128 tokens of context SmolLM2's tg256 ran ~12% slower than at 0 on an AVX2 EPYC):
    llama-bench -m FILE.gguf -t 2 -p 0 -n 256 -d 128
"""

from __future__ import annotations

import argparse
import json
import os
import time

from tokenmill.bench.datasets import synthetic
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.entrypoints.cli.args import add_engine_args, engine_config_from_args
from tokenmill.model.quant_kernels import prefetch_level, quant_ops
from tokenmill.sampling_params import SamplingParams
from tokenmill.utils.cpu import describe


def run(engine: LLMEngine, prompt: list[int], output_len: int) -> tuple[float, float]:
    engine.add_request("s", prompt, SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True))
    t0 = time.perf_counter()
    while True:  # prefill steps end when the first token is out
        outs = engine.step()
        if any(o.outputs[0].token_ids for o in outs):
            break
    t1 = time.perf_counter()
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    t2 = time.perf_counter()
    return len(prompt) / (t1 - t0), steps / (t2 - t1)


def parse_prefetch(spec: str) -> tuple[int, int]:
    """"16384" or "16384:2": a distance in bytes, and the cache level (default this CPU's)."""
    dist, _, level = spec.partition(":")
    return int(dist), int(level) if level else prefetch_level()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3, help="runs after one warm-up; the best is reported")
    ap.add_argument("--prefetch", default="", help="comma-separated prefetch distances (bytes) to compare, each "
                    "optionally with the cache level it fills: 16384:1 (L1), 16384:2 (L2)")
    add_engine_args(ap)
    args = ap.parse_args()
    cfg = engine_config_from_args(args)
    cfg.cache.enable_prefix_caching = False  # the same prompt runs several times
    t = time.perf_counter()
    engine = LLMEngine(cfg, progress=False)
    load_s = time.perf_counter() - t
    (req,) = synthetic(engine.tokenizer, 1, args.input_len, args.output_len, 0.0, seed=0)
    prompt = engine.tokenizer.encode(req.prompt) if isinstance(req.prompt, str) else req.prompt
    run(engine, prompt, 8)
    dists = [d for d in args.prefetch.split(",") if d] or [None]
    results = {d: [] for d in dists}
    for _ in range(args.repeat):
        for d in dists:
            if d is not None:
                quant_ops().set_prefetch_ahead(*parse_prefetch(d))
            results[d].append(run(engine, prompt, args.output_len))
    w = engine.core.worker
    for d, rs in results.items():
        print(json.dumps({
            "model": engine.served_model_name, "quantization": w.quantization, "dtype": str(w.dtype),
            **({"prefetch": d, "decode_runs": [round(r[1], 1) for r in rs]} if d is not None else {}),
            "prefill_tok_s": round(max(r[0] for r in rs), 1), "decode_tok_s": round(max(r[1] for r in rs), 1),
            "input_len": len(prompt), "output_len": args.output_len, "load_s": round(load_s, 2),
            "weight_mib": round(w.weight_bytes / 2**20, 1), "cpu": describe(),
            "threads": os.environ.get("OMP_NUM_THREADS"), "load_avg": os.getloadavg()[0],
        }))


if __name__ == "__main__":
    main()

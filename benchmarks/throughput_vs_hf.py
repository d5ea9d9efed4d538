"""Offline throughput: tokenmill vs Hugging Face transformers `generate`, same workload, same run.

Baselines: transformers one request at a time, and all requests as one padded static batch, each
in its faster dtype (fp32 one at a time, bf16 batched; dense weights, see hf_reference.py).
Every system samples (temperature 1, no top-k/top-p) exactly `--output-len` tokens per request
(EOS ignored / suppressed). Prints a table with ratios and the machine load, and writes JSON.

    python benchmarks/throughput_vs_hf.py --num-prompts 64 --input-len 128 --output-len 128
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

import torch
from hf_reference import load_hf_model


def machine() -> dict:
    cpu = platform.processor() or "cpu"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "loadavg_1m": os.getloadavg()[0], "torch": torch.__version__}


def run_tokenmill(prompts, output_len: int, engine_args: dict) -> dict:
    from tokenmill import LLM
    from tokenmill.bench.datasets import BenchRequest
    from tokenmill.bench.throughput import run_throughput

    llm = LLM(progress=False, **engine_args)
    reqs = [BenchRequest(p, len(p), output_len) for p in prompts]
    run_throughput(llm, reqs[:4], use_tqdm=False)  # warm-up
    result = run_throughput(llm, reqs, use_tqdm=False)
    del llm
    return result


@torch.inference_mode()
def _hf_generate(model, batch: list[list[int]], output_len: int, pad_id: int) -> int:
    width = max(len(p) for p in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(batch):  # left padding, as decoder-only generation needs
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    out = model.generate(ids, attention_mask=mask, max_new_tokens=output_len, min_new_tokens=output_len,
                         do_sample=True, temperature=1.0, top_k=0, top_p=1.0, pad_token_id=pad_id)
    return (out.shape[1] - width) * len(batch)


def run_hf(model, prompts, output_len: int, batch_size: int, pad_id: int) -> dict:
    _hf_generate(model, prompts[:1], 4, pad_id)  # warm-up
    t0 = time.perf_counter()
    n_out = sum(_hf_generate(model, prompts[i:i + batch_size], output_len, pad_id)
                for i in range(0, len(prompts), batch_size))
    elapsed = time.perf_counter() - t0
    n_in = sum(len(p) for p in prompts)
    return {"num_requests": len(prompts), "elapsed_s": elapsed, "requests_per_s": len(prompts) / elapsed,
            "input_tokens_per_s": n_in / elapsed, "output_tokens_per_s": n_out / elapsed,
            "total_tokens_per_s": (n_in + n_out) / elapsed, "output_tokens": n_out}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--sequential-limit", type=int, default=None,
                    help="Run only this many requests in the one-at-a-time baseline (its rate does not depend "
                         "on the count; the full 64x128 run takes ~6 minutes).")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--output-json", default="bench-results/throughput_vs_hf.json")
    args = ap.parse_args()

    from tokenmill.bench.datasets import synthetic
    from tokenmill.model.loader import load_tokenizer, resolve_model

    tok = load_tokenizer(resolve_model(None))
    prompts = [r.prompt for r in synthetic(tok, args.num_prompts, args.input_len, args.output_len)]
    before = machine()
    results = {"tokenmill": run_tokenmill(prompts, args.output_len, dict(
        dtype=args.dtype, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens))}
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    results["hf_static_batch"] = run_hf(load_hf_model(torch.bfloat16), prompts, args.output_len, len(prompts), pad)
    seq = prompts[: args.sequential_limit] if args.sequential_limit else prompts
    results["hf_one_at_a_time"] = run_hf(load_hf_model(torch.float32), seq, args.output_len, 1, pad)
    after = machine()

    base = results["hf_one_at_a_time"]["output_tokens_per_s"]
    print(f"\n{args.num_prompts} requests x {args.input_len} in / {args.output_len} out, {args.dtype}, "
          f"{before['cpu']}, {before['cores']} cores, load {before['loadavg_1m']:.2f} -> {after['loadavg_1m']:.2f}")
    print(f"{'system':<20}{'req/s':>8}{'out tok/s':>12}{'total tok/s':>13}{'vs one-at-a-time':>18}")
    for name, r in results.items():
        print(f"{name:<20}{r['requests_per_s']:>8.2f}{r['output_tokens_per_s']:>12.1f}"
              f"{r['total_tokens_per_s']:>13.1f}{r['output_tokens_per_s'] / base:>17.1f}x")
    os.makedirs(os.path.dirname(args.output_json) or ".", exist_ok=True)
    with open(args.output_json, "w") as f:
        json.dump({"args": vars(args), "machine_before": before, "machine_after": after, "results": results}, f,
                  indent=2)


if __name__ == "__main__":
    main()

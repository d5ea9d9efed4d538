"""Speculative decoding side by side with no speculation, same engine settings, same run.

Workload: input-grounded code edits (benchmarks/code_edit_dataset.py), greedy. One stream
(requests one after another) and a concurrency point (all requests at once). Prints one JSON
line per configuration: output tok/s and acceptance.

    cpu-lock bench .venv/bin/python benchmarks/spec_decode.py --model qwen2.5-coder-1.5b \\
        --draft qwen2.5-coder-0.5b --concurrency 16
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import time

from code_edit_dataset import FILES, ROOT, TASK

from tokenmill import LLM
from tokenmill.bench.datasets import BenchRequest
from tokenmill.bench.throughput import run_throughput


def workload(n: int, output_len: int, max_chars: int) -> list[BenchRequest]:
    prompts = [TASK.format(code=(ROOT / FILES[i % len(FILES)]).read_text()[:max_chars]) for i in range(n)]
    return [BenchRequest(p, 0, output_len) for p in prompts]


def one_stream(llm, requests) -> dict:
    total = {"elapsed_s": 0.0, "output_tokens": 0}
    spec = []
    for r in requests:
        res = run_throughput(llm, [r], use_tqdm=False, temperature=0.0)
        total["elapsed_s"] += res["elapsed_s"]
        total["output_tokens"] += res["output_tokens"]
        spec.append(res)
    total["output_tokens_per_s"] = total["output_tokens"] / total["elapsed_s"]
    if "spec_num_draft_tokens" in spec[0]:
        drafted = sum(s["spec_num_draft_tokens"] for s in spec)
        accepted = sum(s["spec_num_accepted_tokens"] for s in spec)
        drafts = sum(s["spec_num_drafts"] for s in spec)
        total["spec_acceptance_rate"] = accepted / drafted if drafted else 0.0
        total["spec_mean_acceptance_length"] = 1 + accepted / drafts if drafts else 0.0
    return total


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--draft", default=None, help="a draft model (also runs the draft-model configuration)")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--streams", type=int, default=2, help="requests of the one-stream point")
    ap.add_argument("--concurrency", default="16", help="comma list; 0: none")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-chars", type=int, default=2000)
    args = ap.parse_args()
    configs = {"none": None,
               "ngram": json.dumps({"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": 4,
                                    "prompt_lookup_min": 2})}
    if args.draft:
        configs["draft"] = json.dumps({"model": args.draft, "num_speculative_tokens": args.k})
    print(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": platform.processor(),
                      "load": open("/proc/loadavg").read().split()[:3]}))
    levels = [int(c) for c in args.concurrency.split(",") if int(c) > 0]
    for name, spec in configs.items():
        llm = LLM(model=args.model, dtype=args.dtype, speculative_config=spec, kv_cache_memory="2GiB",
                  max_model_len=2048, progress=False)
        run_throughput(llm, workload(1, 8, args.max_chars), use_tqdm=False, temperature=0.0)  # warm-up
        row = {"config": name, "one_stream": one_stream(llm, workload(args.streams, args.output_len, args.max_chars))}
        for c in levels if name != "draft" else []:
            res = run_throughput(llm, workload(c, args.output_len, args.max_chars), use_tqdm=False, temperature=0.0)
            row[f"concurrency_{c}"] = {k: v for k, v in res.items() if k in (
                "output_tokens_per_s", "elapsed_s", "spec_acceptance_rate", "spec_mean_acceptance_length")}
        print(json.dumps(row), flush=True)
        del llm
        gc.collect()


if __name__ == "__main__":
    main()

"""Speculative decoding side by side with no speculation: same engine settings, same run, interleaved.

Workload: input-grounded code edits (benchmarks/code_edit_dataset.py: a source file of tokenmill,
asked back with docstrings added), greedy, EOS ignored. Every configuration's engine is loaded
first; then at each concurrency the configurations take turns (one stream: request by request;
concurrency c: c different prompts at once, a round each), so that a change of machine load hits
all of them alike. Prefix caching is off: the same prompts come back at each point. Prints one JSON
line per (configuration, concurrency): output tok/s (end to end, prefill included), decode tok/s
per stream (1 / TPOT), acceptance, and the start of the first output.

    cpu-lock bench .venv/bin/python benchmarks/spec_decode.py --concurrency 1,16,64
    cpu-lock bench .venv/bin/python benchmarks/spec_decode.py --model qwen2.5-coder-1.5b \\
        --draft qwen2.5-coder-0.5b --configs none,draft,ngram --concurrency 1,4
    cpu-lock bench .venv/bin/python benchmarks/spec_decode.py --workload json --configs none,ngram:8 --output-len 600
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time

from code_edit_dataset import FILES, ROOT, TASK
from code_gen_prompts import code_gen_prompts

from tokenmill import LLM, SamplingParams
from tokenmill.bench.throughput import _spec_delta
from tokenmill.structured_output import StructuredOutputsParams

ITEMS_SCHEMA = {"type": "object", "required": ["items"], "properties": {"items": {"type": "array", "items": {
    "type": "object", "required": ["id", "name", "price", "tags"],
    "properties": {"id": {"type": "integer"}, "name": {"type": "string"}, "price": {"type": "number"},
                   "tags": {"type": "array", "items": {"type": "string"}}}}}}}
COLOURS = ["red", "blue", "green", "black", "white"]


def prompts(n: int, max_chars: int, workload: str = "edit") -> list[str]:
    """n different prompts. edit: file i % 8, starting (i // 8) * 7 lines further down each round;
    gen: code-generation instructions (code_gen_prompts.py); json: 12 records of a made-up
    inventory, to be returned under ITEMS_SCHEMA (a structured-output request)."""
    if workload == "gen":
        return code_gen_prompts(n)
    if workload == "json":
        return ["Here is a list of items:\n" + "\n".join(json.dumps(
            {"id": 12 * i + j, "name": f"item-{12 * i + j}", "price": 10 + (7 * j + i) % 90,
             "tags": COLOURS[(i + j) % 5:(i + j) % 5 + 1 + j % 2]}) for j in range(12))
            + "\nReturn them as JSON: " for i in range(n)]
    out = []
    for i in range(n):
        lines = (ROOT / FILES[i % len(FILES)]).read_text().splitlines(keepends=True)
        out.append(TASK.format(code="".join(lines[(i // len(FILES)) * 7:])[:max_chars]))
    return out


def run(llm, batch: list[str], output_len: int, workload: str = "edit") -> dict:
    # json: the output ends where its schema does (a grammar's end is its EOS), as long in every configuration
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True) if workload != "json" else \
        SamplingParams(temperature=0, max_tokens=output_len,
                       structured_outputs=StructuredOutputsParams(json=ITEMS_SCHEMA))
    before = llm.engine.core.stats().spec_decoding
    t0 = time.perf_counter()
    outs = llm.generate(batch, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    decode = [(o.metrics.last_token_time - o.metrics.first_token_time, len(o.outputs[0].token_ids) - 1)
              for o in outs]
    return {"sample": outs[0].outputs[0].text[:120], "elapsed_s": elapsed, "output_tokens": n_out,
            "decode_s": sum(d for d, _ in decode),
            "decode_tokens": sum(n for _, n in decode), **_spec_delta(before, llm.engine.core.stats().spec_decoding)}


def total(parts: list[dict]) -> dict:
    s = {k: sum(p.get(k, 0) for p in parts) for k in ("elapsed_s", "output_tokens", "decode_s", "decode_tokens",
                                                      "spec_num_drafts", "spec_num_draft_tokens",
                                                      "spec_num_accepted_tokens")}
    row = {"output_tokens_per_s": round(s["output_tokens"] / s["elapsed_s"], 2),
           "decode_tokens_per_s_per_stream": round(s["decode_tokens"] / s["decode_s"], 2),
           "elapsed_s": round(s["elapsed_s"], 2), "output_tokens": s["output_tokens"], "sample": parts[0]["sample"]}
    if s["spec_num_drafts"]:
        row["spec_acceptance_rate"] = round(s["spec_num_accepted_tokens"] / s["spec_num_draft_tokens"], 3)
        row["spec_mean_acceptance_length"] = round(1 + s["spec_num_accepted_tokens"] / s["spec_num_drafts"], 2)
    return row


def spec_configs(k: int, draft: str | None, draft_k: int | None = None) -> dict[str, str | None]:
    """ngram drafts up to k tokens, as many as the match is long (the default max_spec_factor);
    ngram-fixed always k (the factor off); draft-int4: the draft requantized to int4 at load (drafts
    stop below the default draft_p_min, its head scores the default draft_vocab_size tokens);
    draft-int4-all: always k drafts (draft_p_min 0); draft-int4-fullvocab: its head scores every
    token; draft-int4-v<N>: N tokens; draft-int4-lk<N>: draft_lookup_min N (0: the draft model alone);
    draft-int4-p<N>: draft_p_min N / 100."""
    ngram = {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    draft_spec = {"model": draft, "num_speculative_tokens": draft_k or k}
    return {"none": None, "ngram": json.dumps(ngram), "ngram-fixed": json.dumps({**ngram, "max_spec_factor": None}),
            "draft": json.dumps(draft_spec), "draft-int4": json.dumps({**draft_spec, "quantization": "int4"}),
            "draft-int4-all": json.dumps({**draft_spec, "quantization": "int4", "draft_p_min": 0}),
            "draft-int4-fullvocab": json.dumps({**draft_spec, "quantization": "int4", "draft_vocab_size": None}),
            **{f"draft-int4-v{n}": json.dumps({**draft_spec, "quantization": "int4", "draft_vocab_size": n})
               for n in (16384, 32768, 65536)},
            **{f"draft-int4-lk{n}": json.dumps({**draft_spec, "quantization": "int4", "draft_lookup_min": n})
               for n in (0, 2, 3, 6, 8)},
            **{f"draft-int4-p{n}": json.dumps({**draft_spec, "quantization": "int4", "draft_p_min": n / 100})
               for n in (50, 70, 80, 90, 95)}}


def cpu_model() -> str:
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "?"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--draft", default=None, help="the draft model of the draft configuration")
    ap.add_argument("--configs", default=None, help="comma list of none, ngram, ngram-fixed, draft, draft-int4[-all], "
                    "each with an optional :k (default: none,ngram[,draft])")
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--draft-k", type=int, default=None, help="the draft model's (default: --k)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--quant-act-bits", default="auto", help="the target's packed-kernel activation codes: "
                    "auto (the engine's default), 8 or 16")
    ap.add_argument("--streams", type=int, default=2, help="requests of the one-stream point (concurrency 1)")
    ap.add_argument("--concurrency", default="1,16")
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-chars", type=int, default=2000)
    ap.add_argument("--kv-cache-memory", default="2GiB")
    ap.add_argument("--rounds", type=int, default=1, help="repeat each concurrency point, alternating the "
                    "configurations' order; each round's ratio and their median are printed")
    ap.add_argument("--workload", choices=["edit", "gen", "json"], default="edit",
                    help="edit: input-grounded code edits; gen: short code-generation prompts; json: records "
                         "returned under a JSON schema (structured output)")
    args = ap.parse_args()

    def spec_of(name: str) -> str | None:  # "ngram:16": k = 16 for this configuration
        base, _, k = name.partition(":")
        return spec_configs(int(k) if k else args.k, args.draft, int(k) if k else args.draft_k)[base]

    names = (args.configs or ("none,ngram,draft" if args.draft else "none,ngram")).split(",")
    if not args.draft and any(n.startswith("draft") for n in names):
        ap.error("a draft configuration needs --draft (e.g. --draft qwen2.5-coder-0.5b)")
    print(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": cpu_model(),
                      "load_before": open("/proc/loadavg").read().split()[:3], "model": args.model or "smollm2-135m",
                      "draft": args.draft, "k": args.k, "draft_k": args.draft_k or args.k,
                      "output_len": args.output_len, "workload": args.workload,
                      "quant_act_bits": args.quant_act_bits,
                      "threads": os.environ.get("OMP_NUM_THREADS", "all")}), flush=True)
    llms = {}
    for name in names:
        llms[name] = LLM(model=args.model, dtype=args.dtype, speculative_config=spec_of(name),
                         quant_act_bits=args.quant_act_bits,
                         kv_cache_memory=args.kv_cache_memory, max_model_len=2048,
                         enable_prefix_caching=False, progress=False)
        run(llms[name], prompts(2, args.max_chars, args.workload), 8, args.workload)  # warm-up
    for c in (int(x) for x in args.concurrency.split(",")):
        ratios: dict[str, list[float]] = {name: [] for name in names}
        for r in range(args.rounds):
            order = names if r % 2 == 0 else names[::-1]  # alternate who goes first
            parts = {name: [] for name in names}
            batches = ([[p] for p in prompts(args.streams, args.max_chars, args.workload)] if c == 1
                       else [prompts(c, args.max_chars, args.workload)])
            for batch in batches:
                for name in order:
                    parts[name].append(run(llms[name], batch, args.output_len, args.workload))
            base = total(parts["none"])["output_tokens_per_s"] if "none" in parts else None
            for name in names:
                row = {"config": name, "concurrency": c, "round": r, **total(parts[name])}
                if base:
                    row["vs_none"] = round(row["output_tokens_per_s"] / base, 3)
                    ratios[name].append(row["vs_none"])
                print(json.dumps(row), flush=True)
        if args.rounds > 1:
            for name in names:
                if ratios[name] and name != "none":
                    print(json.dumps({"config": name, "concurrency": c, "vs_none_rounds": ratios[name],
                                      "vs_none_median": statistics.median(ratios[name])}), flush=True)
    print(json.dumps({"load_after": open("/proc/loadavg").read().split()[:3]}))
    del llms
    gc.collect()


if __name__ == "__main__":
    main()

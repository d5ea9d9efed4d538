"""Cost of structured outputs: time per output token of grammar-constrained decoding against
unconstrained decoding of the same batch shape, at 1 and 64 concurrent requests, and grammar
compile time (first use and cached).

Both runs generate exactly --max-tokens tokens per request: the unconstrained one with
ignore_eos, the constrained one under a JSON schema (an array of objects with typed fields, enums,
bounded numbers and a string pattern) that cannot be complete before that, so every step has the
same batch in both. Time per output token = (last token - first token) / (tokens - 1), per request,
averaged; the runs alternate, and the median of --repeats pairs is reported.

    cpu-lock bench .venv/bin/python benchmarks/structured_overhead.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from tokenmill import LLM, SamplingParams, StructuredOutputsParams

ITEM = {"type": "object", "properties": {
    "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
    "name": {"type": "string", "maxLength": 40},
    "color": {"type": "string", "enum": ["red", "green", "blue", "black", "white"]},
    "price": {"type": "number", "minimum": 0, "maximum": 10000},
    "stock": {"type": "integer", "minimum": 0},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4}},
    "required": ["sku", "name", "color", "price", "stock", "tags"]}
SCHEMA = {"type": "object", "properties": {"items": {"type": "array", "items": ITEM, "minItems": 200}},
          "required": ["items"]}


def tpot(llm: LLM, prompts: list[str], params: SamplingParams) -> float:
    outs = llm.generate(prompts, params, use_tqdm=False)
    per_request = []
    for o in outs:
        n = len(o.outputs[0].token_ids)
        assert o.outputs[0].finish_reason == "length" and n == params.max_tokens, o.outputs[0]
        per_request.append((o.metrics.last_token_time - o.metrics.first_token_time) / (n - 1))
    return statistics.mean(per_request)


def compile_times(llm: LLM) -> dict[str, float]:
    from tokenmill.structured_output.compiler import GrammarCompiler

    tokenizer = llm.get_tokenizer()
    vocab = llm.engine.model_config.vocab_size
    compiler = GrammarCompiler(lambda: tokenizer, vocab, stop_token_ids=[tokenizer.eos_token_id])
    t = time.perf_counter()
    compiler._xgr  # noqa: B018 - the tokenizer info, once per model
    info = time.perf_counter() - t
    spec = StructuredOutputsParams(json=SCHEMA).spec()
    t = time.perf_counter()
    compiler.get(spec)
    first = time.perf_counter() - t
    t = time.perf_counter()
    for _ in range(1000):
        compiler.get(spec)
    cached = (time.perf_counter() - t) / 1000
    small = StructuredOutputsParams(json={"type": "object", "properties": {"name": {"type": "string"},
                                                                           "age": {"type": "integer"}},
                                          "required": ["name", "age"]}).spec()
    t = time.perf_counter()
    compiler.get(small)
    small_first = time.perf_counter() - t
    compiler.shutdown()
    return {"tokenizer_info_s": info, "schema_first_s": first, "schema_cached_s": cached,
            "small_schema_first_s": small_first}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--temperature", type=float, default=1.0)
    args = ap.parse_args()
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=max(args.concurrency), progress=False)
    results = {"compile": compile_times(llm)}
    so = StructuredOutputsParams(json=SCHEMA)
    for c in args.concurrency:
        prompts = [f"Catalog page {i}. List the products of this page as JSON:\n" for i in range(c)]
        free = SamplingParams(temperature=args.temperature, seed=1, max_tokens=args.max_tokens, ignore_eos=True)
        bound = SamplingParams(temperature=args.temperature, seed=1, max_tokens=args.max_tokens, structured_outputs=so)
        tpot(llm, prompts, bound)  # warm-up (compiles the grammar, fills the prefix cache)
        tpot(llm, prompts, free)
        pairs = [(tpot(llm, prompts, free), tpot(llm, prompts, bound)) for _ in range(args.repeats)]
        free_ms = statistics.median(p[0] for p in pairs) * 1e3
        bound_ms = statistics.median(p[1] for p in pairs) * 1e3
        results[f"concurrency_{c}"] = {"unconstrained_ms_per_token": round(free_ms, 3),
                                       "constrained_ms_per_token": round(bound_ms, 3),
                                       "overhead_pct": round(100 * (bound_ms / free_ms - 1), 1)}
        print(c, results[f"concurrency_{c}"], flush=True)
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()

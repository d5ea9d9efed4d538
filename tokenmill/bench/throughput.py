"""`tokenmill bench throughput`: offline throughput of the engine on a fixed workload."""

from __future__ import annotations

import json
import time

from tokenmill.bench.datasets import BenchRequest, from_jsonl, synthetic
from tokenmill.core.messages import SPEC_COUNTS, SpecDecodingStats
from tokenmill.sampling_params import SamplingParams


def run_throughput(llm, requests: list[BenchRequest], use_tqdm: bool = True, temperature: float = 1.0) -> dict:
    params = [SamplingParams(temperature=temperature, top_p=1.0, max_tokens=r.output_len, ignore_eos=True)
              for r in requests]
    spec_before = llm.engine.core.stats().spec_decoding
    t0 = time.perf_counter()
    outs = llm.generate([r.prompt for r in requests], params, use_tqdm=use_tqdm)
    elapsed = time.perf_counter() - t0
    n_in = sum(len(o.prompt_token_ids) for o in outs)
    n_out = sum(len(c.token_ids) for o in outs for c in o.outputs)
    spec = _spec_delta(spec_before, llm.engine.core.stats().spec_decoding)
    return {**spec,
        "num_requests": len(requests), "elapsed_s": elapsed,
        "requests_per_s": len(requests) / elapsed,
        "input_tokens_per_s": n_in / elapsed, "output_tokens_per_s": n_out / elapsed,
        "total_tokens_per_s": (n_in + n_out) / elapsed,
        "input_tokens": n_in, "output_tokens": n_out,
    }


def _spec_delta(before, after) -> dict:
    """Speculative decoding over one run: acceptance rate and mean accepted length."""
    if after is None:
        return {}
    counts = (getattr(after, c) - (getattr(before, c) if before else 0) for c in SPEC_COUNTS)
    return SpecDecodingStats(*counts).summary()


def load_workload(tokenizer, args) -> list[BenchRequest]:
    if args.dataset:
        return from_jsonl(args.dataset, tokenizer, args.output_len, args.num_prompts)
    return synthetic(tokenizer, args.num_prompts, args.input_len, args.output_len, args.range_ratio,
                     seed=args.workload_seed)


def main(args) -> int:
    from tokenmill.entrypoints.cli.args import engine_config_from_args
    from tokenmill.entrypoints.llm import LLM

    cfg = engine_config_from_args(args)
    llm = LLM(**cfg.to_kwargs())
    requests = load_workload(llm.get_tokenizer(), args)
    if args.warmup:
        # prompts of its own: measured prompts found in the prefix cache would skip their prefill
        warmup = synthetic(llm.get_tokenizer(), 4, args.input_len, min(args.output_len, 16),
                           seed=args.workload_seed + 10_000)
        run_throughput(llm, warmup, use_tqdm=False, temperature=args.temperature)
    result = run_throughput(llm, requests, temperature=args.temperature)
    result["config"] = {"model": llm.engine.served_model_name, "dtype": str(llm.engine.config.model.torch_dtype),
                        "max_num_seqs": cfg.scheduler.max_num_seqs,
                        "max_num_batched_tokens": cfg.scheduler.max_num_batched_tokens,
                        "speculative_config": cfg.speculative.speculative_config, "temperature": args.temperature}
    print(f"Throughput: {result['requests_per_s']:.2f} requests/s, "
          f"{result['input_tokens_per_s']:.1f} input tok/s, {result['output_tokens_per_s']:.1f} output tok/s, "
          f"{result['total_tokens_per_s']:.1f} total tok/s ({result['num_requests']} requests in "
          f"{result['elapsed_s']:.2f}s)")
    if "spec_num_drafts" in result:
        print(f"Speculative decoding: acceptance rate {100 * result['spec_acceptance_rate']:.1f}%, mean acceptance "
              f"length {result['spec_mean_acceptance_length']:.2f} ({result['spec_num_draft_tokens']} draft tokens)")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=2)
    return 0

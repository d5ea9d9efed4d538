"""Where do the milliseconds of one engine step go? Runs N concurrent requests and times each
stage of the decode steps (scheduling, batch building, attention metadata, model forward, logits,
sampling, output processing), then breaks the forward down by operator with the torch profiler.

    python benchmarks/profile_step.py --num-prompts 64 --input-len 128 --output-len 128
    python benchmarks/profile_step.py --num-prompts 1 --output-len 64 --model qwen2.5-coder-1.5b  # one stream
"""

from __future__ import annotations

import argparse
import collections
import os
import time

import torch

from tokenmill.bench.datasets import synthetic
from tokenmill.config import EngineConfig
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.sampling_params import SamplingParams


def timed(obj, name: str, key: str, totals: dict) -> None:
    fn = getattr(obj, name)

    def wrapper(*a, **kw):
        t = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            totals[key] += time.perf_counter() - t

    setattr(obj, name, wrapper)


class TimedCall:
    """Times calls of a callable object (the sampler), passing its other attributes through."""

    def __init__(self, obj, key: str, totals: dict) -> None:
        self._obj, self._key, self._totals = obj, key, totals

    def __call__(self, *a, **kw):
        t = time.perf_counter()
        try:
            return self._obj(*a, **kw)
        finally:
            self._totals[self._key] += time.perf_counter() - t

    def __getattr__(self, name):
        return getattr(self._obj, name)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--attention-backend", default="auto")
    ap.add_argument("--model", default=None)
    ap.add_argument("--quantization", default="auto")
    ap.add_argument("--temperature", type=float, default=1.0, help="0: greedy")
    args = ap.parse_args()

    config = EngineConfig.from_kwargs(model=args.model, dtype=args.dtype, attention_backend=args.attention_backend,
                                      quantization=args.quantization, kv_cache_memory="1GiB", max_model_len=2048)
    engine = LLMEngine(config, progress=False)
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=args.temperature)
    for i, r in enumerate(synthetic(engine.tokenizer, args.num_prompts, args.input_len, args.output_len)):
        engine.add_request(str(i), r.prompt, params)
    runner, totals = engine.core.worker.runner, collections.defaultdict(float)
    timed(engine.core.scheduler, "schedule", "schedule", totals)
    timed(engine.core.scheduler, "update", "scheduler update", totals)
    timed(runner, "prepare_inputs", "build flat batch", totals)
    timed(runner.backend, "build_metadata", "attention metadata", totals)
    timed(runner.model, "forward", "model forward", totals)
    timed(runner.model, "compute_logits", "lm head (logits)", totals)
    runner.sampler = TimedCall(runner.sampler, "sampling", totals)
    timed(engine.output_processor, "process", "output processing", totals)

    steps, t_prefill = 0, time.perf_counter()
    while any(r.is_prefilling or r.num_computed_tokens == 0 for r in engine.core.scheduler.requests.values()):
        engine.step()
        steps += 1
    t_prefill = time.perf_counter() - t_prefill
    totals.clear()
    measured, t0 = 0, time.perf_counter()
    profile_at = args.output_len // 2
    op_table = None
    paused = 0.0
    while engine.has_unfinished_requests():
        if measured == profile_at:  # one extra, profiled step, left out of the timings
            t_pause, saved = time.perf_counter(), dict(totals)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                engine.step()
            op_table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)
            totals.clear()
            totals.update(saved)
            paused += time.perf_counter() - t_pause
            profile_at = -1
            continue
        engine.step()
        measured += 1
    elapsed = time.perf_counter() - t0 - paused
    per = elapsed / measured * 1000
    print(f"{args.num_prompts} sequences, {engine.core.worker.dtype}, {engine.core.worker.backend.name} attention, "
          f"{torch.get_num_threads()} threads, load {os.getloadavg()[0]:.2f}")
    print(f"prefill: {steps} steps, {t_prefill:.2f}s ({args.num_prompts * args.input_len / t_prefill:.0f} tok/s)")
    print(f"decode:  {measured} steps, {per:.1f} ms/step ({args.num_prompts / per * 1000:.0f} tok/s at full batch)")
    for key, total in sorted(totals.items(), key=lambda kv: -kv[1]):
        print(f"  {key:<22}{total / measured * 1000:7.2f} ms/step")
    other = per - sum(totals.values()) / measured * 1000
    print(f"  {'(engine glue)':<22}{other:7.2f} ms/step")
    print("\none profiled decode step, by operator (profiler overhead included):")
    print(op_table)


if __name__ == "__main__":
    main()

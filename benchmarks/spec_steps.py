"""Where speculation wins or loses time at concurrency c: every engine step classified by what it
ran (prefill chunks, verifications, whether it drafted for the next step), with its time and output
tokens, per configuration; and the speculation policy's averages per batch-size bucket at the end.

    cpu-lock bench .venv/bin/python benchmarks/spec_steps.py --configs none,ngram:16 --concurrency 64
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import defaultdict

from spec_decode import prompts, spec_configs

from tokenmill import LLM, SamplingParams
from tokenmill.core.scheduler import Scheduler
from tokenmill.engine.engine_core import EngineCore
from tokenmill.model.fused_decode import FusedDecode


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--configs", default="none,ngram:16")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--workload", choices=["edit", "gen"], default="edit")
    ap.add_argument("--timeline", action="store_true", help="also print every step: kind, rows, ms, tokens")
    ap.add_argument("--layer-calls", action="store_true", help="also the median time of the fused decode layers "
                    "per model (its layer count) and rows: what a verification row costs the target, and a "
                    "catch-up row the draft")
    args = ap.parse_args()
    llms = {}
    for name in args.configs.split(","):
        base, _, k = name.partition(":")
        llms[name] = LLM(model=args.model, speculative_config=spec_configs(int(k) if k else 4, args.draft)[base],
                         kv_cache_memory="2GiB", max_model_len=2048, enable_prefix_caching=False, progress=False)
        llms[name].generate(prompts(2, 2000, args.workload), SamplingParams(temperature=0, max_tokens=8),
                            use_tqdm=False)

    kinds: list[str] = []  # the kind of the step being scheduled (one engine step at a time)
    schedule, step = Scheduler.schedule, EngineCore.step

    def traced_schedule(self):
        out = schedule(self)
        spec = out.scheduled_spec_decode_tokens
        prefill = any(n != 1 + len(spec.get(r, ())) for r, n in out.num_scheduled_tokens.items())
        kinds.append((("prefill" if prefill else "decode") + (" +verify" if spec else "")
                      + (" +draft" if out.propose_drafts and self.spec_policy and not prefill else ""),
                      len(out.num_scheduled_tokens)))
        return out

    stats = defaultdict(lambda: [0, 0.0, 0])
    timeline: list[str] = []

    def traced_step(self):
        t0 = time.perf_counter()
        out = step(self)
        if kinds:
            kind, rows = kinds.pop()
            s = stats[kind]
            s[0] += 1
            s[1] += time.perf_counter() - t0
            tokens = sum(len(o.new_token_ids) for o in out.outputs)
            s[2] += tokens
            if args.timeline:
                timeline.append(f"{kind} rows={rows} {1e3 * (time.perf_counter() - t0):.1f}ms tokens={tokens}")
        return out

    Scheduler.schedule, EngineCore.step = traced_schedule, traced_step
    layer_calls: dict[tuple[int, int], list[float]] = defaultdict(list)
    if args.layer_calls:
        fused_call = FusedDecode.__call__

        def traced_layers(self, x, *rest):
            t0 = time.perf_counter()
            out = fused_call(self, x, *rest)
            layer_calls[(len(self.layers), x.shape[0])].append(time.perf_counter() - t0)
            return out

        FusedDecode.__call__ = traced_layers
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    for name, llm in llms.items():
        stats.clear()
        timeline.clear()
        layer_calls.clear()
        t0 = time.perf_counter()
        llm.generate(prompts(args.concurrency, 2000, args.workload), params, use_tqdm=False)
        policy = llm.engine.core.scheduler.spec_policy
        print(json.dumps({"config": name, "elapsed_s": round(time.perf_counter() - t0, 2),
                          "steps": {k: {"n": n, "s": round(t, 2), "tokens": tok, "tok_per_s": round(tok / t, 1)}
                                    for k, (n, t, tok) in sorted(stats.items())},
                          "policy_tok_per_s": policy and {f"bucket {b} {'on' if on else 'off'}": round(r, 1)
                                                          for (b, on), r in sorted(policy.rate.items())}}), flush=True)
        print("\n".join(timeline), flush=True)
        for (layers, rows), times in sorted(layer_calls.items()):
            print(json.dumps({"config": name, "layers": layers, "rows": rows, "calls": len(times),
                              "median_ms": round(1e3 * statistics.median(times), 2)}), flush=True)


if __name__ == "__main__":
    main()

"""Where a speculative decoding step's time goes: one stream of the code-edit workload, with and
without speculation, the engine's stages timed by wrapping them (the model forward by its number of
tokens, the sampler, the rejection sampler, the proposer, the rest of the engine step, and what
LLM.generate does outside the core: detokenizing, outputs).

    cpu-lock bench .venv/bin/python benchmarks/spec_profile.py --configs none,ngram
    cpu-lock bench .venv/bin/python benchmarks/spec_profile.py --model qwen2.5-coder-1.5b \\
        --draft qwen2.5-coder-0.5b --configs none,draft --output-len 96
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

from spec_decode import prompts, spec_configs

from tokenmill import LLM, SamplingParams
from tokenmill.engine.engine_core import EngineCore
from tokenmill.worker.model_runner import ModelRunner
from tokenmill.worker.sampler import Sampler
from tokenmill.worker.spec_decode.rejection_sampler import RejectionSampler


class Timers:
    def __init__(self):
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, owner, name: str, label, obj=None) -> None:
        """Time `owner.name` (a class attribute, or `obj`'s own attribute; a special method such as
        __call__ is looked up on the class, so it is wrapped there) under label(*args)."""
        target = owner if obj is None or name.startswith("__") else obj
        inner = getattr(target, name)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                key = label(*args[1:] if target is owner and obj is not None else args) \
                    if callable(label) else label
                self.seconds[key] += time.perf_counter() - t0
                self.calls[key] += 1

        setattr(target, name, timed)

    def report(self) -> dict:
        return {k: {"ms": round(self.seconds[k] * 1e3, 1), "calls": self.calls[k],
                    "ms_per_call": round(self.seconds[k] * 1e3 / self.calls[k], 2)} for k in sorted(self.seconds)}


def forward_label(_runner, batch) -> str:
    if any(n != 1 + len(drafts) for _, n, drafts in batch):
        return "forward prefill"
    return f"forward {sum(n for _, n, _ in batch)} tokens"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--draft", default=None)
    ap.add_argument("--configs", default="none,ngram")
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--max-chars", type=int, default=2000)
    ap.add_argument("--workload", choices=["edit", "gen"], default="edit")
    args = ap.parse_args()
    for name in args.configs.split(","):
        base, _, k = name.partition(":")  # "draft-int4:8": k = 8
        spec = spec_configs(int(k) if k else args.k, args.draft)[base]
        llm = LLM(model=args.model, speculative_config=spec, kv_cache_memory="2GiB", max_model_len=4096,
                  enable_prefix_caching=False, progress=False)
        params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
        llm.generate(prompts(1, args.max_chars, args.workload), SamplingParams(temperature=0, max_tokens=8),
                     use_tqdm=False)
        t = Timers()
        core = llm.engine.core
        runner = core.worker.runner
        t.wrap(EngineCore, "step", "engine step (all)", core)
        t.wrap(ModelRunner, "_forward", lambda batch: forward_label(None, batch), runner)
        t.wrap(Sampler, "__call__", "sampler", runner.sampler)
        t.wrap(type(runner.model), "compute_logits", lambda h: f"LM head {len(h)} rows", runner.model)
        t.wrap(RejectionSampler, "__call__", "rejection sampler", runner.rejection_sampler)
        if runner.proposer is not None:
            t.wrap(type(runner.proposer), "propose", "proposer", runner.proposer)
            draft = getattr(runner.proposer, "model", None)
            if draft is not None:  # a draft model's passes, by tokens, and its LM head
                t.wrap(type(draft), "forward", lambda ids, *_: f"draft forward {len(ids)} tokens"
                       if len(ids) <= 16 else "draft prefill", draft)
                t.wrap(type(draft), "compute_logits", "draft LM head", draft)
        t.wrap(type(core.executor), "execute", "executor (runner.execute)", core.executor)
        t0 = time.perf_counter()
        out = llm.generate(prompts(1, args.max_chars, args.workload), params, use_tqdm=False)[0]
        total = time.perf_counter() - t0
        stats = core.stats().spec_decoding
        print(json.dumps({"config": name, "total_ms": round(total * 1e3, 1),
                          "output_tokens": len(out.outputs[0].token_ids),
                          "prompt_tokens": len(out.prompt_token_ids),
                          "spec": None if stats is None else {"drafts": stats.num_drafts,
                                                              "draft_tokens": stats.num_draft_tokens,
                                                              "accepted": stats.num_accepted_tokens},
                          "stages": t.report()}, indent=1), flush=True)
        del llm


if __name__ == "__main__":
    main()

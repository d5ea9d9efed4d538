"""How many tokens should n-gram speculation draft? Drafting rules replayed offline against a
measured cost model, in seconds instead of a benchmark run per rule.

Greedy decoding makes this exact: one request at a time, the tokens it emits do not depend on
speculation, so the greedy outputs of one run without it tell, for any rule and any position, how
many of the drafts the target would have accepted. The cost of a step is measured in the same run,
on the same prompts, the two engines taking turns request by request: n-gram speculation with a
fixed draft count (16) verifies up to 17 rows (fewer where less follows the match): T(1) is its
steps that drafted nothing, and a line through the others by rows gives T(rows) = A + B (rows - 1)
(B: what a verification row adds). Each rule's
simulated time is then the sum of T over its steps, against the decode steps of the run without
speculation, timed the same way; both plus that run's prefill for end-to-end ratios
(spec_decode.py's measure). The replay ignores the speculation policy (spec_policy.py), which can
switch speculation off for a step.

    python benchmarks/ngram_policy.py --streams 16 --output-len 512
    python benchmarks/ngram_policy.py --rules "f1:k16,f0.5:k16,f1:k32,f1:k16:n1,fixed:k16,f1:k16:oracle"
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
from spec_decode import prompts

from tokenmill import LLM, SamplingParams
from tokenmill.core.scheduler import Scheduler
from tokenmill.engine.engine_core import EngineCore
from tokenmill.utils.cpu import describe
from tokenmill.worker.spec_decode.ngram import ngram_drafts


def parse_rule(rule: str) -> tuple[float | None, int, int, int, bool]:
    """"f<factor>|fixed:k<k>[:n<n_min>][:m<n_max>][:oracle]" -> (max_spec_factor, k, n_min, n_max,
    oracle). oracle: each draft cut to the tokens that will be accepted, a bound no rule reaches."""
    factor, k, n_min, n_max, oracle = 1.0, 16, 2, 4, False
    for part in rule.split(":"):
        if part == "oracle":
            oracle = True
        elif part == "fixed":
            factor = None
        elif part[0] == "f":
            factor = float(part[1:])
        elif part[0] == "k":
            k = int(part[1:])
        elif part[0] == "n":
            n_min = int(part[1:])
        elif part[0] == "m":
            n_max = int(part[1:])
    return factor, k, n_min, n_max, oracle


def replay(outputs: list[tuple[list[int], list[int]]], rule: str) -> dict:
    """Steps, drafted and accepted tokens of `rule` over (prompt, greedy output) pairs."""
    factor, k, n_min, n_max, oracle = parse_rule(rule)
    steps, rows, drafted, accepted = 0, [], 0, 0
    for prompt, out in outputs:
        i = 1  # the prefill samples the first token
        while i < len(out):
            drafts = ngram_drafts(np.asarray(prompt + out[:i], dtype=np.int64), k, n_min, n_max, factor)
            drafts = drafts[:len(out) - i - 1]  # no drafts past the request's last token
            a = 0
            while a < len(drafts) and drafts[a] == out[i + a]:
                a += 1
            if oracle:
                drafts = drafts[:a]
            steps += 1
            rows.append(len(drafts) + 1)
            drafted += len(drafts)
            accepted += a
            i += a + 1
    return {"steps": steps, "rows": rows, "drafted": drafted, "accepted": accepted}


def traced_run(llm: LLM, batch: list[str], output_len: int) -> tuple[list, list[tuple[int, float]]]:
    """The batch's outputs, one request at a time, and (rows, seconds) of each engine step that
    decodes (verification rows included; prefill steps left out)."""
    rows_of: list[int] = []
    times: list[tuple[int, float]] = []
    schedule, step = Scheduler.schedule, EngineCore.step

    def traced_schedule(self):
        out = schedule(self)
        prefill = any(n != 1 + len(out.scheduled_spec_decode_tokens.get(r, ()))
                      for r, n in out.num_scheduled_tokens.items())
        rows_of.append(0 if prefill else sum(out.num_scheduled_tokens.values()))
        return out

    def traced_step(self):
        t0 = time.perf_counter()
        out = step(self)
        if rows_of:
            rows = rows_of.pop()
            if rows:
                times.append((rows, time.perf_counter() - t0))
        return out

    Scheduler.schedule, EngineCore.step = traced_schedule, traced_step
    try:
        params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
        outs = [llm.generate([p], params, use_tqdm=False)[0] for p in batch]
    finally:
        Scheduler.schedule, EngineCore.step = schedule, step
    return outs, times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=512)
    ap.add_argument("--max-chars", type=int, default=2000)
    ap.add_argument("--rules", default="f1:k16,f0.5:k16,f0.75:k16,f1.5:k16,fixed:k16,f1:k8,f1:k32,f1:k16:n1,"
                    "f1:k16:n3,f1:k16:oracle,fixed:k32:oracle")
    args = ap.parse_args()
    print(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "cpu": describe(),
                      "load": open("/proc/loadavg").read().split()[:3]}), flush=True)
    fixed = json.dumps({"method": "ngram", "num_speculative_tokens": 16, "prompt_lookup_max": 4,
                        "prompt_lookup_min": 2, "max_spec_factor": None})
    kw = dict(kv_cache_memory="2GiB", max_model_len=2048, enable_prefix_caching=False, progress=False)
    llm, spec = LLM(**kw), LLM(speculative_config=fixed, **kw)
    outs, plain, times = [], [], []
    for i, p in enumerate(prompts(args.streams, args.max_chars)):  # request by request, taking turns
        for engine in ((llm, spec) if i % 2 == 0 else (spec, llm)):
            o, t = traced_run(engine, [p], args.output_len)
            if engine is llm:
                outs += o
                plain += t
            else:
                times += t
    rows = np.array([t[0] for t in times], dtype=np.float64)
    secs = np.array([t[1] for t in times])
    one = float(secs[rows == 1].mean())  # a step that drafted nothing
    b, a = np.polyfit(rows[rows > 1] - 1, secs[rows > 1], 1)  # verifications: T(rows) = a + b (rows - 1)

    def cost(r: int) -> float:
        return one if r == 1 else a + b * (r - 1)

    prefill = sum(o.metrics.ttft for o in outs)
    base = sum(t for _, t in plain)  # the decode steps without speculation
    outputs = [(list(o.prompt_token_ids), list(o.outputs[0].token_ids)) for o in outs]
    print(json.dumps({"step_s": round(one, 5), "verification_s": round(a, 5), "row_s": round(b, 5),
                      "row_over_step": round(b / one, 3),
                      "step_without_s": round(base / len(plain), 5), "prefill_s": round(prefill, 2),
                      "decode_tokens": sum(len(out) - 1 for _, out in outputs)}), flush=True)
    for rule in args.rules.split(","):
        r = replay(outputs, rule)
        t = sum(map(cost, r.pop("rows")))
        print(json.dumps({"rule": rule, **r, "acceptance": round(r["accepted"] / max(r["drafted"], 1), 3),
                          "mean_accepted_length": round(1 + r["accepted"] / r["steps"], 2),
                          "decode_speedup": round(base / t, 3),
                          "end_to_end_speedup": round((base + prefill) / (t + prefill), 3)}), flush=True)


if __name__ == "__main__":
    main()

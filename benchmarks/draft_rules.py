"""Replays draft-model stopping rules on one recorded run: how long should the draft model draft?

Runs one stream of the code-generation workload with the draft model drafting `--k` tokens a step
and never stopping early (draft_p_min ~0), and records per step the draft's confidence in each of
its tokens (p of its argmax) and how many of them the target accepted. It also times, in the same
run, a proposal by its number of draft passes (a least-squares line: fixed cost + passes x pass)
and the target's verification (forward and LM head) by its number of rows. Then it replays rules
on the recorded steps: a rule keeps a prefix of each step's drafts, its accepted tokens are
min(accepted, kept), and its cost is the line's and the verification's for that many. Steps drafted
by prompt lookup (draft_lookup_min) are left out: no rule touches them.

    python benchmarks/draft_rules.py --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b

Rules: `pmin` (the engine's, draft_model.py: stop after a draft under tau) and `cum` (stop before
the draft that takes the product of the confidences under tau, at least one draft).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch
from spec_decode import prompts, spec_configs

from tokenmill import LLM, SamplingParams
from tokenmill.utils.cpu import describe
from tokenmill.worker.model_runner import ModelRunner
from tokenmill.worker.spec_decode.draft_model import DraftModelProposer
from tokenmill.worker.spec_decode.rejection_sampler import RejectionSampler


class Recorder:
    """Wraps the proposer's head and propose, the runner's forward and LM head, and the rejection
    sampler, for one request at a time."""

    def __init__(self, runner):
        self.steps: list[tuple[list[float], int, int]] = []  # (confidences, drafted, accepted)
        self.calls: list[tuple[int, float]] = []  # (draft passes, seconds) of proposals without a prompt
        self.verify: dict[int, list[float]] = {}  # rows -> seconds of forward + LM head
        self.conf: list[float] = []
        prop, model = runner.proposer, runner.model
        head = prop.head
        # the Python loop, whose head calls can be scored (the C++ loop drafts the same tokens, ~0.4 ms
        # a pass faster: its per-pass cost here is an upper bound)
        prop.fused_loop.get = lambda: None

        def scored_head(hidden):
            logits = head(hidden)
            self.conf.append(float((logits.max(dim=-1).values - torch.logsumexp(logits, dim=-1)).exp()[0]))
            return logits
        prop.head = scored_head

        propose = DraftModelProposer.propose

        def timed_propose(p, states, max_passes=None):
            self.conf = []
            t0 = time.perf_counter()
            drafts = propose(p, states, max_passes)
            if p.prefill_seconds == 0 and self.conf:
                self.calls.append((len(self.conf), time.perf_counter() - t0))
            self.drafted = len(drafts[0])
            return drafts
        DraftModelProposer.propose = timed_propose

        forward, logits_of = ModelRunner._forward, model.compute_logits

        def timed_forward(r, batch):
            t0 = time.perf_counter()
            out = forward(r, batch)
            self.t_forward = (time.perf_counter() - t0, sum(n for _, n, _ in batch))
            return out
        ModelRunner._forward = timed_forward

        def timed_logits(hidden):
            t0 = time.perf_counter()
            out = logits_of(hidden)
            seconds, rows = self.t_forward
            self.verify.setdefault(rows, []).append(seconds + time.perf_counter() - t0)
            return out
        model.compute_logits = timed_logits

        reject = RejectionSampler.__call__

        def recorded(s, logits, rows):
            out = reject(s, logits, rows)
            if len(self.conf) == self.drafted:  # drafted by the model, not by prompt lookup
                self.steps.append((list(self.conf), self.drafted, len(out[0][0]) - 1))
            return out
        RejectionSampler.__call__ = recorded


class Costs:
    """The run's costs: a proposal's (fixed + passes x per_pass seconds) and a verification's by rows."""

    def __init__(self, rec: Recorder):
        passes = np.array([n for n, _ in rec.calls], dtype=float)
        seconds = np.array([s for _, s in rec.calls])
        if len(set(passes)) > 1:
            self.per_pass, self.fixed = np.polyfit(passes, seconds, 1)
        else:
            self.per_pass, self.fixed = seconds.mean() / max(passes.mean(), 1), 0.0
        self.rows = sorted(rec.verify)
        self.verify = [float(np.median(rec.verify[r])) for r in self.rows]

    def step(self, drafts: int) -> float:
        return self.fixed + drafts * self.per_pass + float(np.interp(drafts + 1, self.rows, self.verify))


def replay(rec: Recorder, costs: Costs, rule) -> dict:
    tokens = seconds = drafted = 0.0
    for conf, _, accepted in rec.steps:
        kept = rule(conf)
        tokens += min(accepted, kept) + 1
        drafted += kept
        seconds += costs.step(kept)
    return {"drafted": drafted / len(rec.steps), "tokens": tokens / len(rec.steps), "ms": seconds / tokens * 1e3}


def pmin(k: int, tau: float):
    def rule(conf):
        for i, p in enumerate(conf[:k]):
            if p < tau:
                return i + 1
        return min(k, len(conf))
    return rule


def cumulative(k: int, tau: float):
    def rule(conf):
        product = 1.0
        for i, p in enumerate(conf[:k]):
            product *= p
            if product < tau:
                return max(i, 1)
        return min(k, len(conf))
    return rule


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--k", type=int, default=8, help="drafts recorded a step (rules keep up to this many)")
    ap.add_argument("--streams", type=int, default=8, help="prompts, run one at a time")
    ap.add_argument("--output-len", type=int, default=256)
    args = ap.parse_args()
    spec = {**json.loads(spec_configs(args.k, args.draft)["draft-int4"]), "draft_p_min": 1e-9}
    llm = LLM(model=args.model, speculative_config=json.dumps(spec), kv_cache_memory="2GiB", max_model_len=4096,
              enable_prefix_caching=False, progress=False)
    llm.generate(prompts(1, 2000, "gen"), SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    rec = Recorder(llm.engine.core.worker.runner)
    for p in prompts(args.streams, 2000, "gen"):
        llm.generate([p], SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True), use_tqdm=False)
    print(f"{describe()}; {len(rec.steps)} steps drafted by the model, {len(rec.calls)} timed proposals")
    accepted = np.array([a for _, _, a in rec.steps])
    conf = np.array([c for cs, _, a in rec.steps for i, c in enumerate(cs) if i <= a])
    hit = np.array([i < a for cs, _, a in rec.steps for i, _ in enumerate(cs) if i <= a])
    edges = [0, 0.5, 0.7, 0.85, 0.9, 1.01]
    print("acceptance by the draft's confidence (drafts reached by an accepted run): " + ", ".join(
        f"[{lo}, {hi}) {hit[(conf >= lo) & (conf < hi)].mean():.2f} of {((conf >= lo) & (conf < hi)).sum()}"
        for lo, hi in zip(edges, edges[1:]) if ((conf >= lo) & (conf < hi)).any()))
    print(f"mean accepted a step with {args.k} drafts: {accepted.mean():.2f}")
    costs = Costs(rec)
    base = replay(rec, costs, pmin(5, 0.85))
    print(f"pass {costs.per_pass * 1e3:.2f} ms + {costs.fixed * 1e3:.2f} ms a proposal; verification ms by rows: "
          + ", ".join(f"{r}: {np.median(v) * 1e3:.1f}" for r, v in sorted(rec.verify.items()) if len(v) >= 3))
    print("| rule | drafted a step | tokens a step | ms a token | against pmin k=5 tau=0.85 |\n|---|---|---|---|---|")
    rules = [(f"pmin k={k} tau={t}", pmin(k, t)) for k in (3, 4, 5, 6, 8) for t in (0.0, 0.7, 0.85, 0.9)]
    rules += [(f"cum k={k} tau={t}", cumulative(k, t)) for k in (5, 8) for t in (0.4, 0.5, 0.6)]
    for name, rule in rules:
        r = replay(rec, costs, rule)
        print(f"| {name} | {r['drafted']:.2f} | {r['tokens']:.2f} | {r['ms']:.2f} | {base['ms'] / r['ms']:.3f}x |")


if __name__ == "__main__":
    main()

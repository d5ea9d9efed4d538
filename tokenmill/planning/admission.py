"""SLO-aware admission (`tokenmill serve --slo ttft=...,tpot=...`): on arrival, predict a request's
time to first token and the time per output token of the batch it would join; if either misses its
bound because of the load, reject it at once (429, Retry-After = the predicted drain time) rather
than let it, and everyone queued after it, miss.

Inputs are plain data the front end has or cheaply gets: the core's load snapshot (reported with
every step), the requests it submitted since that snapshot, the recent arrival rate of prompt
tokens, and the request's own lengths. The prediction (FCFS, chunked prefill):

  TTFT = (steps to prefill the tokens ahead plus the prompt) x (time of such a mixed step)
         + (wait for a sequence slot when max_num_seqs are running)
  TPOT = time of a step with the decodes it would join (capped at max_num_seqs) plus the prefill
         tokens that arrive per step at the recent rate (solved as a fixed point).

A request that would miss its SLO even on an idle engine is admitted: waiting cannot help it. So is
one whose idle prediction is within the bound but above the margin: an idle engine must not refuse it.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from tokenmill.core.messages import SchedulerLoad
from tokenmill.errors import ConfigError
from tokenmill.planning.cost_model import StepCostModel
from tokenmill.planning.step_shape import StepShape

SLO_NAMES = ("ttft", "tpot")


def parse_admission_slo(text: str) -> dict[str, float]:
    """'ttft=500ms,tpot=100ms' -> seconds; only the bounds admission can predict (not itl or e2e,
    which bench serve and simulate accept)."""
    from tokenmill.bench.serve_metrics import parse_slo

    try:
        slo = parse_slo(text, SLO_NAMES, "ttft=1s,tpot=100ms")
    except ValueError as e:
        raise ConfigError(f"--slo: {e}", param="slo") from None
    if not slo:
        raise ConfigError(f"--slo takes ttft and/or tpot bounds for admission (e.g. ttft=1s,tpot=100ms), "
                          f"got {text!r}", param="slo")
    return slo


LoadSnapshot = SchedulerLoad  # what the core reports with every step (core/messages.py)


@dataclass(frozen=True)
class Prediction:
    ttft: float
    tpot: float
    admit: bool
    retry_after: float = 0.0  # seconds, when not admitted
    reason: str = ""


class SLOAdmission:
    def __init__(self, cost: StepCostModel, slo: dict[str, float], max_num_batched_tokens: int, max_num_seqs: int,
                 margin: float = 0.9, rate_window: float = 10.0):
        self.cost = cost
        self.ttft_slo = slo.get("ttft")
        self.tpot_slo = slo.get("tpot")
        self.budget = max_num_batched_tokens
        self.max_seqs = max_num_seqs
        self.margin = margin  # admit only below this fraction of each bound (the model's error)
        self.window = rate_window
        self._arrivals: deque[tuple[float, int]] = deque()  # (time, prompt tokens) of admitted requests

    def record(self, now: float, prompt_tokens: int) -> None:
        self._arrivals.append((now, prompt_tokens))

    def prompt_token_rate(self, now: float) -> float:
        while self._arrivals and self._arrivals[0][0] < now - self.window:
            self._arrivals.popleft()
        if not self._arrivals:
            return 0.0
        span = max(now - self._arrivals[0][0], self.window / 4)
        return sum(n for _, n in self._arrivals) / span

    def _step(self, decodes: int, context: float, prefill: float, chunk: int) -> float:
        """A step with `decodes` sequences of `context` tokens each and `prefill` tokens of chunks of
        `chunk` tokens (all continuous values rounded to a shape)."""
        prefill = max(0, int(prefill))
        n_chunks = math.ceil(prefill / chunk) if prefill else 0
        q = [1] * decodes + [min(chunk, prefill)] * n_chunks
        ctx = [max(2, int(context))] * decodes + [min(chunk, prefill)] * n_chunks
        return self.cost.step_time(StepShape.build(q, ctx, [True] * len(q)))

    def predict(self, snap: LoadSnapshot, prompt_tokens: int, max_tokens: int, now: float) -> Prediction:
        s = snap
        decoding = max(0, s.num_running - (1 if s.running_prefill_tokens else 0))
        d = min(decoding, self.max_seqs)
        ctx = s.running_context_tokens / max(s.num_running, 1)
        ahead = s.running_prefill_tokens + s.waiting_prompt_tokens
        per_step = max(self.budget - d, 1)
        chunk = max(prompt_tokens, 1)
        steps = math.ceil((ahead + prompt_tokens) / per_step)
        mixed = self._step(d, ctx, min(per_step, ahead + prompt_tokens), chunk)
        ttft = steps * mixed
        over = s.num_running + s.num_waiting + 1 - self.max_seqs
        left = s.running_decode_tokens_left / max(s.num_running, 1)
        if over > 0 and s.num_running:  # wait for sequences to finish (they free a slot each)
            ttft += over / s.num_running * left * self._step(d, ctx, 0, chunk)
        # the batch it joins: everyone admitted ahead plus it, at the contexts they will have
        joined = min(s.num_running + s.num_waiting + 1, self.max_seqs)
        later_ctx = max(ctx, prompt_tokens + max_tokens / 2)
        # prompts arriving meanwhile add prefill chunks to its steps; an idle engine has no such
        # traffic to extrapolate (what arrives next is judged by this same check)
        rate = self.prompt_token_rate(now) if s.num_running + s.num_waiting else 0.0
        tpot = self._step(joined, later_ctx, 0, chunk)
        for _ in range(4):  # fixed point: arriving prompt tokens per step depend on the step time
            tpot = self._step(joined, later_ctx, min(rate * tpot, self.budget - joined), chunk)
        return self._decide(ttft, tpot, prompt_tokens, max_tokens, left, mixed, s)

    def _decide(self, ttft: float, tpot: float, prompt_tokens: int, max_tokens: int, left: float, step: float,
                s: LoadSnapshot) -> Prediction:
        idle_ttft = self._step(0, 0, prompt_tokens, max(prompt_tokens, 1))
        idle_tpot = self._step(1, prompt_tokens + max_tokens / 2, 0, 1)
        # rejected only where waiting can get it admitted: its idle prediction within the margin (one
        # between margin x bound and the bound was refused by an idle engine, at every retry)
        if self.ttft_slo is not None and ttft > self.margin * self.ttft_slo >= idle_ttft:
            wait = ttft - self.margin * self.ttft_slo
            return Prediction(ttft, tpot, False, wait, f"predicted time to first token {1000 * ttft:.0f} ms "
                                                      f"exceeds the SLO of {1000 * self.ttft_slo:.0f} ms")
        if self.tpot_slo is not None and tpot > self.margin * self.tpot_slo >= idle_tpot:
            # until the running requests have produced about half of what they have left
            wait = max(left / 2 * step, step)
            return Prediction(ttft, tpot, False, wait, f"predicted time per output token {1000 * tpot:.0f} ms "
                                                      f"exceeds the SLO of {1000 * self.tpot_slo:.0f} ms")
        return Prediction(ttft, tpot, True)


def snapshot_of(scheduler) -> LoadSnapshot:
    """The load snapshot of a live scheduler (what the core reports)."""
    return scheduler.load()

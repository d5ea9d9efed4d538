"""When to speculate, from measured cost.

Speculation spends compute that batching already uses well at high concurrency. The rule: per
batch-size bucket (running requests 1, 2-3, 4-7, ... powers of two), keep an exponential average
of output tokens per second over decode-only steps with speculation and without; speculate when
its average is higher. Unmeasured choices are tried first, and one step in `explore_every` takes
the other choice so that both estimates follow the workload (costs at most 1/explore_every of the
difference). Steps with prefill chunks are not measured (their time is mostly the prefill).
The scheduler asks a step ahead (the runner drafts after sampling, for the next step), so a step
run without speculation pays no proposer either: with a draft model that is most of the cost.
While prompts wait or are still prefilling, nobody drafts: such steps are compute-bound (their
GEMMs are dense), so a draft costs as much as a prompt token, takes its place in the token budget,
and a rejected one is lost work (at concurrency 16 and 64 that cost 4-7% of throughput).
"""

from __future__ import annotations


class SpecPolicy:
    def __init__(self, explore_every: int = 16, alpha: float = 0.2):
        self.explore_every = explore_every
        self.alpha = alpha
        self.rate: dict[tuple[int, bool], float] = {}  # (bucket, speculated) -> output tokens/s
        self.steps: dict[int, int] = {}

    @staticmethod
    def bucket(num_running: int) -> int:
        return max(num_running, 1).bit_length()

    def speculate(self, num_running: int, prefill_pending: bool = False) -> bool:
        if prefill_pending:
            return False
        b = self.bucket(num_running)
        on, off = self.rate.get((b, True)), self.rate.get((b, False))
        if on is None or off is None:
            return on is None  # measure speculation first, then a step without it
        self.steps[b] = step = self.steps.get(b, 0) + 1
        best = on >= off
        return not best if step % self.explore_every == 0 else best

    def observe(self, num_running: int, speculated: bool, elapsed: float, num_output_tokens: int) -> None:
        if elapsed <= 0 or num_output_tokens <= 0:
            return
        key = (self.bucket(num_running), speculated)
        rate = num_output_tokens / elapsed
        old = self.rate.get(key)
        self.rate[key] = rate if old is None else (1 - self.alpha) * old + self.alpha * rate

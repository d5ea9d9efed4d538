"""When to speculate, from measured cost.

Speculation spends compute that batching already uses well at high concurrency. The rule: per
batch-size bucket (running requests 1, 2-3, 4-7, ... powers of two), keep an exponential average
of output tokens per second over decode-only steps with speculation and without; speculate when
its average is higher by a margin (5%): near a tie speculation is not worth it, because it
advances some requests faster than others, and once those finish the rest decode in a smaller,
less efficient batch, a cost that no single step's rate shows (at concurrency 16 on equal-length
requests that tail cost ~3%). Unmeasured choices are tried first (speculation, then a step without
it), except in a bucket entered from a larger one that measured speculation slower (a batch draining): there
the step without it goes first and speculation is tried after `explore_every` steps.
To follow the workload the other choice is tried now and then: after `explore_every` steps, and
each time such a try confirms the choice (the tried one still measures slower) the wait doubles,
up to `max_explore_every`; a try that changes the choice resets it. A settled choice so costs at
most 1/max_explore_every of the difference (at concurrency 64 a verification step is ~15% slower
per token than a plain one: exploring one step in 16 cost ~1% of the decode phase, one in 64
~0.25%), and a changed workload is noticed within max_explore_every steps.
Steps with prefill chunks are not measured (their time is mostly the prefill).
Measurements are forgotten with the requests they were taken on: once every request that was
running when a bucket last measured has finished (a full turnover of the batch), that bucket's
averages, tries and backoff are dropped and it measures both choices anew. Otherwise a bucket
measured in the tail of a concurrent run (its last, worst-matched requests, where speculation
measured slower) kept that verdict for the next workload, and its exponential average needed several
tries, 16, 32 and 64 steps apart, to recover (one stream after concurrency 64: 1.0x against 1.6x on
a fresh engine). A busy large bucket is forgotten only after a whole batch's worth of requests has
come and gone. A bucket that measured speculation faster keeps its averages instead: the choice in
use is measured every step, so its average follows a change of workload within a few steps (a
try then finds the other faster), and it is the unchosen one, measured only at tries, whose stale
average lags. Forgotten, each request at one stream spent a step without speculation to measure it
anew and its first tries 16 and 48 steps in, each a whole verification's tokens lost, and a first
speculating step that met new text (no n-gram match) could decide against it on one sample, for
as long as the tries' stale average took to recover (BENCHMARKS.md).
With a draft model (costly tries, below) a bucket that measured speculation slower keeps that
much: its next requests start without speculation, and the wait to the next try runs on across
them (up to `max_explore_every` steps). Measured anew each request, the first speculating step's
catch-up over the prompt and the second measuring step cost every request at one stream (the draft
model ran 0.91x of no speculation on Qwen2.5-Coder-1.5B, the policy measuring 18 tok/s with it and
31 without).
The scheduler asks a step ahead (the runner drafts after sampling, for the next step), so a step
run without speculation pays no proposer either: with a draft model that is most of the cost.
While prompts wait or are still prefilling, nobody drafts: such steps are compute-bound (their
GEMMs are dense), so a draft costs as much as a prompt token, takes its place in the token budget,
and a rejected one is lost work (at concurrency 16 and 64 that cost 4-7% of throughput).

A draft model's tries are costly: a try drafts from where the draft model stopped, so it first
catches up over every token decoded without it (at 16 requests of Qwen2.5-Coder-1.5B, ~0.5 s of
draft prefill per try, where a plain step takes 62 ms: tries and the first measurement cost 11% of
a 10-second run). So with a draft model (`costly_tries`), a bucket of several requests starts
without speculation, and tries it only where its plain step costs at most twice a one-request
plain step (`cheap_rows`: extra rows are still nearly free, as verification rows need; at 16
requests a step costs 3.4x one request's, at 2-8 requests 1.5-1.9x). The one-request step time
is kept across requests: it is the machine's, not the batch's. Nor is it tried where a verification
would pass `max_try_rows` (16) rows, requests x (k + 1): from there the products are compute-bound
(the kernels stream the weights once per 8 rows), and on Qwen2.5-Coder-1.5B with k = 5 tries at 4
requests (24 rows) ran 0.90x where 2 requests (12 rows) ran 1.08x (BENCHMARKS.md).

How far, at one stream (`DraftLength`): a verification's cost is not proportional to its rows (the
packed kernels work in tiles of 8 activation rows: on a 2-core Xeon 16 rows of SmolLM2 cost 42 ms,
15 rows 48 and 17 rows 54), so the proposer's drafts are cut to the length that gives the most
expected tokens per second of step: tokens 1 + a(1 - a^n)/(1 - a) for n drafts, with a the measured
per-draft acceptance, over the measured step time at 1 + n rows (the whole engine step). A size not
measured yet is taken to cost what the next smaller measured one does, so it is tried (once) where
it could pay. The length of k is also handed to the runner before it drafts (the scheduler's
`max_draft_passes`), so a draft model spends no passes on drafts the cut would drop (2% at k = 5 on
code); what it drafts is cut again at verification, where a draft that stopped early is shorter.
With several requests running, their drafts are not cut. The step costs are
forgotten with the one-stream bucket (each new request, at one stream): a verification's cost grows
with the context, so a size measured expensive late in a long request and never chosen again would
otherwise stay ruled out for every later, shorter one. The acceptance estimate is kept.
"""

from __future__ import annotations

_TRY_STEPS = 4  # a try not measured within this many steps (a prefill came, the bucket changed) lapses


class DraftLength:
    def __init__(self, alpha: float = 0.3, decay: float = 0.97):
        self.alpha, self.decay = alpha, decay
        self.cost: dict[int, float] = {}  # rows of a one-stream decode step -> seconds (average)
        self.kept, self.trials = 0.0, 0.0  # drafts kept, of drafts tried up to the first rejection (decaying)

    def observe(self, rows: int, elapsed: float, num_drafts: int, num_tokens: int) -> None:
        old = self.cost.get(rows)
        self.cost[rows] = elapsed if old is None else (1 - self.alpha) * old + self.alpha * elapsed
        if num_drafts:
            accepted = min(num_tokens - 1, num_drafts)
            self.kept = self.decay * self.kept + accepted
            self.trials = self.decay * self.trials + accepted + (accepted < num_drafts)

    def forget_costs(self) -> None:
        self.cost.clear()

    def best(self, offered: int) -> int:
        """How many of `offered` drafts to verify."""
        if offered + 1 not in self.cost or not self.trials:
            return offered  # measure the full length first, then a plain step
        if 1 not in self.cost:
            return 0
        a = min(self.kept / self.trials, 0.999)
        best, best_value, cost = 0, 0.0, self.cost[1]
        for n in range(offered + 1):
            cost = self.cost.get(n + 1, cost)  # unmeasured: as the next smaller measured size
            value = (1 + a * (1 - a ** n) / (1 - a)) / cost
            if value >= best_value:
                best, best_value = n, value
        return best


class SpecPolicy:
    def __init__(self, explore_every: int = 16, alpha: float = 0.2, max_explore_every: int = 64,
                 margin: float = 0.05, costly_tries: bool = False, cheap_rows: float = 2.0,
                 rows_per_request: int = 1, max_try_rows: int = 16):
        self.costly_tries, self.cheap_rows = costly_tries, cheap_rows
        self.rows_per_request, self.max_try_rows = rows_per_request, max_try_rows  # k + 1; the cap above
        self.plain_seconds: dict[int, float] = {}  # bucket -> a step's seconds without speculation
        self.one_request_seconds: float | None = None  # a plain step of one request (never forgotten)
        self.explore_every = explore_every
        self.margin = margin
        self.max_explore_every = max_explore_every
        self.alpha = alpha
        self.rate: dict[tuple[int, bool], float] = {}  # (bucket, speculated) -> output tokens/s
        self.wait: dict[int, int] = {}  # bucket -> steps until the next try of the other choice
        self.interval: dict[int, int] = {}  # bucket -> the current wait between tries
        self.trying: dict[int, bool] = {}  # bucket -> the choice a pending try measures
        self.last_batch: dict[int, int] = {}  # bucket -> the newest admission it measured (turnover)
        self.slow_before: set[int] = set()  # costly tries: buckets whose forgotten requests measured it slower
        self._newest = 0  # the newest admission running in the step being scheduled
        self.length = DraftLength()

    @staticmethod
    def bucket(num_running: int) -> int:
        return max(num_running, 1).bit_length()

    def best(self, b: int) -> bool | None:
        on, off = self.rate.get((b, True)), self.rate.get((b, False))
        if on is None or off is None:
            return None
        return on > off * (1 + self.margin)

    def _larger_bucket_choice(self, b: int) -> bool | None:
        measured = sorted(bb for bb, _ in self.rate if bb > b and self.best(bb) is not None)
        return self.best(measured[0]) if measured else None

    def _forget_turned_over(self, oldest: int) -> None:
        """Drop the buckets whose measured requests have all finished (admitted before `oldest`)."""
        for b in [b for b, newest in self.last_batch.items() if newest < oldest]:
            del self.last_batch[b]
            if b == self.bucket(1):
                self.length.forget_costs()
            verdict = self.best(b)
            if verdict is True:
                continue  # speculation faster: its average follows every step, so it stays (docstring)
            if self.costly_tries and (verdict is False or (verdict is None and b in self.slow_before)):
                self.slow_before.add(b)  # its wait (and backoff) run on, across requests, to the next try
                self.wait.setdefault(b, self.max_explore_every)
            else:
                self.slow_before.discard(b)
                self.wait.pop(b, None)
                self.interval.pop(b, None)
            self.trying.pop(b, None)
            for on in (True, False):
                self.rate.pop((b, on), None)
            self.plain_seconds.pop(b, None)

    def speculate(self, num_running: int, prefill_pending: bool = False,
                  admitted: tuple[int, int] = (0, 0)) -> bool:
        """`admitted`: the admission numbers of the oldest and newest running request (turnover)."""
        oldest, self._newest = admitted
        if self.last_batch:
            self._forget_turned_over(oldest)
        if prefill_pending:
            return False
        b = self.bucket(num_running)
        if self.costly_tries and num_running > 1 and (
                num_running * self.rows_per_request > self.max_try_rows or not self._rows_cheap(b)):
            return False
        best = self.best(b)
        if best is None:
            if (b, True) not in self.rate and (b in self.slow_before or self._larger_bucket_choice(b) is False):
                if (b, False) not in self.rate:
                    return False  # without speculation first, as the earlier requests or the larger bucket chose
                self.wait[b] = wait = self.wait.get(b, self.explore_every) - 1
                return wait <= 0  # then speculation, after a wait (again each step until it is measured)
            return (b, True) not in self.rate  # measure speculation first, then a step without it
        self.wait[b] = wait = self.wait.get(b, self.explore_every) - 1
        if wait > 0 or (b in self.trying and wait > -_TRY_STEPS):
            return best
        self.trying[b] = not best  # measured a step later; a try left unmeasured is made again
        self.wait[b] = 0
        return not best

    def _rows_cheap(self, b: int) -> bool:
        plain, one = self.plain_seconds.get(b), self.one_request_seconds
        return plain is not None and one is not None and plain <= self.cheap_rows * one

    def draft_length(self, num_running: int, offered: int) -> int:
        return self.length.best(offered) if num_running == 1 else offered

    def observe(self, num_running: int, speculated: bool, elapsed: float, num_output_tokens: int,
                num_rows: int = 0, num_drafts: int = 0) -> None:
        """`num_rows`, `num_drafts`: the step's tokens and drafts (0: not known)."""
        if elapsed <= 0 or num_output_tokens <= 0:
            return
        if num_running == 1 and num_rows:
            self.length.observe(num_rows, elapsed, num_drafts, num_output_tokens)
        b = self.bucket(num_running)
        self.last_batch[b] = self._newest
        if not speculated:
            self.plain_seconds[b] = self._average(self.plain_seconds.get(b), elapsed)
            if num_running == 1:
                self.one_request_seconds = self._average(self.one_request_seconds, elapsed)
        before = self.best(b)
        key = (b, speculated)
        self.rate[key] = self._average(self.rate.get(key), num_output_tokens / elapsed)
        if self.trying.get(b) == speculated:  # a try's result: back off if it confirmed the choice
            del self.trying[b]
            kept = self.best(b) == before
            interval = self.interval.get(b, self.explore_every)
            self.interval[b] = min(2 * interval, self.max_explore_every) if kept else self.explore_every
            self.wait[b] = self.interval[b]

    def _average(self, old: float | None, value: float) -> float:
        return value if old is None else (1 - self.alpha) * old + self.alpha * value

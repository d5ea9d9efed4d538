"""Engine statistics: what one step did, what finished, and loggers that consume them."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

from tokenmill.core.messages import SchedulerStats

logger = logging.getLogger("tokenmill.stats")


@dataclass
class FinishedRequestStats:
    finish_reasons: list[str]  # one per sample (n > 1 has several)
    e2e_latency: float
    queue_time: float
    num_prompt_tokens: int
    num_generation_tokens: int
    num_cached_tokens: int
    ttft: float | None
    spec: tuple[int, int, int] = (0, 0, 0)  # verifications with drafts, draft tokens, accepted draft tokens


@dataclass
class IterationStats:
    num_prompt_tokens: int = 0  # prompts that got their first token this step
    num_generation_tokens: int = 0
    ttfts: list[float] = field(default_factory=list)
    itls: list[float] = field(default_factory=list)
    finished: list[FinishedRequestStats] = field(default_factory=list)


class StatLogger:
    """Receives stats after every engine step (on the engine thread)."""

    def record(self, sched: SchedulerStats, it: IterationStats) -> None: ...


class LoggingStatLogger(StatLogger):
    """A periodic one-line summary, like vLLM's."""

    def __init__(self, interval: float = 10.0):
        self.interval = interval
        self.last = time.monotonic()
        self.prompt_tokens = self.gen_tokens = 0
        self.last_queries = self.last_hits = 0
        self.last_draft_tokens = self.last_accepted = self.last_drafts = 0

    def record(self, sched: SchedulerStats, it: IterationStats) -> None:
        self.prompt_tokens += it.num_prompt_tokens
        self.gen_tokens += it.num_generation_tokens
        now = time.monotonic()
        if now - self.last < self.interval:
            return
        dt = now - self.last
        q, h = sched.prefix_queries - self.last_queries, sched.prefix_hits - self.last_hits
        if self.prompt_tokens or self.gen_tokens or sched.num_running or sched.num_waiting:
            logger.info("prompt %.1f tok/s, generation %.1f tok/s, running %d, waiting %d, KV cache %.1f%%, "
                        "prefix cache hit rate %.1f%%, preemptions %d", self.prompt_tokens / dt,
                        self.gen_tokens / dt, sched.num_running, sched.num_waiting,
                        100 * sched.kv_cache_usage, 100 * h / q if q else 0.0, sched.num_preemptions)
        spec = sched.spec_decoding
        if spec is not None and spec.num_draft_tokens > self.last_draft_tokens:
            drafted = spec.num_draft_tokens - self.last_draft_tokens
            accepted = spec.num_accepted_tokens - self.last_accepted
            logger.info("speculative decoding: %d draft tokens, acceptance rate %.1f%%, mean acceptance length "
                        "%.2f", drafted, 100 * accepted / drafted,
                        1 + accepted / max(spec.num_drafts - self.last_drafts, 1))
            self.last_draft_tokens, self.last_accepted = spec.num_draft_tokens, spec.num_accepted_tokens
            self.last_drafts = spec.num_drafts
        self.last, self.prompt_tokens, self.gen_tokens = now, 0, 0
        self.last_queries, self.last_hits = sched.prefix_queries, sched.prefix_hits

"""Continuous batching with chunked prefill and preemption.

Every step builds one batch under a token budget (max_num_batched_tokens) and a sequence cap
(max_num_seqs): running requests that decode come first (one token each), then running requests
still prefilling (a chunk each), then waiting requests in arrival order (prefix-cache hits first,
then a chunk of the rest). When the KV pool runs out, the most recently admitted running request
not yet in this step's batch is preempted: its blocks are freed and it goes back to the front of
the waiting queue, to be recomputed later (cheaply, through the prefix cache).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_tokens: int  # new tokens this step (1 for a decode)
    block_ids: list[int]

    @property
    def samples(self) -> bool:
        """Whether this step reaches the request's last known token (so a new token is sampled)."""
        return self.request.num_computed_tokens + self.num_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    num_batched_tokens: int
    preempted: list[Request] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    kv_blocks_used: int
    kv_blocks_total: int
    prefix_queries: int  # cumulative, in tokens
    prefix_hits: int
    num_preemptions: int  # cumulative


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_batched_tokens: int, max_num_seqs: int,
                 max_model_len: int):
        self.kv = kv
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    # --- queue management -------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def finish_requests(self, request_ids, status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> list[Request]:
        """Abort (or stop) requests wherever they are; frees their blocks at once."""
        done = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.is_finished:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            else:
                self.waiting.remove(req)
            self._finish(req, status)
            done.append(req)
        return done

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        self.kv.free(req)
        del self.requests[req.request_id]

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # --- one step ---------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: dict[str, ScheduledRequest] = {}
        preempted: list[Request] = []

        # 1. running: decodes before chunks of unfinished prefills, each group in admission order
        for req in sorted(self.running, key=lambda r: r.is_prefilling):
            if budget == 0:
                break
            if req.status != RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while self.kv.allocate_slots(req, n) is None:
                victim = next(r for r in reversed(self.running) if r.request_id not in scheduled)
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if req.status == RequestStatus.RUNNING:
                scheduled[req.request_id] = ScheduledRequest(req, n, self.kv.block_ids(req))
                budget -= n

        # 2. waiting, first come first served; not in a step that had to preempt
        now = time.monotonic()
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            req = self.waiting[0]
            hits, num_hit = self.kv.get_computed_blocks(req)
            n = min(req.num_tokens - num_hit, budget)
            if self.kv.allocate_slots(req, n, hits) is None:
                break  # head of line waits for room: later requests do not overtake it
            self.waiting.popleft()
            self.kv.record_prefix_lookup(req.num_tokens, num_hit)
            req.num_computed_tokens = num_hit
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
                req.first_scheduled_time = now
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled[req.request_id] = ScheduledRequest(req, n, self.kv.block_ids(req))
            budget -= n

        batch = list(scheduled.values())
        return SchedulerOutput(batch, self.max_num_batched_tokens - budget, preempted)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def update(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advance progress after the model ran; append sampled tokens; finish requests that hit
        a stop condition. Returns the requests that got a new token."""
        updated = []
        for s in out.scheduled:
            req = s.request
            if req.is_finished:  # aborted while the step ran
                continue
            req.num_computed_tokens += s.num_tokens
            token = sampled.get(req.request_id)
            if token is None:
                continue  # a prefill chunk that did not reach the end of the prompt
            req.append_output(token)
            updated.append(req)
            status = self._check_stop(req, token)
            if status is not None:
                self.running.remove(req)
                self._finish(req, status)
        return updated

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        p = req.params
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        if req.num_output_tokens < p.min_tokens:
            return None
        if token in req.eos_token_ids and not p.ignore_eos:
            req.stop_reason = None
            return RequestStatus.FINISHED_STOPPED
        if token in p._all_stop_token_ids:
            req.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        return None

    def stats(self) -> SchedulerStats:
        used = self.kv.num_used_blocks()
        return SchedulerStats(len(self.running), len(self.waiting), self.kv.usage, used, self.kv.num_blocks,
                              self.kv.prefix_queries, self.kv.prefix_hits, self.num_preemptions)

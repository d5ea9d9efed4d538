"""Continuous batching with chunked prefill and preemption.

Every step builds one batch under a token budget (max_num_batched_tokens) and a sequence cap
(max_num_seqs): running requests that decode come first (one token each), then running requests
still prefilling (a chunk each), then waiting requests in queue order (prefix-cache hits first,
then a chunk of the rest). When the KV pool runs out, a running request is preempted: its blocks are
freed and it goes back to the waiting queue, to be recomputed later (cheaply, through the prefix
cache). Which one, and the waiting queue's order, follow the scheduling policy (request_queue.py):
fcfs preempts the most recently admitted request not yet in this step's batch and puts it back at
the front; priority preempts the lowest-ranked running request (undoing its part of this step if it
had one) and serves the waiting queue by rank, each group of running requests too. The batch goes
to the runner as deltas (scheduler_output.py); `update` takes back the k >= 1 tokens per request a
step yields and returns the step's EngineCoreOutputs.

Speculative decoding: a decoding request's drafts (from the runner's proposer, last step) are
scheduled after its last token, within the budget and max_tokens, with `num_lookahead_slots` more
KV slots for a draft model. After the step, `num_computed_tokens` moves back over the rejected
drafts and the blocks past the accepted tokens (and the next drafts) are freed. When the pool is
short, a request first gives up its drafts before anyone is preempted.
"""

from __future__ import annotations

import logging
import time

from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.messages import EngineCoreOutput, SchedulerLoad, SchedulerStats, SpecDecodingStats
from tokenmill.core.request import Request, RequestStatus, load_of
from tokenmill.core.request_queue import make_queue, preemption_victim, running_order
from tokenmill.core.scheduler_output import CachedRequestData, ModelRunnerOutput, NewRequestData, SchedulerOutput
from tokenmill.core.spec_policy import SpecPolicy

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_num_batched_tokens: int, max_num_seqs: int,
                 max_model_len: int, policy: str = "fcfs", priority_aging: float = 0.0,
                 num_lookahead_slots: int = 0, spec_disable_by_batch_size: int | None = None,
                 spec_policy: SpecPolicy | None = None):
        self.kv = kv
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.policy = policy
        self.priority_aging = priority_aging
        self.waiting = make_queue(policy, priority_aging)
        self.running: list[Request] = []
        self.compiling: list[Request] = []  # waiting for their grammar; they hold nobody up
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.finished_req_ids: list[str] = []  # for the runner, with the next SchedulerOutput
        self.failed: dict[str, str] = {}  # request id -> why: a fault while scheduling it failed it alone
        self.num_lookahead_slots = num_lookahead_slots
        self.spec_disable_by_batch_size = spec_disable_by_batch_size
        self.num_kept_blocks: dict[str, int] = {}  # for the runner: block tables cut after rejections
        self.spec = SpecDecodingStats()
        self.spec_policy = spec_policy  # measured choice per step (spec_policy.py)
        self.num_admitted = 0

    def add_request(self, req: Request) -> None:
        self.requests[req.request_id] = req
        if req.status == RequestStatus.WAITING_FOR_GRAMMAR:
            self.compiling.append(req)
        else:
            self.waiting.add(req)

    def finish_requests(self, request_ids, status: RequestStatus = RequestStatus.FINISHED_ABORTED) -> list[Request]:
        """Abort (or stop) requests wherever they are; frees their blocks at once."""
        done = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None or req.is_finished:
                continue
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
            elif req.status == RequestStatus.WAITING_FOR_GRAMMAR:
                self.compiling.remove(req)
            else:
                self.waiting.remove(req)
            self._finish(req, status)
            done.append(req)
        return done

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        self.kv.free(req)
        del self.requests[req.request_id]
        self.finished_req_ids.append(req.request_id)

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def has_work(self) -> bool:
        """Requests to run, or finished ones the runner has not been told about yet."""
        return bool(self.requests or self.finished_req_ids)

    def _admit_compiled(self) -> None:
        """Requests whose grammar has compiled join the waiting queue; a failed compile fails its
        request alone, as an error (the front end validated the spec, so this is not expected)."""
        for req in [r for r in self.compiling if r.grammar_ready is None or r.grammar_ready.done()]:
            self.compiling.remove(req)
            error = req.grammar_ready.exception() if req.grammar_ready is not None else None
            if error is None:
                req.status = RequestStatus.WAITING
                self.waiting.add(req)
                continue
            logger.error("request %s: grammar failed to compile: %s", req.request_id, error)
            self._finish(req, RequestStatus.FINISHED_ABORTED)
            self.failed[req.request_id] = f"grammar compile failed: {type(error).__name__}: {error}"

    def schedule(self) -> SchedulerOutput:
        if self.compiling:
            self._admit_compiled()
        budget = self.max_num_batched_tokens
        num_tokens: dict[str, int] = {}
        new_reqs: list[NewRequestData] = []
        cached_reqs: list[CachedRequestData] = []
        preempted: list[str] = []

        spec_tokens: dict[str, list[int]] = {}
        speculate = (self.spec_disable_by_batch_size is None
                     or len(self.running) <= self.spec_disable_by_batch_size)
        # drafts present were asked for by the policy last step: verify them;
        # whether to draft for the next step is decided now, so that a step without speculation drafts nothing
        propose = speculate
        if speculate and self.spec_policy is not None:
            seqs = [r.admit_seq for r in self.running]  # none: only prompts to start, which do not draft
            propose = bool(seqs) and self.spec_policy.speculate(
                len(seqs), bool(self.waiting) or any(r.is_prefilling for r in self.running), (min(seqs), max(seqs)))
        # one stream with a draft model: how far it drafts is known now (the policy's length of k)
        alone = propose and self.spec_policy is not None and self.num_lookahead_slots and len(self.running) == 1
        max_passes = self.spec_policy.draft_length(1, self.num_lookahead_slots) if alone else None

        # 1. running: decodes before chunks of unfinished prefills, each group in admission order
        #    (by rank under the priority policy)
        for req in sorted(self.running, key=lambda r: running_order(r, self.policy, self.priority_aging)):
            if budget == 0:
                break
            if req.status != RequestStatus.RUNNING:  # preempted earlier in this loop
                continue
            drafts = self._drafts(req, budget) if speculate else []
            try:
                while True:
                    n = min(req.num_tokens - req.num_computed_tokens + len(drafts), budget)
                    lookahead = self._lookahead(req, req.num_computed_tokens + n)
                    new_blocks = self.kv.allocate_slots(req, n, num_lookahead=lookahead)
                    if new_blocks is not None:
                        break
                    if drafts:  # short of blocks: give up the drafts before preempting anyone
                        drafts = []
                        continue
                    victim = preemption_victim(self.running, num_tokens, self.policy, self.priority_aging)
                    undone = victim.request_id in num_tokens
                    if undone:  # undo its part of this step
                        budget += num_tokens.pop(victim.request_id)
                        spec_tokens.pop(victim.request_id, None)
                        cached_reqs = [c for c in cached_reqs if c.req_id != victim.request_id]
                    self._preempt(victim, undone)
                    preempted.append(victim.request_id)
                    if victim is req:
                        break
            except Exception as e:  # noqa: BLE001 - this request fails, the step goes on
                self._fail(req, e)
                continue
            if req.status == RequestStatus.RUNNING:
                num_tokens[req.request_id] = n
                if drafts:
                    spec_tokens[req.request_id] = drafts
                cached_reqs.append(CachedRequestData(req.request_id, False, [b.block_id for b in new_blocks],
                                                     req.num_computed_tokens))
                budget -= n

        # 2. waiting, in the policy's order; not in a step that had to preempt
        now = time.monotonic()
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            req = self.waiting.peek()
            try:
                hits, num_hit = self.kv.get_computed_blocks(req)
                n = min(req.num_tokens - num_hit, budget)
                if self.kv.allocate_slots(req, n, hits, self._lookahead(req, num_hit + n)) is None:
                    break  # head of line waits for room: later requests do not overtake it
            except Exception as e:  # noqa: BLE001
                self._fail(req, e)
                continue
            self.waiting.pop()
            self.kv.record_prefix_lookup(req.num_tokens, num_hit)
            req.num_computed_tokens = num_hit
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_hit
                req.first_scheduled_time = now
                req.admit_seq, self.num_admitted = self.num_admitted, self.num_admitted + 1
            if req.status == RequestStatus.PREEMPTED:  # the runner still holds its tokens
                cached_reqs.append(CachedRequestData(req.request_id, True, self.kv.block_ids(req), num_hit))
            else:
                new_reqs.append(NewRequestData(req.request_id, req.prompt_token_ids, req.params,
                                               sorted(req.eos_token_ids), self.kv.block_ids(req), num_hit))
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            num_tokens[req.request_id] = n
            budget -= n

        finished, self.finished_req_ids = self.finished_req_ids, []
        kept, self.num_kept_blocks = self.num_kept_blocks, {}
        return SchedulerOutput(new_reqs, cached_reqs, num_tokens, self.max_num_batched_tokens - budget,
                               preempted, finished, spec_tokens, kept, propose, max_passes)

    def _drafts(self, req: Request, budget: int) -> list[int]:
        """The request's drafts that fit this step: after its one known token, within the budget,
        max_tokens and max_model_len (a draft past a stop is verified, then dropped by `update`)."""
        if not req.spec_token_ids or req.num_tokens - req.num_computed_tokens != 1:
            return []
        room = min(budget - 1, req.max_tokens - req.num_output_tokens - 1, self.max_model_len - req.num_tokens - 1)
        if self.spec_policy is not None:  # how far
            room = min(room, self.spec_policy.draft_length(len(self.running), len(req.spec_token_ids)))
        return req.spec_token_ids[:max(room, 0)]

    def _lookahead(self, req: Request, num_after: int) -> int:
        """KV slots for a draft model to write past the step's tokens, when the step samples (and so drafts);
        none past max_model_len (nor drafts): a pool of max_model_len tokens holds a request grown to it."""
        if num_after < req.num_tokens:
            return 0
        return max(0, min(self.num_lookahead_slots, self.max_model_len - num_after))

    def _fail(self, req: Request, error: Exception) -> None:
        """Scheduling `req` raised: it alone ends (reported in the step's outputs as failed)."""
        (self.running if req.status == RequestStatus.RUNNING else self.waiting).remove(req)
        try:
            self.kv.free(req)
        except Exception:  # noqa: BLE001 - its blocks are lost, the engine goes on
            logger.exception("request %s: freeing its KV blocks failed", req.request_id)
        req.status = RequestStatus.FINISHED_ABORTED
        self.requests.pop(req.request_id, None)
        self.finished_req_ids.append(req.request_id)  # the runner may hold its state
        self.failed[req.request_id] = f"{type(error).__name__}: {error}"

    def _preempt(self, req: Request, undone: bool = False) -> None:
        """`undone`: its part of this step was scheduled, then taken back (it will not be written)."""
        self.running.remove(req)
        self.kv.free(req, req.num_computed_tokens if undone else None)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add_preempted(req)

    def update(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Advance progress after the model ran; append each sampled token and check the stop
        conditions after each (tokens after a stop are dropped); finish requests that stopped.
        Returns an output for every request that got tokens or prompt logprobs."""
        outputs = []
        for rid, n in sched.num_scheduled_tokens.items():
            req = self.requests.get(rid)
            if req is None:  # aborted while the step ran
                continue
            req.num_computed_tokens += n
            sampled = result.sampled_token_ids.get(rid, ())
            drafts = sched.scheduled_spec_decode_tokens.get(rid)
            if drafts:  # the KV of rejected drafts is void: compute from the first rejected one again
                num_accepted = len(sampled) - 1
                req.num_computed_tokens -= len(drafts) - num_accepted
                self.spec.record(len(drafts), num_accepted)
                req.spec.record(len(drafts), num_accepted)
            req.spec_token_ids = result.spec_token_ids.get(rid, [])
            prompt_lp = result.prompt_logprobs.get(rid)
            if not sampled and prompt_lp is None:
                continue  # a prefill chunk that did not reach the end of the prompt
            status = None
            for i, token in enumerate(sampled):
                req.append_output(token)
                status = req.stop_status(token, self.max_model_len)
                if status is not None:
                    sampled = sampled[:i + 1]
                    break
            if status is not None:
                self.running.remove(req)
                self._finish(req, status)
            elif drafts or self.num_lookahead_slots:  # free the slots of rejected drafts, keep the next ones'
                kept = self.kv.trim(req, req.num_tokens + len(req.spec_token_ids))
                if kept is not None:
                    self.num_kept_blocks[rid] = kept
            logprobs = result.logprobs.get(rid)
            outputs.append(EngineCoreOutput(
                rid, list(sampled), logprobs[:len(sampled)] if logprobs is not None else None, prompt_lp,
                req.status.finish_reason, req.stop_reason, max(req.num_cached_tokens, 0),
                req.first_scheduled_time, req.num_preemptions, req.spec.num_drafts, req.spec.num_draft_tokens,
                req.spec.num_accepted_tokens))
        return outputs

    def stats(self) -> SchedulerStats:
        used = self.kv.num_used_blocks()
        return SchedulerStats(len(self.running), len(self.waiting) + len(self.compiling), self.kv.usage, used,
                              self.kv.num_blocks, self.kv.prefix_queries, self.kv.prefix_hits, self.num_preemptions,
                              self.load(), self.spec.snapshot() if self.spec.num_drafts else None)

    def load(self) -> SchedulerLoad:
        """The work held, in tokens (what SLO admission predicts from)."""
        return load_of(self.running, [*self.waiting, *self.compiling])

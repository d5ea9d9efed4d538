"""A request as the core sees it: token ids, progress through them, and its KV block hashes."""

from __future__ import annotations

import enum
import hashlib
from array import array
from concurrent.futures import Future

from tokenmill.core.messages import CoreSamplingParams, EngineCoreRequest, SchedulerLoad, SpecDecodingStats


class RequestStatus(enum.IntEnum):
    WAITING_FOR_GRAMMAR = -1  # its structured-output grammar is still compiling
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # finished states: everything after this line
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return {3: "stop", 4: "length", 5: "abort"}.get(int(self))


def hash_block(parent: bytes | None, token_ids, extra: bytes = b"") -> bytes:
    """Chained block hash: equal hashes mean equal tokens in this block AND in every block before
    it (and equal extra keys, e.g. an adapter id), hence equal KV."""
    h = hashlib.sha256(parent or b"")
    h.update(array("I", token_ids).tobytes())
    h.update(extra)
    return h.digest()


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: CoreSamplingParams,
                 eos_token_ids, max_tokens: int, arrival_time: float, cache_salt: bytes = b"", priority: int = 0):
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.eos_token_ids = frozenset(eos_token_ids)
        self.stop_token_ids = frozenset(params.stop_token_ids)
        self.max_tokens = max_tokens
        self.arrival_time = arrival_time
        self.priority = priority  # lower is served first (--scheduling-policy priority)
        self.cache_salt = cache_salt  # extra key of the first block's hash
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.num_cached_tokens = -1  # prefix-cache hit at first admission (-1: not admitted yet)
        self.num_preemptions = 0
        self.spec = SpecDecodingStats()  # this request's verifications (drafts and how many stood)
        self.admit_seq = -1  # the scheduler's count of first admissions when this one was admitted
        self.block_hashes: list[bytes] = []
        self.first_scheduled_time: float | None = None
        # prompt logprobs need logits of every prompt position, so they skip the prefix cache
        self.skip_prefix_cache = params.prompt_logprobs is not None
        self.spec_token_ids: list[int] = []  # the proposer's drafts, verified next step
        self.grammar_ready: Future | None = None  # the worker's compile of params.grammar
        if params.grammar is not None:
            self.status = RequestStatus.WAITING_FOR_GRAMMAR

    @classmethod
    def from_engine_core_request(cls, r: EngineCoreRequest) -> Request:
        return cls(r.request_id, r.prompt_token_ids, r.sampling_params, r.eos_token_ids, r.max_tokens,
                   r.arrival_time, r.cache_salt, r.priority)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_prefilling(self) -> bool:
        """More than the last token still needs its KV computed (prompt, or recompute after preemption)."""
        return self.num_tokens - self.num_computed_tokens > 1

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def append_output(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def stop_status(self, token: int, max_model_len: int) -> RequestStatus | None:
        """Whether `token`, just appended, ends the request (length, EOS or a stop token id); stop
        strings are the front end's."""
        p = self.params
        if self.num_output_tokens >= self.max_tokens or self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        if self.num_output_tokens < p.min_tokens:
            return None
        if token in self.eos_token_ids and not p.ignore_eos:
            self.stop_reason = None
            return RequestStatus.FINISHED_STOPPED
        if token in self.stop_token_ids:
            self.stop_reason = token
            return RequestStatus.FINISHED_STOPPED
        return None

    def update_block_hashes(self, block_size: int) -> list[bytes]:
        """Hashes of every full block of known tokens (computed incrementally)."""
        while (len(self.block_hashes) + 1) * block_size <= self.num_tokens:
            i = len(self.block_hashes)
            parent = self.block_hashes[-1] if i else None
            tokens = self.all_token_ids[i * block_size:(i + 1) * block_size]
            self.block_hashes.append(hash_block(parent, tokens, self.cache_salt if i == 0 else b""))
        return self.block_hashes

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens})")


def load_of(running: list[Request], waiting: list[Request]) -> SchedulerLoad:
    """The work these requests hold, in tokens."""
    run_ctx = run_pf = run_left = wait_prompt = wait_dec = 0
    for r in running:
        run_ctx += r.num_computed_tokens
        run_pf += max(r.num_prompt_tokens - r.num_computed_tokens, 0)
        run_left += r.max_tokens - r.num_output_tokens
    for r in waiting:
        wait_prompt += r.num_tokens - r.num_computed_tokens
        wait_dec += r.max_tokens - r.num_output_tokens
    return SchedulerLoad(len(running), len(waiting), run_ctx, run_pf, run_left, wait_prompt, wait_dec)

"""The runner's own state per request, kept up to date from SchedulerOutput deltas.

The runner never sees the core's Request objects: it learns a request once (NewRequestData), then
per step its new blocks and computed-token count (CachedRequestData), and it appends the tokens it
samples itself. A preempted request keeps its state (tokens, generator: a seeded request resumes
its random stream where it left off; grammar matcher: it stays at the tokens kept) but loses its
block table; a finished one is dropped. A structured-output request's matcher is built here from
the plain grammar spec in its sampling params, and advances with every token appended.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tokenmill.core.messages import CoreSamplingParams
from tokenmill.core.scheduler_output import NewRequestData, SchedulerOutput
from tokenmill.structured_output.params import GrammarSpec

if TYPE_CHECKING:
    from tokenmill.structured_output.matcher import GrammarState

GrammarSource = Callable[[GrammarSpec], Future]  # spec -> its compiled grammar (the worker's cache)


@dataclass(slots=True, eq=False)
class RequestState:
    req_id: str
    token_ids: list[int]  # prompt + sampled
    num_prompt_tokens: int
    params: CoreSamplingParams
    generator: torch.Generator | None  # None: the runner's shared generator
    block_ids: list[int]
    num_computed_tokens: int
    output_token_ids: list[int]
    min_tokens_banned: list[int]  # stop tokens (and EOS unless ignore_eos), banned before min_tokens
    grammar: GrammarState | None = None  # structured output: where the output is in its grammar
    draft_num_computed: int = 0  # speculative decoding with a draft model: tokens with its KV
    tokens_i32: array | None = None  # token_ids for n-gram lookups (token_array), kept from first use

    @classmethod
    def new(cls, r: NewRequestData, device: torch.device, grammars: GrammarSource | None = None) -> RequestState:
        p = r.sampling_params
        gen = torch.Generator(device=device).manual_seed(p.seed) if p.seed is not None else None
        banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(r.eos_token_ids))
        grammar = None
        if p.grammar is not None:
            from tokenmill.structured_output.matcher import GrammarState  # xgrammar: only when used

            if grammars is None:
                raise RuntimeError("a structured-output request reached a runner without a grammar compiler")
            grammar = GrammarState(grammars(p.grammar).result(), stop_token_ids=r.eos_token_ids)
        return cls(r.req_id, list(r.prompt_token_ids), len(r.prompt_token_ids), p, gen, list(r.block_ids),
                   r.num_computed_tokens, [], sorted(banned), grammar)

    def samples(self, num_new: int) -> bool:
        """Whether a step computing `num_new` tokens reaches the last known token (so samples);
        `num_new` counts the step's draft tokens, which come after the known ones."""
        return self.num_computed_tokens + num_new >= len(self.token_ids)

    def with_drafts(self, drafts: list[int]) -> RequestState:
        """A view of this request as if `drafts` had been sampled, for the logits processors at a
        draft position (penalties and min_tokens see the tokens before it)."""
        if not drafts:
            return self
        return RequestState(self.req_id, self.token_ids + drafts, self.num_prompt_tokens, self.params,
                            self.generator, self.block_ids, self.num_computed_tokens,
                            self.output_token_ids + drafts, self.min_tokens_banned, None)

    def token_array(self) -> array:
        """token_ids as int32, for n-gram lookups (ngram.py searches its bytes): built once, then kept
        in step by append and rollback. A numpy array of the list each step cost ~20 us there."""
        if self.tokens_i32 is None:
            self.tokens_i32 = array("i", self.token_ids)
        return self.tokens_i32

    def append(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)
        if self.tokens_i32 is not None:
            self.tokens_i32.append(token_id)
        if self.grammar is not None:
            self.grammar.accept(token_id)

    def rollback(self, num_tokens: int) -> None:
        """Takes back the last `num_tokens` sampled tokens (e.g. rejected draft tokens), with the
        grammar matcher."""
        if not 0 <= num_tokens <= len(self.output_token_ids):
            raise ValueError(f"cannot roll back {num_tokens} of {len(self.output_token_ids)} output tokens")
        if num_tokens:
            del self.token_ids[-num_tokens:], self.output_token_ids[-num_tokens:]
            if self.tokens_i32 is not None:
                del self.tokens_i32[-num_tokens:]
            if self.grammar is not None:
                self.grammar.rollback(num_tokens)


class RequestStates(dict[str, RequestState]):
    def __init__(self, grammars: GrammarSource | None = None):
        super().__init__()
        self.grammars = grammars

    def apply(self, sched: SchedulerOutput, device: torch.device) -> list[tuple[RequestState, int, list[int]]]:
        """Bring the states up to date; returns (state, new tokens, draft tokens) of this step's
        batch, in scheduling order (new tokens count the drafts)."""
        for rid in sched.finished_req_ids:  # first: a new request may reuse a finished one's id
            self.pop(rid, None)
        for rid, keep in sched.num_kept_blocks.items():
            state = self.get(rid)
            if state is not None:
                del state.block_ids[keep:]
        for rid in sched.preempted_req_ids:
            state = self.get(rid)
            if state is not None:
                state.block_ids = []
                state.draft_num_computed = 0
        for r in sched.scheduled_new_reqs:
            self[r.req_id] = RequestState.new(r, device, self.grammars)
        spec = sched.scheduled_spec_decode_tokens
        for r in sched.scheduled_cached_reqs:
            state = self[r.req_id]
            if r.resumed_from_preemption:
                state.block_ids = list(r.new_block_ids)
            else:
                state.block_ids.extend(r.new_block_ids)
            state.num_computed_tokens = r.num_computed_tokens
            # the draft model's KV past what this step computes is void (the scheduler moved back, or
            # dropped drafts); the drafts verified now keep theirs: the proposer stops at the accepted ones
            state.draft_num_computed = min(state.draft_num_computed,
                                           r.num_computed_tokens + len(spec.get(r.req_id, ())))
        return [(self[rid], n, spec.get(rid, [])) for rid, n in sched.num_scheduled_tokens.items()]

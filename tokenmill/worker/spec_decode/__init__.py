"""Speculative decoding in the worker: proposers draft tokens after a step samples; the next step
verifies them in one forward pass (the rejection sampler keeps what the target model agrees with)."""

from __future__ import annotations

from typing import Protocol

from tokenmill.worker.request_state import RequestState


class Proposer(Protocol):
    def propose(self, states: list[RequestState], max_passes: list[int | None] | None = None) -> list[list[int]]:
        """Drafts (up to k tokens) to follow each request's tokens. `max_passes`: per request, the most
        forward passes a draft model may spend on it (None: k); drafts that cost none ignore it."""


def speculates(state: RequestState) -> bool:
    """Whether a request drafts: a structured-output request only while its grammar constrains it
    (its drafts are cut to what the grammar takes, and verification masks each position)."""
    return state.grammar is None or state.grammar.live


def grammar_prefix(state: RequestState, drafts: list[int]) -> list[int]:
    """A structured-output request's drafts up to the first its grammar refuses (vLLM cuts them
    the same way): a refused draft could never be kept, and the positions after it have no mask."""
    return drafts if state.grammar is None else drafts[:state.grammar.valid_prefix(drafts)]

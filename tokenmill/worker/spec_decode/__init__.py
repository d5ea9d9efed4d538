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
    """Structured-output requests do not speculate (their grammar would have to check every draft)."""
    return state.grammar is None

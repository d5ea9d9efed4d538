"""Logits processors: the steps the sampler applies, in order, before temperature / top-k / top-p /
min-p. Each edits a batch's fp32 logits in place for the rows that ask for it, reading per-request
state from the runner's RequestState (never from the core's Request). A new constraint (e.g. a
grammar's token bitmask) is one more processor in the list.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tokenmill.worker.request_state import RequestState


class LogitsProcessor:
    def __call__(self, logits: torch.Tensor, states: Sequence[RequestState], deferred: frozenset[int] = frozenset()
                 ) -> None:
        """logits: [len(states), vocab], row i belongs to states[i]; edit in place. Rows in `deferred`
        are left for `refused` to check after sampling (only rows `deferrable` named)."""
        raise NotImplementedError

    def acts_on(self, state: RequestState) -> bool:
        """Whether this processor may edit `state`'s rows, its draft positions' included. A greedy row
        without logprobs that no processor acts on skips the pipeline (Sampler.plain_greedy); a
        processor that cannot tell says True."""
        return True

    def deferrable(self, states: Sequence[RequestState]) -> list[int]:
        """Rows whose constraint can be checked on the sampled token instead of edited into the
        logits, without changing what is sampled: a refused row is then sampled again, through a
        call without `deferred` (sampler.py)."""
        return []

    def refused(self, states: Sequence[RequestState], token_ids: list[int], rows: list[int]) -> list[int]:
        """Of the deferred `rows`, those whose sampled token breaks the constraint."""
        return []


    def prepare(self, states: Sequence[RequestState]) -> None:
        """Called before the forward of the step that will sample `states` (the same list as the
        coming call): work that depends only on tokens already accepted can start here and
        overlap the forward."""

    def close(self) -> None:
        """Release what the processor holds (threads); called once, when the runner stops."""


class LogitBias(LogitsProcessor):
    def acts_on(self, state):
        return bool(state.params.logit_bias)

    def __call__(self, logits, states, deferred=frozenset()):
        for i, s in enumerate(states):
            bias = s.params.logit_bias
            if bias:
                ids = torch.tensor(list(bias), device=logits.device)
                logits[i, ids] += torch.tensor(list(bias.values()), device=logits.device)


class MinTokens(LogitsProcessor):
    """Bans stop tokens (and EOS unless ignore_eos) until min_tokens have been generated."""

    def acts_on(self, state):  # a draft position comes later in the output: it acts there only if here
        return len(state.output_token_ids) < state.params.min_tokens and bool(state.min_tokens_banned)

    def __call__(self, logits, states, deferred=frozenset()):
        for i, s in enumerate(states):
            if len(s.output_token_ids) < s.params.min_tokens and s.min_tokens_banned:
                logits[i, s.min_tokens_banned] = float("-inf")


class RepetitionPenalty(LogitsProcessor):
    """Divides positive logits (multiplies negative ones) of every token seen in prompt or output."""

    def acts_on(self, state):
        return state.params.repetition_penalty != 1.0

    def __call__(self, logits, states, deferred=frozenset()):
        for i, s in enumerate(states):
            penalty = s.params.repetition_penalty
            if penalty != 1.0:
                seen = torch.tensor(sorted(set(s.token_ids)), device=logits.device)
                row = logits[i, seen]
                logits[i, seen] = torch.where(row > 0, row / penalty, row * penalty)


class PresenceFrequencyPenalty(LogitsProcessor):
    """OpenAI's penalties over the generated tokens: a fixed one per token present, and one per
    occurrence."""

    def acts_on(self, state):
        return bool(state.params.presence_penalty or state.params.frequency_penalty)

    def __call__(self, logits, states, deferred=frozenset()):
        for i, s in enumerate(states):
            p = s.params
            if (p.presence_penalty or p.frequency_penalty) and s.output_token_ids:
                ids, counts = torch.tensor(s.output_token_ids, device=logits.device).unique(return_counts=True)
                logits[i, ids] -= p.frequency_penalty * counts.float() + p.presence_penalty


class GrammarMask(LogitsProcessor):
    """Structured outputs: each constrained row keeps only the tokens its grammar allows next
    (EOS only where the grammar can end). Last of the processors, so it holds whatever the
    penalties did, and before temperature / top-k / top-p, which then act within the grammar.

    A row sampled greedily or by temperature alone (no top-k, top-p, min-p, no seed) is not masked up front:
    its token is drawn from the whole distribution and kept if the grammar takes it, else drawn
    again from the masked one. That is exactly the masked distribution (a kept token t has
    probability p(t) + (1 - p(A)) p(t) / p(A) = p(t) / p(A) for the allowed set A; greedy's argmax,
    when allowed, is the masked argmax), and it spares filling and applying the masks of the rows
    whose first token is allowed, most of them. The truncating filters depend on the whole
    distribution, so their rows are masked first; so are seeded rows (`_deferrable`)."""

    def __init__(self):
        self._masks = None  # the batch bitmask, allocated on first use

    def acts_on(self, state):
        return state.grammar is not None

    def deferrable(self, states):
        return [i for i, s in enumerate(states) if _deferrable(s)]

    def prepare(self, states):
        grammars = [None if _deferrable(s) else s.grammar for s in states]
        first = next((g for g in grammars if g is not None), None)
        if first is not None:
            self._bitmasks(first.vocab_size).start(grammars)

    def __call__(self, logits, states, deferred=frozenset()):
        grammars = [None if i in deferred else s.grammar for i, s in enumerate(states)]
        if self._masks is None and all(g is None for g in grammars):
            return
        self._bitmasks(logits.shape[-1]).apply(logits, grammars)

    def refused(self, states, token_ids, rows):
        return [i for i in rows if not states[i].grammar.allows(token_ids[i])]

    def close(self) -> None:
        if self._masks is not None:
            self._masks.close()  # its fill thread
            self._masks = None

    def _bitmasks(self, vocab_size: int):
        if self._masks is None:
            from tokenmill.structured_output.matcher import GrammarBitmasks  # xgrammar: only when used

            self._masks = GrammarBitmasks(vocab_size)
        return self._masks


def _deferrable(state: RequestState) -> bool:
    """A live grammar on a row sampled greedily (an argmax is inside any truncation) or by
    temperature alone, without a seed: a seeded row draws once from the masked distribution, as its
    speculative verification does (rejection_sampler.py), so its tokens do not depend on drafts."""
    p = state.params
    return (state.grammar is not None and state.grammar.live
            and (p.greedy or (state.generator is None and p.top_k <= 0 and p.top_p >= 1.0 and p.min_p <= 0.0)))


def default_processors() -> list[LogitsProcessor]:
    return [LogitBias(), MinTokens(), RepetitionPenalty(), PresenceFrequencyPenalty(), GrammarMask()]

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
    def __call__(self, logits: torch.Tensor, states: Sequence[RequestState]) -> None:
        """logits: [len(states), vocab], row i belongs to states[i]; edit in place."""
        raise NotImplementedError

    def prepare(self, states: Sequence[RequestState]) -> None:
        """Called before the forward of the step that will sample `states` (the same list as the
        coming call): work that depends only on tokens already accepted can start here and
        overlap the forward."""

    def close(self) -> None:
        """Release what the processor holds (threads); called once, when the runner stops."""


class LogitBias(LogitsProcessor):
    def __call__(self, logits, states):
        for i, s in enumerate(states):
            bias = s.params.logit_bias
            if bias:
                ids = torch.tensor(list(bias), device=logits.device)
                logits[i, ids] += torch.tensor(list(bias.values()), device=logits.device)


class MinTokens(LogitsProcessor):
    """Bans stop tokens (and EOS unless ignore_eos) until min_tokens have been generated."""

    def __call__(self, logits, states):
        for i, s in enumerate(states):
            if len(s.output_token_ids) < s.params.min_tokens and s.min_tokens_banned:
                logits[i, s.min_tokens_banned] = float("-inf")


class RepetitionPenalty(LogitsProcessor):
    """Divides positive logits (multiplies negative ones) of every token seen in prompt or output."""

    def __call__(self, logits, states):
        for i, s in enumerate(states):
            penalty = s.params.repetition_penalty
            if penalty != 1.0:
                seen = torch.tensor(sorted(set(s.token_ids)), device=logits.device)
                row = logits[i, seen]
                logits[i, seen] = torch.where(row > 0, row / penalty, row * penalty)


class PresenceFrequencyPenalty(LogitsProcessor):
    """OpenAI's penalties over the generated tokens: a fixed one per token present, and one per
    occurrence."""

    def __call__(self, logits, states):
        for i, s in enumerate(states):
            p = s.params
            if (p.presence_penalty or p.frequency_penalty) and s.output_token_ids:
                ids, counts = torch.tensor(s.output_token_ids, device=logits.device).unique(return_counts=True)
                logits[i, ids] -= p.frequency_penalty * counts.float() + p.presence_penalty


class GrammarMask(LogitsProcessor):
    """Structured outputs: each constrained row keeps only the tokens its grammar allows next
    (EOS only where the grammar can end). Last of the processors, so it holds whatever the
    penalties did, and before temperature / top-k / top-p, which then act within the grammar."""

    def __init__(self):
        self._masks = None  # the batch bitmask, allocated on first use

    def prepare(self, states):
        grammars = [s.grammar for s in states]
        first = next((g for g in grammars if g is not None), None)
        if first is not None:
            self._bitmasks(first.vocab_size).start(grammars)

    def __call__(self, logits, states):
        grammars = [s.grammar for s in states]
        if self._masks is None and all(g is None for g in grammars):
            return
        self._bitmasks(logits.shape[-1]).apply(logits, grammars)

    def close(self) -> None:
        if self._masks is not None:
            self._masks.close()  # its fill thread
            self._masks = None

    def _bitmasks(self, vocab_size: int):
        if self._masks is None:
            from tokenmill.structured_output.matcher import GrammarBitmasks  # xgrammar: only when used

            self._masks = GrammarBitmasks(vocab_size)
        return self._masks


def default_processors() -> list[LogitsProcessor]:
    return [LogitBias(), MinTokens(), RepetitionPenalty(), PresenceFrequencyPenalty(), GrammarMask()]

"""A request's position in its grammar, on the worker side where the sampler runs.

The matcher follows the request's output tokens: `accept` after each sampled token, `rollback`
when tokens are taken back (rejected draft tokens). A preempted request keeps its matcher (the
runner keeps its tokens); a state rebuilt from scratch replays the output tokens. Its bitmask
allows only tokens that keep the output inside the grammar, and the stop tokens (EOS) only where
the grammar can end.
"""

from __future__ import annotations

import logging

import torch
import xgrammar as xgr

logger = logging.getLogger(__name__)


class GrammarState:
    def __init__(self, compiled: xgr.CompiledGrammar, output_token_ids: list[int] = (),
                 stop_token_ids: list[int] | None = None):
        # the request's own EOS ids end the grammar, the same ones the scheduler stops on
        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=list(stop_token_ids or []) or None)
        self.num_accepted = 0
        self.failed = False  # a token the grammar refused was appended (cannot happen when masked)
        for t in output_token_ids:
            self.accept(t)

    @property
    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    def accept(self, token_id: int) -> bool:
        if self.failed or self.matcher.is_terminated():
            return False
        if not self.matcher.accept_token(token_id):
            logger.warning("grammar refused token %d; the request's output is no longer constrained", token_id)
            self.failed = True
            return False
        self.num_accepted += 1
        return True

    def rollback(self, num_tokens: int) -> None:
        """Take back the last `num_tokens` accepted tokens."""
        if num_tokens > 0:
            self.matcher.rollback(num_tokens)
            self.num_accepted -= num_tokens

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, row)


class GrammarBitmasks:
    """The batch's token bitmask (one int32 row per sampled sequence), reused across steps."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)

    def apply(self, logits: torch.Tensor, grammars: list[GrammarState | None]) -> None:
        """Masks row i of `logits` to what grammars[i] allows (rows without a live grammar stay)."""
        rows = [i for i, g in enumerate(grammars) if g is not None and not g.failed and not g.is_terminated]
        if not rows:
            return
        if self.bitmask.shape[0] < len(grammars):
            self.bitmask = xgr.allocate_token_bitmask(max(len(grammars), 2 * self.bitmask.shape[0]), self.vocab_size)
        for i in rows:
            grammars[i].fill_bitmask(self.bitmask, i)
        xgr.apply_token_bitmask_inplace(logits, self.bitmask[:len(grammars)], vocab_size=self.vocab_size,
                                        indices=rows)

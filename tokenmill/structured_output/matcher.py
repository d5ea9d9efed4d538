"""A request's position in its grammar, on the worker side where the sampler runs.

The matcher follows the request's output tokens: `accept` after each sampled token, `rollback`
when tokens are taken back (rejected draft tokens). A preempted request keeps its matcher (the
runner keeps its tokens); a state rebuilt from scratch replays the output tokens. Its bitmask
allows only tokens that keep the output inside the grammar, and the stop tokens (EOS) only where
the grammar can end.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import xgrammar as xgr

logger = logging.getLogger(__name__)


class GrammarState:
    def __init__(self, compiled: xgr.CompiledGrammar, output_token_ids: list[int] = (),
                 stop_token_ids: list[int] | None = None):
        # the request's own EOS ids end the grammar, the same ones the scheduler stops on
        self.vocab_size = compiled.tokenizer_info.vocab_size
        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=list(stop_token_ids or []) or None)
        self.num_accepted = 0
        self.failed = False  # a token the grammar refused was appended (cannot happen when masked)
        for t in output_token_ids:
            self.accept(t)

    @property
    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

    @property
    def live(self) -> bool:
        """Still constraining: neither ended nor broken."""
        return not self.failed and not self.matcher.is_terminated()

    def accept(self, token_id: int) -> bool:
        if self.failed or self.matcher.is_terminated():
            return False
        if not self.matcher.accept_token(token_id):
            logger.warning("grammar refused token %d; the request's output is no longer constrained", token_id)
            self.failed = True
            return False
        self.num_accepted += 1
        return True

    def allows(self, token_id: int) -> bool:
        """Whether the grammar takes `token_id` next (the matcher does not move)."""
        if not self.live or not self.matcher.accept_token(token_id):
            return False
        self.matcher.rollback(1)
        return True

    def rollback(self, num_tokens: int) -> None:
        """Take back the last `num_tokens` accepted tokens."""
        if num_tokens > 0:
            self.matcher.rollback(num_tokens)
            self.num_accepted -= num_tokens

    def valid_prefix(self, drafts: list[int]) -> int:
        """How many leading draft tokens the grammar takes in a row (the matcher does not move)."""
        if not self.live:
            return 0
        n = 0
        while n < len(drafts) and not self.matcher.is_terminated() and self.matcher.accept_token(drafts[n]):
            n += 1
        if n:
            self.matcher.rollback(n)
        return n

    def greedy_tokens(self, argmax: list[int], drafts: list[int],
                      masked_argmax: Callable[[int, torch.Tensor], int]) -> list[int]:
        """Greedy verification under the grammar (the matcher does not move): at each position the
        target's argmax if the grammar takes it, else `masked_argmax(position, banned)`, the argmax
        within what it allows (the plain sampler's deferred greedy rows, logits_processors.py); drafts
        are kept while they equal it. Masks are filled only where an argmax is refused."""
        out, n = [], 0
        try:
            for j in range(len(drafts) + 1):
                t = argmax[j]
                if self.matcher.is_terminated():  # a draft was its stop token: nothing after it is output
                    out.append(t)
                    break
                if self.matcher.accept_token(t):
                    self.matcher.rollback(1)
                else:
                    words = xgr.allocate_token_bitmask(1, self.vocab_size)
                    self.matcher.fill_next_token_bitmask(words)
                    t = masked_argmax(j, unpack_banned(words, self.vocab_size)[0])
                out.append(t)
                if j == len(drafts) or t != drafts[j] or not self.matcher.accept_token(t):
                    break
                n += 1
        finally:
            if n:
                self.matcher.rollback(n)
        return out

    def draft_masks(self, drafts: list[int]) -> torch.Tensor:
        """Banned tokens (bool [len(drafts), vocab]) at the positions after drafts[:1], drafts[:2], ...:
        what the grammar allows there, as verification needs (the matcher does not move). Past a draft
        the grammar refuses, nothing is banned: verification rejects that draft, so those rows are
        never sampled from."""
        words = xgr.allocate_token_bitmask(max(len(drafts), 1), self.vocab_size)
        words.fill_(-1)
        n = 0
        for j, t in enumerate(drafts):
            if not self.matcher.accept_token(t):
                break
            n += 1
            if self.matcher.is_terminated():
                break  # the draft ended the grammar: what follows is never output
            self.matcher.fill_next_token_bitmask(words, j)
        if n:
            self.matcher.rollback(n)
        return unpack_banned(words[:len(drafts)], self.vocab_size)


class GrammarBitmasks:
    """The batch's token bitmask (one int32 row per sampled sequence), reused across steps.

    All constrained rows are filled by one call into xgrammar (its own threads, without the GIL),
    not one Python call per row. `start` begins that fill on a helper thread before the step's
    forward: the masks depend only on tokens already accepted, so they are ready, or nearly, when
    the logits are (vLLM fills them alongside the forward too). `apply` then only waits for them
    and masks the constrained rows; without a matching `start` it fills them itself.
    """

    def __init__(self, vocab_size: int, num_threads: int | str = "auto"):
        self.vocab_size = vocab_size
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self._batch = xgr.BatchGrammarMatcher(num_threads)
        self._pool: ThreadPoolExecutor | None = None
        self._pending: tuple[list[GrammarState | None], Future] | None = None

    def start(self, grammars: list[GrammarState | None]) -> None:
        """Begins filling the masks of `grammars` (the rows about to be sampled) in the background.
        The matchers must not move until `apply` (or the next `start`) collects the result."""
        self._collect()
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="tokenmill-grammar-mask")
        grammars = list(grammars)
        self._pending = (grammars, self._pool.submit(self._fill, grammars))

    def apply(self, logits: torch.Tensor, grammars: list[GrammarState | None]) -> None:
        """Masks row i of `logits` to what grammars[i] allows (rows without a live grammar stay)."""
        pending, self._pending = self._pending, None
        if pending is not None and _same(pending[0], grammars):
            rows, banned = pending[1].result()
        else:
            if pending is not None:
                _wait(pending[1])
            rows, banned = self._fill(grammars)
        if not rows:
            return
        if len(rows) == logits.shape[0]:
            logits[:, :self.vocab_size].masked_fill_(banned, float("-inf"))
        else:
            idx = torch.tensor(rows, device=logits.device)
            logits[idx, :self.vocab_size] = logits[idx, :self.vocab_size].masked_fill_(banned, float("-inf"))

    def close(self) -> None:
        self._collect()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def _fill(self, grammars: list[GrammarState | None]) -> tuple[list[int], torch.Tensor | None]:
        """The live rows and, per live row, which tokens are banned (bool [rows, vocab]).
        Unpacked with torch: xgrammar's CPU apply kernel tests bit by bit (~17 ms for 64 rows of
        a 49k vocabulary on a 2-core Xeon), the shifts below take a few ms and run here, off the
        sampler's path."""
        rows = [i for i, g in enumerate(grammars) if g is not None and g.live]
        if not rows:
            return rows, None
        if self.bitmask.shape[0] < len(rows):
            self.bitmask = xgr.allocate_token_bitmask(max(len(rows), 2 * self.bitmask.shape[0]), self.vocab_size)
        words = self.bitmask[:len(rows)]
        self._batch.batch_fill_next_token_bitmask([grammars[i].matcher for i in rows], words)
        return rows, unpack_banned(words, self.vocab_size)

    def _collect(self) -> None:
        """Waits for a fill nobody collected (e.g. the forward raised): it must not race the next."""
        pending, self._pending = self._pending, None
        if pending is not None:
            _wait(pending[1])


_SHIFTS = torch.arange(32, dtype=torch.int32)


def unpack_banned(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """xgrammar's bitmask words [rows, ceil(vocab / 32)] as banned tokens (bool [rows, vocab])."""
    bits = words.unsqueeze(-1).bitwise_right_shift(_SHIFTS).bitwise_and_(1)  # bit j of word w: token 32w + j
    return bits.view(words.shape[0], -1)[:, :vocab_size] == 0


def _same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def _wait(fut: Future) -> None:
    try:
        fut.result()
    except Exception:  # the step that started it is gone; its error was not this step's
        logger.exception("a grammar bitmask fill failed")

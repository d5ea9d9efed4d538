"""N-gram (prompt lookup) proposer: no extra model. The last n tokens (n from prompt_lookup_max
down to prompt_lookup_min) are looked up earlier in the request's prompt and output; the tokens
that followed their most recent occurrence are the drafts. Strong where output repeats input
(editing or summarizing a given text, code)."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def ngram_drafts(tokens: np.ndarray, k: int, n_min: int, n_max: int) -> list[int]:
    length = len(tokens)
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        windows = sliding_window_view(tokens[:length - 1], n)  # starts with at least one token after
        hits = np.flatnonzero((windows == tokens[length - n:]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return tokens[start:start + k].tolist()
    return []


class NgramProposer:
    def __init__(self, k: int, n_min: int, n_max: int):
        self.k, self.n_min, self.n_max = k, n_min, n_max

    def propose(self, states) -> list[list[int]]:
        return [ngram_drafts(np.asarray(s.token_ids, dtype=np.int64), self.k, self.n_min, self.n_max) for s in states]

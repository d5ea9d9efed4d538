"""N-gram (prompt lookup) proposer: no extra model. The last n tokens (n from prompt_lookup_max
down to prompt_lookup_min) are looked up earlier in the request's prompt and output; the tokens
that followed their most recent occurrence are the drafts (going on from the drafts themselves
where they reach the end: a loop is drafted k tokens ahead). Strong where output repeats input
(editing or summarizing a given text, code). With `spec_factor`, of the occurrences the one that
agrees furthest back wins, the most recent of equals: an output copying its input matches the
input's passage for many tokens and a recent chance repeat of the last few only for those (on the
code-edit benchmark, 16 prompts, mean accepted length 4.93 -> 5.57, BENCHMARKS.md).

How many to draft: a long match is likely to go on, a short one is a guess, and every draft costs
a row of the verification pass. With `spec_factor` the drafts are at most spec_factor x the match's
length (the n-gram extended backwards as far as it still agrees; as SuffixDecoding and vLLM's
suffix method do), up to k: a lone 2-token match drafts 2 tokens, a 12-token copy drafts 12.
"""

from __future__ import annotations

import math
from array import array
from collections.abc import Sequence


def _last_at_token(data: bytes, pat: bytes, end: int) -> int:
    """The last occurrence of `pat` inside data[:end] that starts on a token's (4-byte) boundary."""
    while True:
        pos = data.rfind(pat, 0, end)
        if pos < 0 or pos % 4 == 0:
            return pos
        end = pos + len(pat) - 1


def ngram_drafts(tokens: Sequence[int], k: int, n_min: int, n_max: int, spec_factor: float | None = None
                 ) -> list[int]:
    """`tokens`: the request's, ideally its int32 array (RequestState.token_array). The match is
    found by bytes.rfind over the tokens' bytes, a handful of calls: a numpy search made dozens, and
    after a forward has streamed the weights through the caches each took ~10 us (a lookup in the
    engine: ~200 us, now ~28; BENCHMARKS.md)."""
    t = tokens if isinstance(tokens, array) and tokens.typecode == "i" else array("i", [int(x) for x in tokens])
    length = len(t)
    if length < n_min + 1:
        return []
    data = t.tobytes()

    def last(m: int) -> int:  # where the final m tokens occur last before the end (a byte offset), or -1
        return _last_at_token(data, data[4 * (length - m):], 4 * (length - 1))

    pos = last(1)
    if pos < 0:
        return []
    # the occurrence that agrees furthest back (up to what can change the draft count), the most
    # recent of equals; without a factor, the lookup's usual rule: the most recent occurrence of the
    # longest n-gram up to n_max. A suffix occurs wherever a longer one does: a binary search.
    cap = min(max(n_max, math.ceil(k / spec_factor) if spec_factor else n_max), length - 1)
    matched, top = 1, last(cap) if cap > 1 else -1
    if top >= 0:
        matched, pos = cap, top
    else:
        missing = cap  # the final `missing` tokens occur nowhere before
        while missing - matched > 1:
            mid = (matched + missing) // 2
            p = last(mid)
            matched, missing, pos = (mid, missing, p) if p >= 0 else (matched, mid, pos)
    if matched < n_min:
        return []
    num = k if not spec_factor else max(1, min(k, int(spec_factor * matched)))
    start = pos // 4 + matched
    drafts = t[start:start + num].tolist()
    # a continuation that runs into the end goes on from the drafts themselves, as a lookup repeated
    # after each drafted token would (llama.cpp's lookup decoding drafts so): a looping output drafts
    # its loop k tokens ahead, where the most recent occurrence, one period back, left it 1-2 tokens
    period = length - start
    while len(drafts) < num:
        drafts.append(drafts[len(drafts) - period])
    return drafts


class NgramProposer:
    def __init__(self, k: int, n_min: int, n_max: int, spec_factor: float | None = None):
        self.k, self.n_min, self.n_max, self.spec_factor = k, n_min, n_max, spec_factor

    def propose(self, states, max_passes=None) -> list[list[int]]:  # lookups cost no passes
        return [ngram_drafts(s.token_array(), self.k, self.n_min, self.n_max, self.spec_factor) for s in states]

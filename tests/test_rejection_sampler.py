"""Modified rejection sampling keeps the target distribution exactly.

Synthetic target (p) and draft (q) distributions over a small vocabulary; many seeded draws of the
verifier; Pearson's chi-square against p at significance 0.001 (critical value from the
Wilson-Hilferty approximation). The same check rejects a deliberately biased rule (on rejection,
draw from p instead of the residual max(p - q, 0)), so it can fail.
"""

from __future__ import annotations

import math
from array import array
from collections import Counter

import numpy as np
import torch

from tokenmill.worker.spec_decode.ngram import ngram_drafts
from tokenmill.worker.spec_decode.rejection_sampler import draw, verify_greedy, verify_sampled

Z_999 = 3.0902  # standard normal quantile for significance 0.001
N = 20000


def chi2_critical(df: int, z: float = Z_999) -> float:
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi2_stat(counts: Counter, p: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic of observed counts against probabilities p (cells with p > 0)."""
    n = sum(counts.values())
    cells = [i for i in range(len(p)) if p[i] > 0]
    assert all(c in cells for c in counts), "a token of probability 0 was drawn"
    stat = sum((counts.get(i, 0) - n * float(p[i])) ** 2 / (n * float(p[i])) for i in cells)
    return stat, len(cells) - 1


def assert_distributed_as(counts: Counter, p: torch.Tensor) -> None:
    stat, df = chi2_stat(counts, p)
    assert stat < chi2_critical(df), f"chi2 {stat:.1f} >= {chi2_critical(df):.1f} (df {df}): {sorted(counts.items())}"


def _dists(seed: int, rows: int, vocab: int = 8) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(rows, vocab, generator=g) ** 3
    p[:, -1] = 0.0  # a token the target never picks
    return p / p.sum(dim=-1, keepdim=True)


def test_one_hot_drafts_first_and_later_token_follow_p():
    p = _dists(0, 3)
    drafts = [int(p[0].argsort()[4]), int(p[1].argmax())]  # a middling draft, then a likely one
    g = torch.Generator().manual_seed(1)
    first, second = Counter(), Counter()
    for _ in range(N):
        out = verify_sampled(p, drafts, g)
        first[out[0]] += 1
        if out[0] == drafts[0]:  # the first draft stood: the second token must follow p[1]
            second[out[1]] += 1
    assert_distributed_as(first, p[0])
    assert_distributed_as(second, p[1])


def test_the_plain_samplers_draw_keeps_one_hot_drafts_as_the_rule_does():
    """as_plain (a seeded request's verification): the tokens follow p as the rule's do, and are the
    plain draws of the same generator, drafts or not."""
    p = _dists(0, 3)
    drafts = [int(p[0].argsort()[4]), int(p[1].argmax())]
    g = torch.Generator().manual_seed(1)
    first, second = Counter(), Counter()
    for _ in range(N):
        out = verify_sampled(p, drafts, g, as_plain=True)
        first[out[0]] += 1
        if out[0] == drafts[0]:
            second[out[1]] += 1
    assert_distributed_as(first, p[0])
    assert_distributed_as(second, p[1])
    g1, g2 = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    for _ in range(500):
        out = verify_sampled(p, drafts, g1, as_plain=True)
        assert out == [draw(p[j], g2) for j in range(len(out))]


def _biased(p: torch.Tensor, drafts: list[int], g: torch.Generator, q: torch.Tensor) -> list[int]:
    """Wrong: on rejection draws from p, not from max(p - q, 0)."""
    for j, d in enumerate(drafts):
        if float(torch.rand(1, generator=g)) * float(q[j, d]) < float(p[j, d]):
            continue
        return [draw(p[j], g)]
    return [draw(p[len(drafts)], g)]


def _draft_then_verify(verify, p, q, seed: int) -> Counter:
    g = torch.Generator().manual_seed(seed)
    counts = Counter()
    for _ in range(N):
        d = draw(q[0], g)
        counts[verify(p, [d], g, q)[0]] += 1
    return counts


def test_general_draft_distribution_is_corrected_to_p_and_a_biased_rule_is_caught():
    p, q = _dists(2, 2), _dists(3, 1)
    assert_distributed_as(_draft_then_verify(verify_sampled, p, q, 4), p[0])
    stat, df = chi2_stat(_draft_then_verify(_biased, p, q, 4), p[0])
    assert stat > chi2_critical(df), "the check cannot tell a biased acceptance rule"


def test_one_hot_draft_with_biased_rule_is_caught():
    """Always keeping a one-hot draft over-weights it: the check sees that too."""
    p = _dists(5, 2)
    d = int(p[0, :-1].argmin())
    counts = Counter({d: N // 10, int(p[0].argmax()): N - N // 10})
    stat, df = chi2_stat(counts, p[0])
    assert stat > chi2_critical(df)


def test_seeded_verification_is_reproducible():
    p = _dists(6, 4)
    runs = []
    for _ in range(2):
        g = torch.Generator().manual_seed(8)
        runs.append([verify_sampled(p, [1, 2, 3], g) for _ in range(50)])
    assert runs[0] == runs[1]
    assert len({tuple(r) for r in runs[0]}) > 1  # and random: the draws differ within a run


def test_certain_drafts_are_always_kept():
    p = torch.zeros(3, 5)
    p[0, 2] = p[1, 4] = 1.0
    p[2] = 0.2
    g = torch.Generator().manual_seed(0)
    assert all(verify_sampled(p, [2, 4], g)[:2] == [2, 4] for _ in range(200))


def test_greedy_verification():
    assert verify_greedy([5, 6, 7], [5, 6]) == [5, 6, 7]  # both kept, plus the bonus token
    assert verify_greedy([5, 9, 7], [5, 6]) == [5, 9]  # the target's token replaces the first miss
    assert verify_greedy([4, 6, 7], [5, 6]) == [4]


def test_ngram_lookup():
    t = np.array([1, 2, 3, 4, 9, 9, 1, 2, 3, 5, 6, 1, 2, 3])
    assert ngram_drafts(t, 3, 2, 4) == [5, 6, 1]  # the most recent earlier "1 2 3" came before "5 6 1"
    assert ngram_drafts(np.array([1, 2, 3, 4]), 3, 1, 3) == []
    assert ngram_drafts(np.array([7, 8, 7]), 2, 1, 2) == [8, 7]


def test_ngram_drafts_as_many_as_the_match_is_long():
    copy = list(range(10, 40))
    t = np.array(copy + [99] + copy[:12])  # the output copies the first 12 tokens of the input so far
    assert ngram_drafts(t, 16, 2, 4, spec_factor=1.0) == copy[12:24]  # 12 tokens agree: 12 drafts
    assert ngram_drafts(t, 5, 2, 4, spec_factor=1.0) == copy[12:17]  # never more than k
    assert ngram_drafts(t, 16, 2, 4, spec_factor=0.5) == copy[12:18]
    assert ngram_drafts(t, 20, 2, 4) == copy[12:30] + [99, 10]  # no factor: always k
    short = np.array([5, 1, 2, 6, 7, 8, 9, 3, 1, 2])  # only "1 2" agrees
    assert ngram_drafts(short, 16, 2, 4, spec_factor=1.0) == [6, 7]
    # the longest n-gram (up to n_max) wins over a more recent shorter one, as without the factor
    t = np.array([1, 2, 3, 4, 9, 9, 1, 2, 3, 5, 6, 0, 2, 3])
    assert ngram_drafts(t, 3, 2, 4, spec_factor=1.0) == [5, 6]
    # past n_max too: an older copy agreeing 8 tokens back beats a recent repeat of the last 4
    t = np.array([5, 6, 7, 8, 1, 2, 3, 4, 20, 21, 22, 9, 9, 1, 2, 3, 4, 30, 31, 5, 6, 7, 8, 1, 2, 3, 4])
    assert ngram_drafts(t, 16, 2, 4, spec_factor=1.0) == [20, 21, 22, 9, 9, 1, 2, 3]
    # no factor: the most recent 4-gram, whose continuation reaches the end and goes on from the drafts
    assert ngram_drafts(t, 16, 2, 4) == ([30, 31, 5, 6, 7, 8, 1, 2, 3, 4] * 2)[:16]


def _lookup_by_definition(tokens, k, n_min, n_max, factor):
    """The lookup rule, position by position: each earlier position of the last token agrees some
    tokens back (up to what can change the draft count); the furthest wins, the most recent of equals."""
    length = len(tokens)
    if length < n_min + 1:
        return []
    cap = min(max(n_max, math.ceil(k / factor) if factor else n_max), length - 1)
    best, hit = 0, -1
    for h in range(length - 1):
        m = 0
        while m < cap and h - m >= 0 and tokens[h - m] == tokens[length - 1 - m]:
            m += 1
        if m and m >= best:
            best, hit = m, h
    if best < n_min:
        return []
    num = k if not factor else max(1, min(k, int(factor * best)))
    seq = list(tokens)
    while len(seq) < length + num:  # what followed the occurrence follows the end, drafts included
        seq.append(seq[hit + 1 + len(seq) - length])
    return seq[length:]


def test_ngram_lookup_follows_its_definition():
    # small alphabets repeat often; large token ids put equal bytes across token boundaries, which the
    # byte search must not take for a match
    rng = np.random.default_rng(0)
    for trial in range(4000):
        scale = (1, 256, 65536, 1 << 24)[trial % 4]
        t = (rng.integers(0, int(rng.integers(2, 6)), int(rng.integers(1, 60))) * scale).tolist()
        k, n_min = int(rng.integers(1, 20)), int(rng.integers(1, 4))
        n_max, factor = n_min + int(rng.integers(0, 4)), (None, 0.5, 1.0, 1.5)[trial // 4 % 4]
        want = _lookup_by_definition(t, k, n_min, n_max, factor)
        assert ngram_drafts(t, k, n_min, n_max, factor) == want
        assert ngram_drafts(array("i", t), k, n_min, n_max, factor) == want


def test_ngram_lookup_drafts_a_loop_on_past_the_end():
    # the most recent "1 2 1 2" ends one period back: its continuation is the loop itself
    assert ngram_drafts([5, 1, 2, 1, 2, 1, 2], 6, 2, 4) == [1, 2, 1, 2, 1, 2]
    assert ngram_drafts([5, 1, 2, 1, 2, 1, 2], 16, 2, 4, spec_factor=1.0) == [1, 2, 1, 2]  # 4 agree


def test_ngram_lookup_skips_matches_across_token_boundaries():
    # 1 << 24 then 0 is the bytes 00 00 00 01 00 00 00 00: the bytes of token 1 sit at offset 3
    assert ngram_drafts([1 << 24, 0, 5, 1], 3, 1, 2) == []
    assert ngram_drafts([1, 7, 1 << 24, 0, 1], 2, 1, 2) == [7, 1 << 24]


def test_a_draft_with_no_mass_outside_a_subset_is_corrected_to_p():
    """A reduced draft vocabulary (draft_vocab.py): the draft's q is zero outside its subset, so the
    target's tokens there come only from the residual max(p - q, 0); each token still follows p,
    those outside the subset included, for a general q and a one-hot q (the draft's argmax)."""
    p = _dists(9, 2)
    q = _dists(10, 1)
    q[0, 4:] = 0.0  # the draft scores tokens 0..3 only
    q = q / q.sum(dim=-1, keepdim=True)
    counts = _draft_then_verify(verify_sampled, p, q, 11)
    assert_distributed_as(counts, p[0])
    assert any(t >= 4 for t in counts)  # tokens outside the subset were produced
    one_hot = torch.zeros_like(q)
    one_hot[0, int(q[0].argmax())] = 1.0
    assert_distributed_as(_draft_then_verify(verify_sampled, p, one_hot, 12), p[0])
    stat, df = chi2_stat(_draft_then_verify(_biased, p, q, 11), p[0])
    assert stat > chi2_critical(df), "the check cannot tell a biased acceptance rule"

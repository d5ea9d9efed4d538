"""Verification of draft tokens against the target model's distributions (one forward pass).

Greedy rows keep drafts while each equals the target's argmax at its position, then add the
target's own token: exactly the tokens decoding without speculation yields. Sampled rows use
modified rejection sampling (Leviathan et al. 2023, Chen et al. 2023): draft d at position j is
kept with probability min(1, p_j(d) / q_j(d)); at the first rejection a token is drawn from
norm(max(p_j - q_j, 0)); when every draft is kept, a bonus token is drawn from p_{k}. Each
token is then distributed exactly as p, the target's distribution after the logits processors,
temperature, top-k, top-p and min-p. Proposers here draft deterministically (n-gram, or a draft
model's argmax), so q_j is one-hot on the draft: keep with probability p_j(d), else draw from p_j
with d removed. Random draws come from the request's own generator when it has a seed.
A seeded request carries that rule out with the plain sampler's own draw instead: a token x from
p_j (one uniform, inverse CDF), d kept if x = d, else x is the step's last token; P(x = d) = p_j(d),
and given x != d, x follows p_j without d. It so uses one uniform per output token on the sampler's
operations, and draws the very tokens it draws without speculation, in any batch, whether a short
pool drops its drafts or preempts it. The price is a CDF over the vocabulary per draft (~0.2 ms at
150k tokens) where the rule needs one per step: what every token costs without speculation, so
requests without a seed keep the cheaper form.
A structured-output request's drafts are what its grammar takes (model_runner.py cuts them); its
positions after them keep what the grammar allows there (GrammarState.draft_masks), and a greedy
one's only where the target's argmax is refused (GrammarState.greedy_tokens), as its plain rows.
"""

from __future__ import annotations

import functools
import itertools

import torch

from tokenmill.core.messages import TokenLogprobs
from tokenmill.worker.request_state import RequestState
from tokenmill.worker.sampler import Sampler, SamplingBatch, first_argmax


def _uniform(generator: torch.Generator) -> float:
    return float(torch.empty(1).uniform_(generator=generator))  # as the sampler's own (sampler.py)


def draw(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from an unnormalized distribution (inverse CDF, one uniform): the plain sampler's
    draw, on the same float32 operations, so the same uniform gives the same token."""
    cdf = probs.cumsum(dim=-1)
    u = torch.empty(1).uniform_(generator=generator) * cdf[-1]
    return int(torch.searchsorted(cdf, u, right=True).clamp_(max=len(probs) - 1))


def verify_sampled(p: torch.Tensor, drafts: list[int], generator: torch.Generator,
                   q: torch.Tensor | None = None, as_plain: bool = False) -> list[int]:
    """p: [len(drafts) + 1, V] target probabilities (rows may be unnormalized, as the sampler's);
    q: [len(drafts), V] draft probabilities, or None for one-hot drafts. `as_plain` (one-hot drafts):
    the plain sampler's draw at each position (docstring). Returns the kept drafts plus one token."""
    if as_plain:
        assert q is None, "the sampler's draw stands for the rule only with one-hot drafts"
        out = []
        for j, d in enumerate(drafts):
            out.append(draw(p[j], generator))
            if out[-1] != d:
                return out
        out.append(draw(p[len(drafts)], generator))
        return out
    p = p / p.sum(dim=-1, keepdim=True)
    out = []
    for j, d in enumerate(drafts):
        pd = float(p[j, d])
        qd = 1.0 if q is None else float(q[j, d])
        if _uniform(generator) * qd < pd:  # u < p/q, with q(d) > 0 since d was drafted from q
            out.append(d)
            continue
        if q is None:
            residual = p[j].clone()
            residual[d] = 0.0
        else:
            residual = (p[j] - q[j]).clamp_(min=0.0)
        out.append(draw(residual, generator))
        return out
    out.append(draw(p[len(drafts)], generator))
    return out


def verify_greedy(argmax: list[int], drafts: list[int]) -> list[int]:
    """argmax: the target's token at each of the len(drafts) + 1 positions."""
    out = []
    for j, d in enumerate(drafts):
        out.append(argmax[j])
        if argmax[j] != d:
            return out
    out.append(argmax[len(drafts)])
    return out


def _grammar_greedy(state: RequestState) -> bool:
    return state.params.greedy and state.grammar is not None and state.grammar.live


def _masked_argmax(logits: torch.Tensor, j: int, banned: torch.Tensor) -> int:
    row = logits[j:j + 1].clone()
    row[:, :banned.shape[0]].masked_fill_(banned, float("-inf"))
    return int(first_argmax(row)[0])


class RejectionSampler:
    def __init__(self, sampler: Sampler, vocab_size: int):
        self.sampler = sampler
        self.vocab_size = vocab_size

    def __call__(self, logits: torch.Tensor, rows: list[tuple[RequestState, list[int]]]
                 ) -> list[tuple[list[int], list[TokenLogprobs] | None]]:
        """logits: the target's at each request's 1 + k verified positions, back to back. Returns per
        request its tokens (kept drafts + one) and, if it asked, their logprobs (the target's raw
        distribution, as without speculation)."""
        starts = list(itertools.accumulate((len(d) + 1 for _, d in rows), initial=0))
        if all(self.sampler.plain_greedy(state) for state, _ in rows):  # argmaxes of the raw logits
            argmax = first_argmax(logits.float()).tolist()
            return [(verify_greedy(argmax[r0:r0 + len(d) + 1], d), None) for (_, d), r0 in zip(rows, starts)]
        views = [state.with_drafts(drafts[:j]) for state, drafts in rows for j in range(len(drafts) + 1)]
        batch = SamplingBatch.build(views, self.vocab_size, logits.device)
        logits = logits.float()
        raw = torch.log_softmax(logits, dim=-1) if batch.max_logprobs >= 0 else None
        # a greedy structured-output row's grammar acts only where an argmax is refused (greedy_tokens)
        deferred = frozenset(r0 for (state, _), r0 in zip(rows, starts) if _grammar_greedy(state))
        logits = self.sampler.process(logits, batch, deferred)
        self._mask_grammar_rows(logits, rows)
        argmax = first_argmax(logits).tolist()  # as the sampler's greedy rows
        probs = None if batch.all_greedy else self.sampler.filtered_probs(logits, batch)
        results, r0, lp_rows, lp_tokens = [], 0, [], []
        for state, drafts in rows:
            n = len(drafts) + 1
            if r0 in deferred:
                tokens = state.grammar.greedy_tokens(argmax[r0:r0 + n], drafts, functools.partial(_masked_argmax,
                                                                                                   logits[r0:r0 + n]))
            elif state.params.greedy:
                tokens = verify_greedy(argmax[r0:r0 + n], drafts)
            else:
                tokens = verify_sampled(probs[r0:r0 + n], drafts, state.generator or self.sampler.generator,
                                        as_plain=state.generator is not None)
            if state.params.logprobs is not None:
                lp_rows.extend(range(r0, r0 + len(tokens)))
                lp_tokens.extend(tokens)
            results.append(tokens)
            r0 += n
        logprobs = iter(())
        if lp_rows:
            sub = SamplingBatch.build([views[i] for i in lp_rows], self.vocab_size, logits.device)
            logprobs = iter(Sampler.logprobs(raw[lp_rows], torch.tensor(lp_tokens, device=raw.device), sub))
        return [(tokens, [next(logprobs) for _ in tokens] if state.params.logprobs is not None else None)
                for (state, _), tokens in zip(rows, results)]

    @staticmethod
    def _mask_grammar_rows(logits: torch.Tensor, rows: list[tuple[RequestState, list[int]]]) -> None:
        """A sampled structured-output request's positions after its drafts keep only what its grammar
        allows there (the first position is its own row, masked by the processors' GrammarMask)."""
        r0 = 0
        for state, drafts in rows:
            if state.grammar is not None and state.grammar.live and drafts and not _grammar_greedy(state):
                banned = state.grammar.draft_masks(drafts)
                part = logits[r0 + 1:r0 + 1 + len(drafts), :banned.shape[1]]
                part.masked_fill_(banned, float("-inf"))
            r0 += len(drafts) + 1

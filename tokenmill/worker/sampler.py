"""Batched sampling with per-request parameters (vLLM/OpenAI semantics).

Order: the logits processors (logits_processors.py: logit bias -> min_tokens -> penalties, then
any added ones) -> greedy argmax, or temperature -> top-k -> top-p -> min-p -> sample. A random
draw is one uniform per row, from the request's own generator when it has a seed, so a seeded
request's samples do not depend on the batch. Logprobs are of the raw model distribution (before
any processing), as vLLM reports by default.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tokenmill.core.messages import TokenLogprobs
from tokenmill.model.kernels import cpu_kernels_loaded
from tokenmill.worker.logits_processors import LogitsProcessor, default_processors
from tokenmill.worker.request_state import RequestState


@dataclass
class SamplingBatch:
    states: list[RequestState]
    temperature: torch.Tensor | None  # [B], 1.0 on greedy rows; None when every row is greedy
    greedy: torch.Tensor | None  # [B] bool; None when every row is
    all_greedy: bool
    top_k: torch.Tensor | None  # [B] long, vocab size = off
    top_p: torch.Tensor | None
    min_p: torch.Tensor | None
    max_logprobs: int  # -1: no row wants logprobs

    @classmethod
    def build(cls, states: list[RequestState], vocab_size: int, device) -> SamplingBatch:
        ps = [s.params for s in states]
        greedy = [p.greedy for p in ps]
        top_k = [p.top_k if p.top_k > 0 else vocab_size for p in ps]
        top_p = [p.top_p for p in ps]
        min_p = [p.min_p for p in ps]
        lp = [p.logprobs for p in ps if p.logprobs is not None]

        def t(values, dtype=torch.float32):
            return torch.tensor(values, dtype=dtype, device=device)

        all_greedy = all(greedy)  # then no row draws: no per-row tensors (each op costs a step time)
        return cls(
            states=states,
            temperature=None if all_greedy else t([1.0 if g else p.temperature for g, p in zip(greedy, ps)]),
            greedy=None if all_greedy else t(greedy, torch.bool),
            all_greedy=all_greedy,
            top_k=t(top_k, torch.long) if any(k < vocab_size for k in top_k) else None,
            top_p=t(top_p) if any(p < 1.0 for p in top_p) else None,
            min_p=t(min_p) if any(p > 0.0 for p in min_p) else None,
            max_logprobs=max(lp) if lp else -1,
        )


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]  # per row, when the request asked for logprobs


class Sampler:
    def __init__(self, generator: torch.Generator, processors: Sequence[LogitsProcessor] | None = None):
        self.generator = generator  # for requests without a seed
        self.processors = list(default_processors() if processors is None else processors)

    def close(self) -> None:
        for processor in self.processors:
            processor.close()

    def prepare(self, states: list[RequestState]) -> None:
        """Before the forward of a step that will sample `states`: lets the processors start
        work that needs no logits (a grammar's bitmask) so it overlaps the forward."""
        for processor in self.processors:
            processor.prepare(states)

    def plain_greedy(self, state: RequestState) -> bool:
        """Greedy, no logprobs, and no processor acts on the request: its token is the argmax of its
        raw logits."""
        return (state.params.greedy and state.params.logprobs is None
                and not any(p.acts_on(state) for p in self.processors))

    def sample(self, logits: torch.Tensor, states: list[RequestState], vocab_size: int) -> SamplerOutput:
        """A token per row of `states`. Rows that are all plain greedy skip the sampling batch and
        the pipeline: after the LM head each op starts cold, and those cost ~0.1 ms a step."""
        if all(self.plain_greedy(s) for s in states):
            return SamplerOutput(first_argmax(logits.float()).tolist(), [None] * len(states))
        return self(logits, SamplingBatch.build(states, vocab_size, logits.device))

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        deferred = sorted({i for p in self.processors for i in p.deferrable(batch.states)})
        kept = logits[deferred] if deferred else None  # a copy of their logits, for a second draw
        logits = logits.float()
        raw_logprobs = torch.log_softmax(logits, dim=-1) if batch.max_logprobs >= 0 else None
        logits = self.process(logits, batch, frozenset(deferred))
        sampled = self._draw(logits, batch)
        token_ids = sampled.tolist()
        refused = sorted({i for p in self.processors for i in p.refused(batch.states, token_ids, deferred)})
        if refused:
            self._redraw(kept[[deferred.index(i) for i in refused]], refused, batch, sampled, token_ids)
        logprobs = self.logprobs(raw_logprobs, sampled, batch) if raw_logprobs is not None else [None] * len(token_ids)
        return SamplerOutput(token_ids, logprobs)

    def process(self, logits: torch.Tensor, batch: SamplingBatch, deferred: frozenset[int] = frozenset()
                ) -> torch.Tensor:
        for processor in self.processors:
            processor(logits, batch.states, deferred)
        return logits

    def _draw(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        if batch.all_greedy:
            return first_argmax(logits)
        greedy = first_argmax(logits) if batch.greedy.any() else None
        sampled = self._sample(logits, batch)  # consumes logits
        return torch.where(batch.greedy, greedy, sampled) if greedy is not None else sampled

    def _redraw(self, logits: torch.Tensor, rows: list[int], batch: SamplingBatch, sampled: torch.Tensor,
                token_ids: list[int]) -> None:
        """Rows whose first token a deferred constraint refused: drawn again with every processor's
        edits made (see GrammarMask)."""
        states = [batch.states[i] for i in rows]
        sub = SamplingBatch.build(states, logits.shape[1], logits.device)
        again = self._draw(self.process(logits.float(), sub), sub)
        for i, token in zip(rows, again.tolist()):
            token_ids[i] = token
        sampled[rows] = again

    def _sample(self, logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        probs = self.filtered_probs(logits, batch)
        # Inverse-CDF sampling: one uniform draw per row (a full-vocab Exp/Gumbel draw costs ~50 ms
        # per step on CPU). The CDF need not be normalized: u is scaled by its total.
        cdf = probs.cumsum_(dim=-1)
        u = torch.empty(len(batch.states), device=probs.device)
        seeded = [i for i, s in enumerate(batch.states) if s.generator is not None]
        if len(seeded) < len(batch.states):
            u.uniform_(generator=self.generator)
        for i in seeded:
            u[i:i + 1].uniform_(generator=batch.states[i].generator)
        u = (u * cdf[:, -1]).unsqueeze(1)
        return torch.searchsorted(cdf, u, right=True).squeeze(1).clamp_(max=probs.shape[1] - 1)

    @staticmethod
    def filtered_probs(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Temperature, top-k, top-p, min-p: each row's distribution, unnormalized (its top token
        weighs 1). In place on the (fresh, per-step) logits: no new vocab-sized buffers."""
        probs = logits.div_(batch.temperature.unsqueeze(1))
        # unnormalized: max is 1 (amax: ~10x max(dim).values on a CPU, which also finds the indices)
        probs = probs.sub_(probs.amax(dim=-1, keepdim=True)).exp_()
        if batch.top_k is not None:
            k_max = int(batch.top_k.max())
            top = torch.topk(probs, k_max, dim=-1).values
            kth = top.gather(1, (batch.top_k.clamp(max=k_max) - 1).unsqueeze(1))
            probs.masked_fill_(probs < kth, 0.0)
        if batch.top_p is not None:
            probs.masked_fill_(probs < _top_p_threshold(probs, batch.top_p), 0.0)
        if batch.min_p is not None:
            probs.masked_fill_(probs < batch.min_p.unsqueeze(1), 0.0)  # the top token's weight is 1
        return probs

    @staticmethod
    def logprobs(raw: torch.Tensor, sampled: torch.Tensor, batch: SamplingBatch):
        k = batch.max_logprobs
        chosen = raw.gather(1, sampled.unsqueeze(1))
        ranks = (raw > chosen).sum(dim=-1) + 1
        top_vals, top_ids = torch.topk(raw, k, dim=-1) if k > 0 else (None, None)
        chosen_l, ranks_l, sampled_l = chosen.squeeze(1).tolist(), ranks.tolist(), sampled.tolist()
        top_vals_l = top_vals.tolist() if k > 0 else None
        top_ids_l = top_ids.tolist() if k > 0 else None
        out = []
        for i, s in enumerate(batch.states):
            n = s.params.logprobs
            if n is None:
                out.append(None)
                continue
            ids = [sampled_l[i]] + (top_ids_l[i][:n] if n else [])
            vals = [chosen_l[i]] + (top_vals_l[i][:n] if n else [])
            out.append(TokenLogprobs(ids, vals, ranks_l[i]))
        return out


_ARGMAX_CHUNK = 2048


def first_argmax(x: torch.Tensor) -> torch.Tensor:
    """Each row's first maximum, as torch.argmax, 2-4x faster on a CPU for vocabulary-wide rows
    (a reduction with indices runs slowly there): the maxima of chunks of each row, then the first
    maximum inside the first chunk that holds the row's. With tokenmill's CPU kernels loaded, one op
    (csrc/sampling.cpp): after the LM head each op starts cold, and eight took 4x one's time."""
    if x.dtype == torch.float32 and x.device.type == "cpu" and x.stride(1) == 1 and cpu_kernels_loaded():
        return torch.ops.tokenmill.argmax_rows(x)
    rows, width = x.shape
    n = width // _ARGMAX_CHUNK
    if n < 2:
        return x.argmax(dim=-1)
    end = n * _ARGMAX_CHUNK
    if x.stride(1) != 1:
        x = x.contiguous()
    # the chunks as a view: reshaping x[:, :end] would copy every row when the width has a tail
    body = x.as_strided((rows, n, _ARGMAX_CHUNK), (x.stride(0), _ARGMAX_CHUNK, 1), x.storage_offset())
    chunk_max = body.amax(dim=-1)
    tail = x[:, end:] if end < width else None
    if tail is not None:
        chunk_max = torch.cat([chunk_max, tail.amax(dim=-1, keepdim=True)], dim=1)
    chunk = chunk_max.argmax(dim=-1)  # the first chunk holding the row's maximum
    inner = body[torch.arange(rows), chunk.clamp(max=n - 1)].argmax(dim=-1)
    found = chunk * _ARGMAX_CHUNK + inner
    if tail is not None:
        found = torch.where(chunk == n, end + tail.argmax(dim=-1), found)
    return found


_TOP_P_CANDIDATES = 256


def _top_p_threshold(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Per row, the smallest probability inside the nucleus: the fewest most likely tokens whose
    mass reaches top_p (of the row's remaining mass). Looks at the top candidates first; only rows
    whose nucleus is wider fall back to a full sort (~1.5 ms a row on CPU)."""
    mass = probs.sum(dim=-1, keepdim=True)
    k = min(_TOP_P_CANDIDATES, probs.shape[1])
    vals = torch.topk(probs, k, dim=-1).values
    threshold = _nucleus_floor(vals, mass, top_p)
    wide = (vals.cumsum(dim=-1)[:, -1:] / mass < top_p.unsqueeze(1)).squeeze(1)
    if wide.any():
        rows = wide.nonzero().squeeze(1)
        full = probs[rows].sort(dim=-1, descending=True).values
        threshold[rows] = _nucleus_floor(full, mass[rows], top_p[rows])
    return threshold


def _nucleus_floor(sorted_vals: torch.Tensor, mass: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    cum = sorted_vals.cumsum(dim=-1) / mass
    # keep a token while the mass before it is below top_p (the top token always stays)
    keep = (cum - sorted_vals / mass) < top_p.unsqueeze(1)
    last = keep.sum(dim=-1, keepdim=True).clamp(min=1) - 1
    return sorted_vals.gather(1, last)


def prompt_logprobs(logits: torch.Tensor, targets: torch.Tensor, k: int) -> list[TokenLogprobs]:
    """Logprob of each next prompt token and the top-k at each position, target first."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(1, targets.unsqueeze(1))
    ranks = ((lp > chosen).sum(dim=-1) + 1).tolist()
    chosen_l, targets_l = chosen.squeeze(1).tolist(), targets.tolist()
    if k > 0:
        vals, ids = torch.topk(lp, k, dim=-1)
        vals_l, ids_l = vals.tolist(), ids.tolist()
    return [TokenLogprobs([targets_l[j]] + (ids_l[j] if k else []), [chosen_l[j]] + (vals_l[j] if k else []),
                          ranks[j]) for j in range(len(targets_l))]

"""Draft-model proposer: a small model with the target's vocabulary drafts k tokens greedily.

Its KV cache lives in the same blocks as the target's (same block ids, its own tensor: each block
holds both models' K/V, and the start-up capacity log counts both). Per request the runner tracks
how far the draft's KV goes (`draft_num_computed`; it moves back with rejections and is lost with
preemption). A proposal first feeds the draft every token it has not seen (the accepted tokens,
or the whole prompt the first time) and takes its argmax, then feeds each draft token to get the
next: 1 + (k - 1) forward passes of the draft per step, all requests batched. A request's drafts
stop after a token the draft gives less than `p_min` (as llama.cpp's --draft-p-min, which drops
that token): the passes after an unlikely guess are likely wasted, but the guess itself has cost
its pass already and is accepted often enough to be worth its verification row (on code, k = 8:
proposing it drafted 1.03-1.05x faster than dropping it; BENCHMARKS.md). The scheduler reserves k
lookahead slots for the draft's K/V past the request's tokens; a request whose blocks hold fewer
gets fewer drafts. With a reduced draft vocabulary (draft_vocab.py) the draft's head scores only
the most frequent tokens. Where the draft's layers run fused (packed weights), a proposal's passes
run in one C++ call (draft_loop.py) that drafts the same tokens.

Lookup first (`lookup_min`): where a request's last `lookup_min` tokens occurred before in its
prompt or output, the tokens that followed are its drafts (the n-gram proposer's rule), and the draft
model does not run for it that step; it catches up on the accepted tokens at its next pass, in one
row. On work that copies its input (code edits) that drafting is free and long; on new code a match
of 4 tokens is rare, and it measured alike with and without (BENCHMARKS.md).
"""

from __future__ import annotations

import time

import numpy as np
import torch

from tokenmill.model.attention.torch_sdpa import padded_block_table
from tokenmill.model.kernels import cpu_kernels_loaded
from tokenmill.worker.request_state import RequestState
from tokenmill.worker.spec_decode.draft_loop import FusedDraftLoop
from tokenmill.worker.spec_decode.ngram import ngram_drafts

# a prompt-lookup match drafts as many tokens as it agrees backwards, up to this (or k): a copy of the
# input goes on for long (on code edits 8 and 16 measured alike, 5 less; BENCHMARKS.md)
LOOKUP_MAX_DRAFTS = 16


def _unseen_from(s: RequestState) -> int:
    """The first token the draft has not seen (at least the last one: its pass gives the first draft)."""
    return min(s.draft_num_computed, len(s.token_ids) - 1)


def draft_pick(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's first maximum and the probability the draft gives it, exp(max - logsumexp): one op
    with tokenmill's CPU kernels (csrc/sampling.cpp)."""
    logits = logits.float()
    if logits.stride(-1) == 1 and cpu_kernels_loaded():
        return torch.ops.tokenmill.argmax_prob_rows(logits)
    best, tokens = logits.max(dim=-1)
    return tokens, (best - torch.logsumexp(logits, dim=-1)).exp()


class DraftModelProposer:
    def __init__(self, model: torch.nn.Module, backend, block_size: int, k: int, device: torch.device,
                 max_model_len: int, p_min: float = 0.0, vocab_ids: torch.Tensor | None = None,
                 lookup_min: int = 0):
        from tokenmill.worker.spec_decode.draft_vocab import ReducedLMHead

        self.model = model
        # the draft's head: its own, or its rows of the reduced vocabulary (column j: token vocab_ids[j])
        self.vocab_ids = vocab_ids
        self.head = model.compute_logits if vocab_ids is None else ReducedLMHead(model.lm_head, vocab_ids)
        self.p_min = p_min
        self.lookup_min = lookup_min  # > 0: a prompt-lookup match this long drafts instead of the model
        self.backend = backend
        self.block_size = block_size
        self.k = k
        self.device = device
        self.max_model_len = max_model_len
        self.kv_cache: torch.Tensor | None = None
        # seconds of the last proposal's passes that caught up on a prompt (more than k + 1 new
        # tokens): a prefill, not the per-step cost of drafting that the speculation policy weighs
        self.prefill_seconds = 0.0
        head = model.lm_head if vocab_ids is None else self.head
        self.fused_loop = FusedDraftLoop(model, head, vocab_ids, block_size)  # passes in one call, where it applies

    def allocate_kv_cache(self, num_blocks: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                          storage: torch.dtype | None = None) -> None:
        from tokenmill.worker.model_runner import allocate_kv_cache

        self.kv_cache = allocate_kv_cache(self.model, num_blocks, self.block_size, num_kv_heads, head_dim, dtype,
                                          storage, self.device)

    @torch.inference_mode()
    def propose(self, states: list[RequestState], max_passes: list[int | None] | None = None) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in states]
        # the draft writes K/V up to position len(tokens) + k - 2: only within the request's blocks
        budget = [min(self.k, len(s.block_ids) * self.block_size - len(s.token_ids) + 1,
                      self.max_model_len - len(s.token_ids)) for s in states]
        for i, n in enumerate(max_passes or ()):
            if n is not None:
                budget[i] = min(budget[i], n)
        for i, s in enumerate(states):
            if self.lookup_min and budget[i] > 0:  # a request with no room drafts nothing: no lookup
                found = ngram_drafts(s.token_array(), max(self.k, LOOKUP_MAX_DRAFTS),
                                     self.lookup_min, self.lookup_min, 1.0)
                if len(found) >= self.lookup_min:
                    drafts[i], budget[i] = found, 0
        active = [i for i, b in enumerate(budget) if b > 0]
        self.prefill_seconds = 0.0
        loop = self.fused_loop.get() if active else None
        if loop is not None and all(len(states[i].token_ids) - _unseen_from(states[i]) <= self.k + 1 for i in active):
            self._propose_fused(loop, states, active, budget, drafts)
        else:
            self._propose_python(states, active, budget, drafts)
        return drafts

    def _propose_fused(self, loop, states: list[RequestState], active: list[int], budget: list[int],
                       drafts: list[list[int]]) -> None:
        """Every pass in one call (draft_loop.py): the first feeds each request's unseen tokens, as
        decode rows."""
        tokens, positions, q_lens = [], [], []
        for i in active:
            s = states[i]
            start = _unseen_from(s)
            tokens += s.token_ids[start:]
            positions += range(start, len(s.token_ids))
            q_lens.append(len(s.token_ids) - start)
        blocks = [states[i].block_ids for i in active]  # all of them: the drafts' slots are past the tokens
        tables = padded_block_table(blocks, [len(b) * self.block_size for b in blocks], self.block_size)
        out = loop.run(torch.tensor(tokens), torch.tensor(positions), torch.tensor(q_lens), tables,
                       torch.tensor([budget[i] for i in active]), self.p_min)
        for i, row in zip(active, out.tolist()):
            drafts[i] = [t for t in row if t >= 0]
            states[i].draft_num_computed = len(states[i].token_ids) + len(drafts[i]) - 1

    def _propose_python(self, states: list[RequestState], active: list[int], budget: list[int],
                        drafts: list[list[int]]) -> None:
        from tokenmill.worker.model_runner import flat_batch

        for step in range(max((budget[i] for i in active), default=0)):
            t0 = time.perf_counter()
            active = [i for i in active if budget[i] > step]
            if not active:
                break
            rows = []
            for i in active:
                s = states[i]
                if step == 0:
                    start = _unseen_from(s)
                    new = s.token_ids[start:]
                else:
                    start, new = len(s.token_ids) + step - 1, [drafts[i][-1]]
                # a few new tokens (the accepted ones) take the decode path as verification rows do:
                # the paged kernel, and the fused one-call layers (fused_decode.py) where they apply
                rows.append((new, start, s.block_ids, len(new) <= self.k + 1))
            order = sorted(range(len(rows)), key=lambda j: not rows[j][3])  # decodes first
            input_ids, positions, layout = flat_batch([rows[j] for j in order], self.block_size, self.device)
            hidden = self.model(input_ids, positions, self.backend.build_metadata(layout))
            if len(layout.query_lens) < len(input_ids):
                hidden = hidden[torch.from_numpy(np.cumsum(layout.query_lens) - 1)]
            tokens, prob = draft_pick(self.head(hidden))
            if self.vocab_ids is not None:
                tokens = self.vocab_ids[tokens]
            if self.p_min > 0:
                keep = (prob >= self.p_min).tolist()
            for j, tok in enumerate(tokens.tolist()):
                i = active[order[j]]
                states[i].draft_num_computed = rows[order[j]][1] + len(rows[order[j]][0])
                drafts[i].append(tok)
                if self.p_min > 0 and not keep[j]:
                    budget[i] = step + 1  # the request's last draft
            if step == 0 and max(layout.query_lens) > self.k + 1:
                self.prefill_seconds += time.perf_counter() - t0

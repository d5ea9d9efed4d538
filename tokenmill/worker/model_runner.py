"""Turns a SchedulerOutput into one flat batch, runs the model once, and samples.

The flat batch holds every scheduled sequence's new tokens back to back, decodes (one token)
first, then prefill chunks: token ids, positions, the cache slot of every token, and per sequence
the query length, context length and block table. No padding between sequences. A request
verifying k draft tokens (speculative decoding) is a decode of 1 + k tokens; after sampling, the
proposer drafts the next step's tokens.
"""

from __future__ import annotations

import json
import logging
import time

import numpy as np
import torch

from tokenmill import distributed
from tokenmill.core.messages import PromptLogprobs
from tokenmill.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from tokenmill.distributed.partition import split_evenly
from tokenmill.model.attention.backend import AttentionBackend, BatchLayout
from tokenmill.model.attention.torch_sdpa import padded_block_table
from tokenmill.utils.memory import zeros
from tokenmill.worker.request_state import GrammarSource, RequestState, RequestStates
from tokenmill.worker.sampler import Sampler, prompt_logprobs
from tokenmill.worker.spec_decode import Proposer, grammar_prefix, speculates
from tokenmill.worker.spec_decode.rejection_sampler import RejectionSampler

logger = logging.getLogger(__name__)

_PROMPT_LOGITS_CHUNK = 256  # rows of full-vocab logits materialized at once for prompt logprobs


class ModelRunner:
    def __init__(self, model: torch.nn.Module, backend: AttentionBackend, block_size: int,
                 vocab_size: int, device: torch.device, seed: int, fail_on_token: int | None = None,
                 grammars: GrammarSource | None = None, proposer: Proposer | None = None):
        self.model = model
        self.backend = backend
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.device = device
        self.sampler = Sampler(torch.Generator(device=device).manual_seed(seed))
        self.rejection_sampler = RejectionSampler(self.sampler, vocab_size)
        self.proposer = proposer  # speculative decoding: drafts for the next step
        self.requests = RequestStates(grammars)
        self.kv_cache: torch.Tensor | None = None
        # fault injection for testing the engine's error handling (TOKENMILL_DEBUG_FAIL_ON_TOKEN)
        self.fail_on_token = fail_on_token

    def close(self) -> None:
        """Stop the threads the sampler's processors started (a grammar's mask filling)."""
        self.sampler.close()

    def allocate_kv_cache(self, num_blocks: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                          storage: torch.dtype | None = None) -> None:
        self.kv_cache = allocate_kv_cache(self.model, num_blocks, self.block_size, num_kv_heads, head_dim, dtype,
                                          storage, self.device)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, prev_sampled: dict[str, list[int]] | None = None) -> ModelRunnerOutput:
        """`prev_sampled`: on a rank that does not sample (an earlier pipeline stage), the tokens the
        last stage sampled in the previous step."""
        for rid, tokens in (prev_sampled or {}).items():
            state = self.requests.get(rid)
            if state is not None:
                for tok in tokens:
                    state.append(tok)
        batch = self.requests.apply(sched, self.device)
        out = ModelRunnerOutput()
        if not batch:
            return out
        batch.sort(key=lambda row: row[1] != 1 + len(row[2]))  # decodes (and verifications) first, stable
        if self.fail_on_token is not None and any(
                self.fail_on_token in (s.token_ids + d)[s.num_computed_tokens:s.num_computed_tokens + n]
                for s, n, d in batch):
            raise RuntimeError(f"injected fault: token {self.fail_on_token} in the batch")
        samples = distributed.state().is_last_stage  # earlier pipeline stages pass hidden states on
        rows = [i for i, (state, n, drafts) in enumerate(batch) if state.samples(n) and not drafts]
        states = [batch[i][0] for i in rows]
        if rows and samples:
            self.sampler.prepare(states)  # e.g. grammar bitmasks, while the model runs
        hidden = self._forward(batch)
        if hidden is None:
            return out

        ends = np.cumsum([n for _, n, _ in batch])
        if rows:
            # every row's last position: all of hidden when each row is one token (a decode step)
            last = hidden if len(rows) == hidden.shape[0] else hidden[torch.tensor([ends[i] - 1 for i in rows],
                                                                                   device=self.device)]
            logits = self.model.compute_logits(last)
            result = self.sampler.sample(logits, states, self.vocab_size)
            for state, tok, lp in zip(states, result.token_ids, result.logprobs):
                state.append(tok)
                out.sampled_token_ids[state.req_id] = [tok]
                if lp is not None:
                    out.logprobs[state.req_id] = [lp]
        verify = [i for i, (_, _, drafts) in enumerate(batch) if drafts]
        if verify:
            self._verify([batch[i] for i in verify], [int(ends[i]) for i in verify], hidden, out)
        for i, (state, n, _) in enumerate(batch):
            if state.params.prompt_logprobs is not None:
                self._prompt_logprobs(state, n, hidden, int(ends[i]) - n, out)
        if self.proposer is not None:
            t0 = time.perf_counter()
            if sched.propose_drafts:
                self._propose([batch[i][0] for i in rows + verify], out, sched.max_draft_passes)
            out.draft_seconds = time.perf_counter() - t0
            out.draft_prefill_seconds = getattr(self.proposer, "prefill_seconds", 0.0)
        return out

    def _forward(self, batch: list[tuple[RequestState, int, list[int]]]) -> torch.Tensor | None:
        """The model over the batch. With pipeline stages, the batch runs as micro-batches (as many
        as stages): a stage posts the receives of all of them at once, sends each on without waiting
        (isend) and starts the next while the following stage works; it waits for its sends at the end."""
        st = distributed.state()
        if st.pp_size == 1:
            input_ids, positions, layout = self.prepare_inputs(batch)
            return self.model(input_ids, positions, self.backend.build_metadata(layout))
        parts = min(st.pp_size, len(batch))
        bounds = [split_evenly(len(batch), parts, i) for i in range(parts)]
        width, dtype = self.model.config.hidden_size, self.model.dtype
        recvs = [] if st.is_first_stage else [  # (hidden, residual) per micro-batch, tags 2k and 2k + 1
            distributed.pp_irecv([(sum(n for _, n, _ in batch[a:a + size]), width)] * 2, dtype, st.pp_rank - 1,
                                 tag=2 * k, device=self.device) for k, (a, size) in enumerate(bounds)]
        hidden, sends, marks = [], [], []
        for k, (start, size) in enumerate(bounds):
            input_ids, positions, layout = self.prepare_inputs(batch[start:start + size])
            meta = self.backend.build_metadata(layout)
            t0 = time.perf_counter()
            inter = tuple(distributed.wait_all(recvs[k])) if recvs else None
            t1 = time.perf_counter()
            out = self.model(input_ids, positions, meta, inter)
            if st.is_last_stage:
                hidden.append(out)
            else:
                sends.extend(distributed.pp_isend(list(out), st.pp_rank + 1, tag=2 * k))
            marks.append((t0, t1, time.perf_counter()))
        distributed.wait_all(sends)
        if logger.isEnabledFor(logging.DEBUG):  # benchmarks/pp_overlap.py reads these
            logger.debug("pipeline trace %s", json.dumps(dict(stage=st.pp_rank, end=time.perf_counter(),
                                                               micro_batches=marks)))
        return torch.cat(hidden) if hidden else None

    def _verify(self, rows, ends: list[int], hidden: torch.Tensor, out: ModelRunnerOutput) -> None:
        """Drafts were fed after each request's last token: the logits at those 1 + k positions
        decide which drafts stand (rejection_sampler.py)."""
        idx = torch.tensor([p for (_, _, d), end in zip(rows, ends) for p in range(end - 1 - len(d), end)],
                           device=self.device)
        logits = self.model.compute_logits(hidden[idx])
        results = self.rejection_sampler(logits, [(state, drafts) for state, _, drafts in rows])
        for (state, _, _), (tokens, logprobs) in zip(rows, results):
            for tok in tokens:
                state.append(tok)
            out.sampled_token_ids[state.req_id] = tokens
            if logprobs is not None:
                out.logprobs[state.req_id] = logprobs

    def _propose(self, states: list[RequestState], out: ModelRunnerOutput, max_passes: int | None = None) -> None:
        states = [s for s in states if speculates(s)]
        if not states:
            return
        for state, drafts in zip(states, self.proposer.propose(states, [max_passes] * len(states))):
            if drafts := grammar_prefix(state, drafts):
                out.spec_token_ids[state.req_id] = drafts

    def prepare_inputs(self, batch: list[tuple[RequestState, int, list[int]]]):
        rows = []
        for state, n, drafts in batch:
            start = state.num_computed_tokens
            tokens = (state.token_ids + drafts) if drafts else state.token_ids
            rows.append((tokens[start:start + n], start, state.block_ids, n == 1 + len(drafts)))
        return flat_batch(rows, self.block_size, self.device)

    def _prompt_logprobs(self, state: RequestState, n: int, hidden: torch.Tensor, row0: int,
                         out: ModelRunnerOutput) -> None:
        """Position p's logits score prompt token p + 1."""
        start = state.num_computed_tokens
        end = min(start + n, state.num_prompt_tokens - 1)
        if end <= start:
            return
        entries = []
        for a in range(start, end, _PROMPT_LOGITS_CHUNK):
            b = min(a + _PROMPT_LOGITS_CHUNK, end)
            logits = self.model.compute_logits(hidden[row0 + a - start: row0 + b - start])
            targets = torch.tensor(state.token_ids[a + 1:b + 1], device=self.device)
            entries.extend(prompt_logprobs(logits, targets, state.params.prompt_logprobs))
        out.prompt_logprobs[state.req_id] = PromptLogprobs(start + 1, entries)


def flat_batch(rows: list[tuple[list[int], int, list[int], bool]], block_size: int, device: torch.device):
    """(new token ids, position of the first, block table, decodes) per sequence, decodes first ->
    input ids, positions and the attention layout of one flat batch."""
    q_lens = [len(new_ids) for new_ids, _, _, _ in rows]
    seq_lens = [start + n for (_, start, _, _), n in zip(rows, q_lens)]
    tables = [block_ids for _, _, block_ids, _ in rows]
    num_decodes = next((i for i, row in enumerate(rows) if not row[3]), len(rows))  # the leading ones
    input_ids = torch.tensor([t for new_ids, _, _, _ in rows for t in new_ids], dtype=torch.long, device=device)
    if all(n == 1 for n in q_lens):  # a decode step: a token a row, cheapest in plain Python
        pos = [start for _, start, _, _ in rows]
        slots = [table[p // block_size] * block_size + p % block_size for table, p in zip(tables, pos)]
        positions = torch.tensor(pos, dtype=torch.long, device=device)
        slot_mapping = torch.tensor(slots, dtype=torch.long, device=device)
    else:  # every token's position and slot at once (numpy calls per row cost ~4 us a row)
        q = np.asarray(q_lens)
        row_of = np.repeat(np.arange(len(rows)), q)
        first = np.asarray([start for _, start, _, _ in rows]) - (np.cumsum(q) - q)  # position minus flat index
        pos = first[row_of] + np.arange(len(row_of))
        blocks = padded_block_table(tables, seq_lens, block_size).numpy()
        positions = torch.from_numpy(pos).to(device)
        slot_mapping = torch.from_numpy(blocks[row_of, pos // block_size] * block_size + pos % block_size).to(device)
    return input_ids, positions, BatchLayout(q_lens, seq_lens, tables, slot_mapping, num_decodes)


def allocate_kv_cache(model: torch.nn.Module, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                      dtype: torch.dtype, storage: torch.dtype | None, device: torch.device) -> torch.Tensor:
    """A paged KV cache for every attention layer of `model`, bound to the layers; returns the
    tensor that keeps it alive."""
    layers = model.kv_caches()
    if storage is not None:  # int8 / fp8 (+ scales), or bf16 under an fp32 model
        from tokenmill.model.attention.quant_kv import allocate

        caches = allocate(len(layers), num_blocks, block_size, num_kv_heads, head_dim, storage, device)
        for layer, cache in zip(layers, caches):
            layer.kv_cache = cache
        return caches[0].data  # each layer's cache is a view of it
    # zeros, not empty: masked-out slots are still read, and garbage NaNs would poison softmax
    shape = (len(layers), 2, num_blocks, block_size, num_kv_heads, head_dim)
    kv_cache = zeros(shape, dtype, device)
    for i, layer in enumerate(layers):
        layer.kv_cache = kv_cache[i]
    return kv_cache

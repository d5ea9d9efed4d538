"""Turns a SchedulerOutput into one flat batch, runs the model once, and samples.

The flat batch holds every scheduled sequence's new tokens back to back, decodes (one token)
first, then prefill chunks: token ids, positions, the cache slot of every token, and per sequence
the query length, context length and block table. No padding between sequences.
"""

from __future__ import annotations

import numpy as np
import torch

from tokenmill import distributed
from tokenmill.core.messages import PromptLogprobs
from tokenmill.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from tokenmill.distributed.partition import split_evenly
from tokenmill.model.attention.backend import AttentionBackend, BatchLayout
from tokenmill.worker.request_state import GrammarSource, RequestState, RequestStates
from tokenmill.worker.sampler import Sampler, SamplingBatch, prompt_logprobs

_PROMPT_LOGITS_CHUNK = 256  # rows of full-vocab logits materialized at once for prompt logprobs


class ModelRunner:
    def __init__(self, model: torch.nn.Module, backend: AttentionBackend, block_size: int,
                 vocab_size: int, device: torch.device, seed: int, fail_on_token: int | None = None,
                 grammars: GrammarSource | None = None):
        self.model = model
        self.backend = backend
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.device = device
        self.sampler = Sampler(torch.Generator(device=device).manual_seed(seed))
        self.requests = RequestStates(grammars)
        self.kv_cache: torch.Tensor | None = None
        # fault injection for testing the engine's error handling (TOKENMILL_DEBUG_FAIL_ON_TOKEN)
        self.fail_on_token = fail_on_token

    def allocate_kv_cache(self, num_blocks: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                          storage: torch.dtype | None = None) -> None:
        layers = self.model.kv_caches()
        if storage is not None:  # int8 / fp8 (+ scales), or bf16 under an fp32 model
            from tokenmill.model.attention.quant_kv import allocate

            caches = allocate(len(layers), num_blocks, self.block_size, num_kv_heads, head_dim, storage, self.device)
            self.kv_cache = caches[0].data  # keeps the pool alive (each layer's cache is a view of it)
            for layer, cache in zip(layers, caches):
                layer.kv_cache = cache
            return
        # zeros, not empty: masked-out slots are still read, and garbage NaNs would poison softmax
        self.kv_cache = torch.zeros(len(layers), 2, num_blocks, self.block_size, num_kv_heads, head_dim,
                                    dtype=dtype, device=self.device)
        for i, layer in enumerate(layers):
            layer.kv_cache = self.kv_cache[i]

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
        batch.sort(key=lambda row: row[1] != 1)  # decodes first (stable)
        if self.fail_on_token is not None and any(self.fail_on_token in s.token_ids[s.num_computed_tokens:
                                                                                  s.num_computed_tokens + n]
                                                  for s, n in batch):
            raise RuntimeError(f"injected fault: token {self.fail_on_token} in the batch")
        hidden = self._forward(batch)
        if hidden is None:  # an earlier pipeline stage: the last one samples
            return out

        ends = np.cumsum([n for _, n in batch])
        rows = [i for i, (state, n) in enumerate(batch) if state.samples(n)]
        if rows:
            idx = torch.tensor([ends[i] - 1 for i in rows], device=self.device)
            logits = self.model.compute_logits(hidden[idx])
            states = [batch[i][0] for i in rows]
            result = self.sampler(logits, SamplingBatch.build(states, self.vocab_size, self.device))
            for state, tok, lp in zip(states, result.token_ids, result.logprobs):
                state.append(tok)
                out.sampled_token_ids[state.req_id] = [tok]
                if lp is not None:
                    out.logprobs[state.req_id] = [lp]
        for i, (state, n) in enumerate(batch):
            if state.params.prompt_logprobs is not None:
                self._prompt_logprobs(state, n, hidden, int(ends[i]) - n, out)
        return out

    def _forward(self, batch: list[tuple[RequestState, int]]) -> torch.Tensor | None:
        """The model over the batch. With pipeline stages, the batch runs as micro-batches (as many
        as stages): a stage passes one on and starts the next while the following stage works."""
        st = distributed.state()
        if st.pp_size == 1:
            input_ids, positions, layout = self.prepare_inputs(batch)
            return self.model(input_ids, positions, self.backend.build_metadata(layout))
        n = len(batch)
        bounds = [split_evenly(n, min(st.pp_size, n), i) for i in range(min(st.pp_size, n))]
        hidden, width = [], self.model.config.hidden_size
        for start, size in bounds:
            input_ids, positions, layout = self.prepare_inputs(batch[start:start + size])
            meta = self.backend.build_metadata(layout)
            inter = None
            if not st.is_first_stage:
                rows = input_ids.shape[0]
                inter = tuple(distributed.pp_recv([(rows, width)] * 2, self.model.dtype, st.pp_rank - 1))
            out = self.model(input_ids, positions, meta, inter)
            if st.is_last_stage:
                hidden.append(out)
            else:
                distributed.pp_send(list(out), st.pp_rank + 1)
        return torch.cat(hidden) if hidden else None

    def prepare_inputs(self, batch: list[tuple[RequestState, int]]):
        bs = self.block_size
        ids, pos, slots, q_lens, seq_lens, tables = [], [], [], [], [], []
        for state, n in batch:
            start, end = state.num_computed_tokens, state.num_computed_tokens + n
            ids.extend(state.token_ids[start:end])
            p = np.arange(start, end)
            table = np.asarray(state.block_ids)
            pos.append(p)
            slots.append(table[p // bs] * bs + p % bs)
            q_lens.append(n)
            seq_lens.append(end)
            tables.append(state.block_ids)
        dev = self.device
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        positions = torch.from_numpy(np.concatenate(pos)).to(dev)
        slot_mapping = torch.from_numpy(np.concatenate(slots)).to(dev)
        num_decodes = next((i for i, q in enumerate(q_lens) if q != 1), len(q_lens))  # the leading ones
        return input_ids, positions, BatchLayout(q_lens, seq_lens, tables, slot_mapping, num_decodes)

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

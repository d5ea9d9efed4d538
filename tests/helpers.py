"""Test helpers: drive the model runner with hand-made flat batches, and a Hugging Face reference."""

from __future__ import annotations

import torch

from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.messages import CoreSamplingParams
from tokenmill.core.request import Request
from tokenmill.core.scheduler_output import NewRequestData
from tokenmill.worker.request_state import RequestState


class FlatBatchDriver:
    """Runs arbitrary mixes of prefill chunks and decodes through the real runner and KV cache,
    returning the logits of every new token. Uses its own block bookkeeping (the engine must be idle)."""

    def __init__(self, engine):
        core = engine.core
        self.runner = core.worker.runner
        self.kv = KVCacheManager(core.kv.num_blocks, core.config.cache.block_size, enable_caching=False)

    def new(self, rid: str, tokens: list[int]) -> Request:
        return Request(rid, list(tokens), CoreSamplingParams(), set(), 1 << 20, 0.0)

    @torch.inference_mode()
    def step(self, items: list[tuple[Request, int]]) -> list[torch.Tensor]:
        """items: (request, new tokens). Decodes (n == 1) must come first, as the runner orders them."""
        batch = []
        for req, n in items:
            assert self.kv.allocate_slots(req, n) is not None
            new = NewRequestData(req.request_id, req.all_token_ids, req.params, [], self.kv.block_ids(req),
                                 req.num_computed_tokens)
            batch.append((RequestState.new(new, self.runner.device), n, []))
        input_ids, positions, layout = self.runner.prepare_inputs(batch)
        meta = self.runner.backend.build_metadata(layout)
        logits = self.runner.model.compute_logits(self.runner.model(input_ids, positions, meta))
        out, start = [], 0
        for req, n in items:
            out.append(logits[start:start + n].clone())
            start += n
            req.num_computed_tokens += n
        return out

    def free(self, *reqs: Request) -> None:
        for r in reqs:
            self.kv.free(r)


@torch.inference_mode()
def hf_greedy(model, prompt_ids: list[int], steps: int) -> list[int]:
    """Greedy decoding with the Hugging Face model, without EOS handling or logits processors."""
    out = model(torch.tensor([prompt_ids]), use_cache=True)
    past, ids = out.past_key_values, []
    for _ in range(steps):
        tok = int(out.logits[0, -1].argmax())
        ids.append(tok)
        out = model(torch.tensor([[tok]]), past_key_values=past, use_cache=True)
        past = out.past_key_values
    return ids

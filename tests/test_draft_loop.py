"""The draft model's passes in one C++ call (worker/spec_decode/draft_loop.py) draft exactly what the
Python loop drafts: SmolLM2 drafting for itself, requantized to int4 at load (packed layers, so its
layers run fused), with its full tied head and with a reduced vocabulary, 16 requests at once with a
pool small enough to preempt. Same drafts means the same verifications: the outputs and every
speculation counter must be equal, and the C++ loop must have been the one drafting."""

from __future__ import annotations

import gc
import json

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.model.loader import load_tokenizer, resolve_model
from tokenmill.worker.spec_decode.draft_loop import FusedDraftLoop

from .test_engine_consistency import _prompts


def _run(args: dict, prompts) -> tuple[list, object, bool]:
    llm = LLM(**args)
    proposer = llm.engine.core.worker.runner.proposer
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)
    used = proposer.fused_loop.get() is not None
    stats = llm.engine.core.stats().spec_decoding
    assert llm.engine.core.kv.pool.num_free_blocks == llm.engine.core.kv.num_blocks
    del llm
    gc.collect()
    return [o.outputs[0].token_ids for o in outs], stats, used


@pytest.mark.slow
@pytest.mark.parametrize("vocab", [None, 8192])
def test_fused_draft_loop_drafts_what_the_python_loop_drafts(vocab, smol_path, monkeypatch):
    spec = {"model": str(smol_path), "num_speculative_tokens": 4, "quantization": "int4", "draft_lookup_min": 0,
            "adaptive": False, "draft_vocab_size": vocab, "draft_p_min": 0.3}
    # fixed lengths (adaptive off): which passes run never depends on timing
    args = dict(speculative_config=json.dumps(spec), kv_cache_memory="48MiB", max_model_len=512, max_num_seqs=16,
                enable_prefix_caching=False, progress=False)
    prompts = _prompts(load_tokenizer(resolve_model(None)), 16)
    fused, fused_stats, used = _run(args, prompts)
    assert used, "the draft did not qualify for the fused loop"
    monkeypatch.setattr(FusedDraftLoop, "get", lambda self: None)
    python, python_stats, used = _run(args, prompts)
    assert not used
    assert fused == python
    assert fused_stats == python_stats
    # drafts stopped early (p_min) and ran to k, and some were rejected: each path of the loop ran
    assert 0 < python_stats.num_accepted_tokens < python_stats.num_draft_tokens
    assert python_stats.num_drafts < python_stats.num_draft_tokens < 4 * python_stats.num_drafts

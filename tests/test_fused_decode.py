"""Decode steps through every decoder layer in one C++ call (model/fused_decode.py) give bit for
bit what the Python layers give: plain decodes of several sequences, speculative verification
rows, Qwen2's qkv bias, and quantized KV caches."""

from __future__ import annotations

import gc

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.model.attention.quant_kv import QuantizedKVCache
from tokenmill.model.fused_decode import FusedDecode
from tokenmill.model.kernels import load_cpu_kernels
from tokenmill.model.quant_kernels import quant_kernels_available

pytestmark = pytest.mark.skipif(not (load_cpu_kernels() and quant_kernels_available()), reason="no C++ toolchain")
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ", "Once upon a time, in a land far away, there lived",
           "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,"]
KV = dict(kv_cache_memory="128MiB", max_model_len=1024, progress=False)


def _on_and_off(llm, monkeypatch, max_tokens=24):
    """(outputs with the fused path, number of fused steps, outputs without it)."""
    calls = []
    call = FusedDecode.__call__
    monkeypatch.setattr(FusedDecode, "__call__", lambda self, *a: calls.append(1) or call(self, *a))
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=2, ignore_eos=True)
    fused = llm.generate(PROMPTS, sp, use_tqdm=False)
    monkeypatch.setattr(FusedDecode, "applies", lambda self, x, meta: False)
    python = llm.generate(PROMPTS, sp, use_tqdm=False)
    return fused, len(calls), python


def _same(a, b):
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        assert x.outputs[0].logprobs == y.outputs[0].logprobs  # bit for bit


@pytest.mark.parametrize("spec", [None, '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}'])
def test_fused_decode_is_bitwise_the_python_layers(monkeypatch, spec):
    llm = LLM(dtype="bfloat16", quantization="gguf", speculative_config=spec, **KV)
    fused, steps, python = _on_and_off(llm, monkeypatch)
    assert steps > 0
    _same(fused, python)
    if spec:
        assert llm.engine.core.stats().spec_decoding.num_accepted_tokens > 0  # verification rows ran fused
    del llm
    gc.collect()


def test_fused_decode_with_qkv_bias(monkeypatch, tiny_qwen2_dir):
    llm = LLM(str(tiny_qwen2_dir), dtype="bfloat16", quantization="int8", **KV)
    assert any(ly.self_attn.qkv_proj.bias is not None for ly in llm.engine.core.worker.runner.model.model.layers)
    fused, steps, python = _on_and_off(llm, monkeypatch, max_tokens=12)
    assert steps > 0
    _same(fused, python)


@pytest.mark.parametrize("dtype,kv", [("float32", "int8"), ("bfloat16", "fp8_e4m3"), ("float32", "bfloat16")])
def test_fused_decode_over_a_quantized_kv_cache(monkeypatch, dtype, kv):
    """Scaled int8 / fp8 caches and a bf16 cache under fp32: the same writes and reads as cpu_paged.py's.
    No prefix caching: a prompt's cached blocks are read back quantized, where the first run's prefill
    attended to its own exact K/V, so the second run would differ for that reason alone."""
    llm = LLM(dtype=dtype, quantization="gguf", kv_cache_dtype=kv, enable_prefix_caching=False, **KV)
    model = llm.engine.core.worker.runner.model.model
    assert isinstance(model.layers[0].self_attn.kv_cache, QuantizedKVCache)
    fused, steps, python = _on_and_off(llm, monkeypatch)
    assert steps > 0 and model.fused_decode.kv_ops
    _same(fused, python)


def test_not_used_where_it_does_not_apply():
    """fp32 dense weights: the Python layers."""
    llm = LLM(dtype="float32", quantization="none", **KV)
    model = llm.engine.core.worker.runner.model.model
    llm.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert model.fused_decode is None or not model.fused_decode.usable


def test_rebuilt_when_the_kv_cache_is_rebound():
    """The plan holds the layers' cache views: a cache allocated again (allocate_kv_cache binds every
    layer's) gets a new plan, and the same greedy tokens."""
    llm = LLM(dtype="float32", quantization="gguf", enable_prefix_caching=False, **KV)
    worker = llm.engine.core.worker
    model = worker.runner.model.model
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    before = llm.generate(PROMPTS, sp, use_tqdm=False)
    plan = model.fused_decode.plan
    old = worker.runner.kv_cache
    worker.runner.allocate_kv_cache(worker.num_blocks, worker.local_kv_heads, model.layers[0].self_attn.head_dim,
                                    worker.dtype, worker.kv_storage)
    assert worker.runner.kv_cache is not old
    after = llm.generate(PROMPTS, sp, use_tqdm=False)
    assert model.fused_decode.plan is not plan and model.fused_decode.usable
    assert [o.outputs[0].token_ids for o in after] == [o.outputs[0].token_ids for o in before]

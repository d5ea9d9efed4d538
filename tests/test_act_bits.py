"""`--quant-act-bits auto`: the packed kernels' activation precision measured once per model and kept."""

from __future__ import annotations

import json

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.config import EngineConfig
from tokenmill.errors import ConfigError
from tokenmill.model.layers.quantization import act_bits
from tokenmill.model.loader.cache import VerdictFile
from tokenmill.model.quant_kernels import quant_kernels_available

pytestmark = pytest.mark.skipif(not quant_kernels_available(), reason="no C++ toolchain")
KV = dict(kv_cache_memory="256MiB", max_model_len=1024, progress=False)


def test_act_bits_setting_is_validated():
    assert EngineConfig.from_kwargs().quant.quant_act_bits == "auto"
    assert EngineConfig.from_kwargs(quant_act_bits="8").quant.quant_act_bits == 8
    assert EngineConfig.from_kwargs(quant_act_bits=16).quant.quant_act_bits == 16
    with pytest.raises(ConfigError, match="quant_act_bits"):
        EngineConfig.from_kwargs(quant_act_bits=12)


def _bits(llm) -> set:
    return {m.act_bits for m in act_bits.packed_methods(llm.engine.core.worker.model)}


def test_auto_measures_once_and_keeps_the_verdict(tmp_path, monkeypatch):
    cache = tmp_path / "act_bits.json"
    monkeypatch.setattr(act_bits, "VERDICTS", VerdictFile("act_bits.json", cache))
    llm = LLM(**KV)
    (entry,) = json.loads(cache.read_text()).values()
    # SmolLM2 is the model where 8-bit codes cost too much (BENCHMARKS.md: +0.44% on 20k tokens)
    assert entry["bits"] == 16 and entry["change"] > act_bits.MAX_CHANGE and entry["tokens"] == act_bits.TOKENS
    assert _bits(llm) == {16}
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    del llm

    # a kept verdict is used as it is, without measuring again: made 8 here, the model runs 8-bit codes,
    # exactly as when they are asked for
    key = next(iter(json.loads(cache.read_text())))
    cache.write_text(json.dumps({key: {**entry, "bits": 8}}))
    kept = LLM(**KV)
    assert _bits(kept) == {8}
    got = [o.outputs[0].token_ids for o in kept.generate(prompts, params, use_tqdm=False)]
    del kept
    explicit = LLM(quant_act_bits=8, **KV)
    assert _bits(explicit) == {8}
    assert got == [o.outputs[0].token_ids for o in explicit.generate(prompts, params, use_tqdm=False)]


def test_explicit_bits_are_not_measured(tmp_path, monkeypatch):
    cache = tmp_path / "act_bits.json"
    monkeypatch.setattr(act_bits, "VERDICTS", VerdictFile("act_bits.json", cache))
    llm = LLM(quant_act_bits=16, **KV)
    assert _bits(llm) == {16} and not cache.exists()

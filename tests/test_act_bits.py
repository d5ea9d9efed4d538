"""`--quant-act-bits auto`: the packed kernels' activation precision measured once per model and kept."""

from __future__ import annotations

import json

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.config import EngineConfig
from tokenmill.errors import ConfigError
from tokenmill.model.layers.quantization import act_bits, outlier_channels
from tokenmill.model.loader import gguf_loader, resolve_model
from tokenmill.model.loader.cache import VerdictFile
from tokenmill.model.quant_kernels import quant_kernels_available

from .tiny_gguf import write_tiny_kquant_gguf

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


def _bits_by_kind(llm) -> dict[str, set]:
    return {k: {m.act_bits for m in ms} for k, ms in act_bits.methods_by_kind(llm.engine.core.worker.model).items()}


def test_kinds_are_kept_from_the_least_harmful_while_the_set_stays_in_budget():
    limit = act_bits.MAX_CHANGE
    cost = {"a": 0.1 * limit, "b": 0.5 * limit, "c": 0.6 * limit, "d": 0.2 * limit, "e": 2 * limit}
    with_channels = {"a": 0.05 * limit, "b": 0.1 * limit, "c": 0.1 * limit, "d": 0.1 * limit, "e": 0.5 * limit}
    calls = []

    def change(kinds, channels):  # additive, as a model's would roughly be
        calls.append((frozenset(kinds), frozenset(channels)))
        return sum(with_channels[k] if k in channels else cost[k] for k in kinds)

    v = act_bits.choose_kinds(sorted(cost), change)
    # plain: a (0.1), d (0.3), b (0.8) fit; c would make 1.4 and e is over the limit alone: never tried
    # plain in a set. Then with channels: c (0.9) fits, e would make 1.4
    assert v["bits"] == {"a": 8, "b": 8, "c": 8, "d": 8, "e": 16} and v["channels"] == ["c"]
    assert v["change"] == pytest.approx(0.9 * limit) and v["every_kind_change"] == pytest.approx(3.4 * limit)
    assert [k for k, _ in v["steps"]] == ["a", "d", "b", "c", "c+channels", "e+channels"]
    assert (frozenset("abcde"), frozenset()) in calls
    assert not any("e" in k and len(k) > 1 and not ch and k != frozenset("abcde") for k, ch in calls)
    # within the limit with every kind: one measurement, every kind at plain 8 bits
    v = act_bits.choose_kinds(["a", "d"], change)
    assert v["bits"] == {"a": 8, "d": 8} and v["channels"] == [] and "alone" not in v
    # nothing fits, not even with channels: 16 everywhere, with a change of nothing
    cost["e"] = with_channels["e"] = 2 * limit
    v = act_bits.choose_kinds(["e"], change)
    assert v["bits"] == {"e": 16} and v["channels"] == [] and v["change"] == 0


def test_lumped_kl_is_the_divergence_over_the_top_tokens_and_the_rest():
    torch.manual_seed(0)
    ref = torch.log_softmax(torch.randn(5, 40) * 2, -1)
    other = torch.log_softmax(ref + 0.3 * torch.randn(5, 40), -1)
    full = (ref.exp() * (ref - other)).sum(-1).double()
    every = ref.topk(40, -1)
    assert torch.allclose(act_bits.lumped_kl(every.values, every.indices, other), full, rtol=1e-5)
    top = ref.topk(8, -1)
    lumped = act_bits.lumped_kl(top.values, top.indices, other)
    assert (lumped <= full + 1e-9).all() and (lumped > 0.3 * full).all()  # lumping only loses divergence
    assert act_bits.lumped_kl(top.values, top.indices, ref).abs().max() < 1e-6


@pytest.mark.slow
def test_auto_measures_once_and_keeps_the_verdict(tmp_path, monkeypatch):
    cache = tmp_path / "act_bits.json"
    monkeypatch.setattr(act_bits, "VERDICTS", VerdictFile("act_bits.json", cache))
    llm = LLM(**KV)
    (entry,) = json.loads(cache.read_text()).values()
    # SmolLM2: 8-bit codes everywhere cost too much (BENCHMARKS.md: +0.39% on 20k tokens). The verdict
    # follows the rule: a kind is plain 8-bit where its step (alone or added) fit, 8-bit with channels
    # where its channel step fit, else 16-bit; the change kept is within the limit
    assert entry["every_kind_change"] > act_bits.MAX_CHANGE >= entry["change"] and entry["tokens"] == act_bits.TOKENS
    bits, steps, tried = entry["bits"], dict(entry["steps"]), set(entry["channels"])
    assert set(bits) == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head"}
    plain = {k for k in bits if steps.get(k, 1.0) <= act_bits.MAX_CHANGE}
    with_channels = {k for k in set(bits) - plain if steps.get(k + "+channels", 1.0) <= act_bits.MAX_CHANGE}
    assert plain and {k for k, b in bits.items() if b == 8} == plain | with_channels
    assert all(entry["alone"][k] > act_bits.MAX_CHANGE or steps[k] > act_bits.MAX_CHANGE for k in set(bits) - plain)
    # the channels kept are those of the kinds that took them, and the layers run with them
    layers = outlier_channels.packed_layers(llm.engine.core.worker.model)
    assert {n.rsplit(".", 1)[-1] for n in tried} == with_channels and tried <= set(layers)

    def channels_run(model) -> dict:
        found = {}
        for name, layer in outlier_channels.packed_layers(model).items():
            cols, _ = layer.method.outliers(layer)
            if cols is not None:
                found[name] = cols.tolist()
        return found

    assert channels_run(llm.engine.core.worker.model) == entry["channels"]
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    measured = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    del llm

    # loaded again, the kept verdict is used without measuring: the same codes, the same channels, the
    # same tokens
    monkeypatch.setattr(act_bits, "_Trial", None)  # measuring again would fail
    again = LLM(**KV)
    assert _bits_by_kind(again) == {k: {b} for k, b in bits.items()}
    assert channels_run(again.engine.core.worker.model) == entry["channels"]
    assert [o.outputs[0].token_ids for o in again.generate(prompts, params, use_tqdm=False)] == measured
    del again

    # a kept verdict is used as it is, without measuring again: made 16-bit for every kind, the model runs
    # 16-bit codes, exactly as when they are asked for
    key = next(iter(json.loads(cache.read_text())))
    cache.write_text(json.dumps({key: {**entry, "bits": 16, "channels": {}}}))
    kept = LLM(**KV)
    assert _bits(kept) == {16}
    got = [o.outputs[0].token_ids for o in kept.generate(prompts, params, use_tqdm=False)]
    del kept
    explicit = LLM(quant_act_bits=16, **KV)
    assert _bits(explicit) == {16}
    assert got == [o.outputs[0].token_ids for o in explicit.generate(prompts, params, use_tqdm=False)]


def test_explicit_bits_are_not_measured(tmp_path, monkeypatch):
    cache = tmp_path / "act_bits.json"
    monkeypatch.setattr(act_bits, "VERDICTS", VerdictFile("act_bits.json", cache))
    llm = LLM(quant_act_bits=16, **KV)
    assert _bits(llm) == {16} and not cache.exists()


def test_a_bf16_model_is_measured_with_fp32_activations(tmp_path, monkeypatch):
    """bf16's own rounding hides what 8-bit codes cost (act_bits.py): a GGUF run natively in bf16 takes
    the verdict measured with fp32 activations, the one an fp32 load of the file uses, and keeps its
    bf16 tensors."""
    cache = tmp_path / "act_bits.json"
    monkeypatch.setattr(act_bits, "VERDICTS", VerdictFile("act_bits.json", cache))
    path = tmp_path / "tiny-kquant-qwen2.gguf"
    write_tiny_kquant_gguf(path)
    kw = dict(model=str(path), tokenizer=str(gguf_loader.tokenizer_dir(resolve_model(None).path)), **KV)
    llm = LLM(dtype="bfloat16", **kw)
    (key,) = json.loads(cache.read_text())
    assert "|torch.float32|" in key
    model = llm.engine.core.worker.model
    assert {p.dtype for p in model.parameters() if p.is_floating_point()} == {torch.bfloat16}
    assert all(getattr(m, "dtype", torch.bfloat16) == torch.bfloat16 for m in model.modules())
    bits = _bits_by_kind(llm)
    del llm
    monkeypatch.setattr(act_bits, "_Trial", None)  # measuring again would fail
    assert _bits_by_kind(LLM(dtype="float32", **kw)) == bits


@pytest.mark.parametrize("heads,kv_heads,dim,tokens", [(9, 3, 64, 200), (12, 2, 128, 77)])
def test_calibration_attention_is_causal_attention(heads, kv_heads, dim, tokens):
    """The calibration's stand-in attention takes the C++ prompt kernel where the engine's fp32 prompts do
    (calibration.py): the same causal attention as torch's SDPA, within fp32 rounding."""
    import torch.nn.functional as F

    from tokenmill.model.attention.backend import get_attention_backend
    from tokenmill.model.attention.cpu_paged import PREFILL_KERNEL_ISAS
    from tokenmill.model.layers.quantization.calibration import _CausalAttention
    from tokenmill.utils.cpu import active_isa

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(tokens, h, dim, generator=gen) for h in (heads, kv_heads, kv_heads))
    backend = get_attention_backend("auto", 16, torch.device("cpu"), dim)
    attn = _CausalAttention(backend)
    assert attn.kernel == (backend.name == "cpu_paged" and active_isa() in PREFILL_KERNEL_ISAS)
    out = attn.forward(q, k, v, None, None, dim ** -0.5)
    rep = heads // kv_heads
    ref = F.scaled_dot_product_attention(q.transpose(0, 1), k.repeat_interleave(rep, 1).transpose(0, 1),
                                         v.repeat_interleave(rep, 1).transpose(0, 1), is_causal=True,
                                         scale=dim ** -0.5).transpose(0, 1).reshape(tokens, -1)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)

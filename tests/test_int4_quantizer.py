"""The int4 quantizer of `--quantization int4` (int4_search.py, HQQ's zero-point fit): it leaves less
error than min/max round-to-nearest, an input-column weighting moves the error off the heavy
columns, and what it stores is always valid (codes 0..15, finite fp16 scales, zero and constant
groups exact). Read back through the stored bytes, as the kernels do."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenmill.model.layers.quantization.formats import dequantize_own, quantize_q4_groups
from tokenmill.model.layers.quantization.int4_search import fit_groups


def _dequantized(w: torch.Tensor, group: int, rtn: bool = False, input_scale=None) -> torch.Tensor:
    packed = quantize_q4_groups(w, group, round_to_nearest=rtn, input_scale=input_scale).numpy()
    if group == 32:  # GGUF's Q4_1, read by gguf-py's reference
        from gguf.quants import dequantize

        return torch.from_numpy(dequantize(packed, 3).reshape(w.shape).astype(np.float32))
    return dequantize_own("I4_G128", packed, w.shape[1])


def _weights(kind: str, rows: int = 64, k: int = 512) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    if kind == "normal":
        return torch.randn(rows, k, generator=gen) * 0.02
    # heavy tails: Student's t with 2 degrees of freedom (a few weights far out, as in LLM layers)
    normal, chi2 = torch.randn(rows, k, generator=gen), torch.randn(rows, k, 2, generator=gen).square().sum(-1)
    return normal / (chi2 / 2).sqrt() * 0.02


@pytest.mark.parametrize("kind", ["normal", "heavy_tailed"])
@pytest.mark.parametrize("group", [32, 128])
def test_fit_beats_round_to_nearest(kind, group):
    w = _weights(kind)
    rtn, fitted = _dequantized(w, group, rtn=True), _dequantized(w, group)
    for p, bound in ((2.0, 0.95), (0.7, 1.0)):  # squared error, and HQQ's own l_p loss
        err_rtn, err = (rtn - w).abs().pow(p).sum(), (fitted - w).abs().pow(p).sum()
        assert err < bound * err_rtn, (p, err, err_rtn)


@pytest.mark.parametrize("group", [32, 128])
def test_input_scale_moves_error_to_light_columns(group):
    w = _weights("normal")
    heavy = torch.zeros(w.shape[1], dtype=torch.bool)
    heavy[::4] = True  # every fourth input column carries 100x the activation power
    scale = torch.where(heavy, 100.0, 1.0)
    plain, weighted = _dequantized(w, group), _dequantized(w, group, input_scale=scale)
    out_err = [((x - w).square() * scale).sum() for x in (plain, weighted)]
    assert out_err[1] < 0.95 * out_err[0], out_err  # what the layer's output sees


@pytest.mark.parametrize("group", [32, 128])
def test_codes_scales_and_degenerate_groups(group):
    w = _weights("heavy_tailed", rows=6, k=256)
    w[0] = 0.0  # an all-zero row
    w[1] = 0.75  # constant groups
    w[2, :group] = 0.0  # one zero group in an otherwise ordinary row
    w[3] *= 3e4  # near fp16's largest
    w[4, 5] = -1e-7  # one tiny weight in a zero group
    w[4, 6:group] = 0.0
    d, m, q = fit_groups(w.view(6, -1, group))
    assert torch.isfinite(d).all() and torch.isfinite(m).all() and (d >= 0).all()
    assert ((q >= 0) & (q <= 15) & (q == q.round())).all()
    out = _dequantized(w, group)
    assert torch.isfinite(out).all()
    assert (out[0] == 0).all() and (out[2, :group] == 0).all()
    torch.testing.assert_close(out[1], w[1], rtol=1e-3, atol=0)  # fp16 m
    assert (out[3] - w[3]).abs().max() <= (w[3].abs().max() / 7)  # no overflow to inf at the extremes


def test_calibration_measures_what_each_layer_multiplies(tmp_path, smol_tokenizer_dir, monkeypatch):
    """int4 with groups of 128 weighs input columns by their mean square over built-in text: the
    values measured at load equal those of Hugging Face's model on the same tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tests.conftest import _save_tiny
    from tokenmill import LLM
    from tokenmill.model.layers.quantization import weight_only
    from tokenmill.model.layers.quantization.calibration import calibration_text
    from tokenmill.model.quant_kernels import quant_kernels_available

    if not quant_kernels_available():
        pytest.skip("no C++ toolchain")
    _save_tiny("qwen2", tmp_path, smol_tokenizer_dir, intermediate_size=384)  # 384: groups of 128 fit
    seen = []
    real = weight_only.quantize_q4_groups
    monkeypatch.setattr(weight_only, "quantize_q4_groups",
                        lambda w, group, **kw: seen.append(kw.get("input_scale")) or real(w, group, **kw))
    monkeypatch.setattr(weight_only, "CALIBRATION_TOKENS", 64)
    LLM(str(tmp_path), dtype="float32", quantization="int4", quant_group_size=128, kv_cache_memory="32MiB",
        progress=False)
    ids = AutoTokenizer.from_pretrained(str(tmp_path)).encode(calibration_text(), add_special_tokens=False)[:64]
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    expected = {}
    for name, mod in hf.named_modules():
        if isinstance(mod, torch.nn.Linear) and name.startswith("model.layers.") and not name.endswith(("k_proj",
                                                                                                       "v_proj",
                                                                                                       "up_proj")):
            mod.register_forward_pre_hook(lambda m, a, name=name: expected.__setitem__(name, a[0][0].square().mean(0)))
    with torch.inference_mode():
        hf(torch.tensor([ids]))
    # model order: per layer qkv (= q_proj's input), o_proj, gate_up (= gate_proj's), down_proj
    order = [f"model.layers.{i}.{p}" for i in range(3)
             for p in ("self_attn.q_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj")]
    assert len(seen) == len(order) and all(s is not None for s in seen)
    for name, got in zip(order, seen):
        torch.testing.assert_close(got, expected[name].clamp_min(1e-12), rtol=2e-3, atol=1e-6, msg=name)

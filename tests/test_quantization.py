"""Quantized models end to end: GGUF weights kept packed by default, --quantization int8/int4 of a
Hugging Face folder, their memory, and clear errors for what cannot work."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from tests.helpers import FlatBatchDriver
from tokenmill import LLM, SamplingParams
from tokenmill.errors import ConfigError
from tokenmill.model.quant_kernels import quant_kernels_available

pytestmark = pytest.mark.skipif(not quant_kernels_available(), reason="no C++ toolchain")


def _logits(llm, ids):
    driver = FlatBatchDriver(llm.engine)
    req = driver.new("q", ids)
    (logits,) = driver.step([(req, len(ids))])
    driver.free(req)
    return logits


def _tensor_bytes(path) -> int:
    from tokenmill.model.loader import gguf_loader

    index = json.loads((gguf_loader.prepare(path) / "tensors.json").read_text())
    return sum(int(np.prod(t["data_shape"])) * np.dtype(t["data_dtype"]).itemsize for t in index.values())


def test_gguf_runs_packed_by_default_within_10_percent_of_the_file(smol_gguf, smol_path):
    worker = smol_gguf.engine.core.worker
    assert worker.quantization == "gguf"
    from tokenmill.model.layers.quantization import resolve_quantization

    assert resolve_quantization("auto", "gguf", torch.device("cpu")) == "gguf"
    assert resolve_quantization("auto", "hf", torch.device("cpu")) == "none"
    file_bytes = _tensor_bytes(smol_path)
    assert abs(worker.weight_bytes - file_bytes) <= 0.10 * file_bytes, (worker.weight_bytes, file_bytes)
    out = smol_gguf.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=3),
                             use_tqdm=False)
    assert out[0].outputs[0].text.startswith(" Paris")


def test_native_logits_track_the_dequantized_model(smol_gguf, smol_fp32):
    """The packed kernels (int8 activations) against the same GGUF dequantized to fp32."""
    ids = smol_fp32.get_tokenizer().encode("The quick brown fox jumps over the lazy dog. Once upon a time,")
    ref, ours = _logits(smol_fp32, ids), _logits(smol_gguf, ids)
    p, q = ref.softmax(-1), ours.float().softmax(-1)
    tv = (p - q).abs().sum(-1) / 2  # total variation of next-token distributions
    assert tv.mean() < 0.08 and tv.max() < 0.3, tv
    assert (ref.argmax(-1) == ours.argmax(-1)).float().mean() >= 0.8


def _fake_quantized(w: torch.Tensor, quantization: str, group: int) -> torch.Tensor:
    """The weight the kernels multiply by: quantized as tokenmill does at load, then dequantized."""
    from gguf.quants import dequantize

    from tokenmill.model.layers.quantization.formats import dequantize_own, quantize_i8_row, quantize_q4_groups

    if quantization == "int8":
        return dequantize_own("I8_ROW", quantize_i8_row(w).numpy(), w.shape[1])
    packed = quantize_q4_groups(w, group).numpy()
    if group == 32:  # GGUF's Q4_1 layout
        return torch.from_numpy(dequantize(packed, 3).reshape(w.shape).astype(np.float32))
    return dequantize_own("I4_G128", packed, w.shape[1])


@pytest.mark.parametrize("quantization,group", [("int8", 128), ("int4", 32)])
def test_weight_only_quantization_of_a_folder(tiny_qwen2_dir, quantization, group):
    """Logits equal Hugging Face's on the same folder with every decoder linear weight replaced by
    its round-to-nearest quantization (so the quantizer and the kernels are both checked)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(tiny_qwen2_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, mod in hf.named_modules():
            if isinstance(mod, torch.nn.Linear) and name.startswith("model.layers."):
                mod.weight.copy_(_fake_quantized(mod.weight.data, quantization, group))
    # 16-bit activation codes, whose products this checks: `auto` could take 8 on a random model, whose
    # near-uniform predictions hardly move its perplexity
    llm = LLM(str(tiny_qwen2_dir), dtype="float32", quantization=quantization, quant_group_size=group,
              quant_act_bits=16, kv_cache_memory="32MiB", progress=False)
    assert llm.engine.core.worker.quantization == quantization
    ids = llm.get_tokenizer().encode("The quick brown fox jumps over the lazy dog.")
    with torch.inference_mode():
        expected = hf(torch.tensor([ids])).logits[0]
    got = _logits(llm, ids)
    assert (got - expected).norm() / expected.norm() < 2e-3  # 16-bit activations: ~fp32 products


def test_int4_groups_must_divide_the_input_size(tiny_llama_dir):
    cfg = json.loads((tiny_llama_dir / "config.json").read_text())
    assert cfg["intermediate_size"] % 128  # 352: down_proj's input is no multiple of 128
    with pytest.raises(ConfigError, match="multiple of 128"):
        LLM(str(tiny_llama_dir), quantization="int4", quant_group_size=128, kv_cache_memory="32MiB", progress=False)


def test_quantization_that_does_not_fit_the_model_is_refused(tiny_llama_dir, smol_path):
    with pytest.raises(ConfigError, match="needs a .gguf"):
        LLM(str(tiny_llama_dir), quantization="gguf", kv_cache_memory="32MiB", progress=False)
    with pytest.raises(ConfigError, match="already quantized"):
        LLM(str(smol_path), quantization="int8", kv_cache_memory="32MiB", progress=False)
    with pytest.raises(ConfigError, match="quantization"):
        LLM(quantization="int3", progress=False)


def _corrupt_copy(src, dst, tensor: str, mutate) -> None:
    from tokenmill.model.loader import gguf_loader

    shutil.copy(src, dst)
    index = json.loads((gguf_loader.prepare(src) / "tensors.json").read_text())
    mutate(dst, index[tensor])


def test_corrupt_gguf_block_is_a_clear_error(smol_path, tmp_path):
    def nan_scale(path, t):  # the fp16 scale of block 5 of a Q4_1 tensor (20-byte blocks) -> NaN
        with open(path, "r+b") as f:
            f.seek(t["offset"] + 5 * 20)
            f.write(np.array([np.nan], dtype=np.float16).tobytes())

    bad = tmp_path / "corrupt.gguf"
    _corrupt_copy(smol_path, bad, "blk.3.attn_q.weight", nan_scale)
    for q in ("gguf", "none"):
        with pytest.raises(ConfigError, match=r"blk\.3\.attn_q\.weight.*corrupt: block 5"):
            LLM(str(bad), quantization=q, kv_cache_memory="32MiB", progress=False)


def test_truncated_gguf_is_a_clear_error(smol_path, tmp_path):
    bad = tmp_path / "truncated.gguf"
    with open(smol_path, "rb") as src, open(bad, "wb") as dst:
        dst.write(src.read(smol_path.stat().st_size - 1_000_000))
    with pytest.raises(ConfigError, match="truncated"):
        LLM(str(bad), kv_cache_memory="32MiB", progress=False)

"""Where a packed layer hands its products to dequantize + dense GEMM: the measured crossover per CPU
kind, activation precision and weight format (layers/quantization/packed.py)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tokenmill import LLM
from tokenmill.model.fused_decode import FusedDecode
from tokenmill.model.layers.quantization import act_bits, packed
from tokenmill.model.layers.quantization.formats import FORMATS, random_blocks
from tokenmill.model.quant_kernels import quant_kernels_available

pytestmark = pytest.mark.skipif(not quant_kernels_available(), reason="no C++ toolchain")
Q4_K, Q6_K, Q4_1 = (FORMATS[f].id for f in ("Q4_K", "Q6_K", "Q4_1"))


def _cpu(monkeypatch, vendor: str, level: str, family: str = "6") -> None:
    monkeypatch.setattr(packed, "cpu_vendor", lambda: vendor)
    monkeypatch.setattr(packed, "active_isa", lambda: level)
    monkeypatch.setattr(packed, "cpu_family", lambda: family)


def test_crossover_follows_cpu_kind_codes_and_format(monkeypatch):
    _cpu(monkeypatch, "AuthenticAMD", "avx512_bf16", "26")
    assert packed.default_dense_min_rows(16, Q4_K) == 128
    assert packed.default_dense_min_rows("auto", Q6_K) == 128  # as 16 until measured
    assert packed.default_dense_min_rows(8, Q4_K) == 0  # the packed kernel at every row count
    assert packed.default_dense_min_rows(8, Q6_K) == 512
    _cpu(monkeypatch, "AuthenticAMD", "avx512_bf16", "25")  # a Zen 4: its own table first
    assert packed.default_dense_min_rows(8, Q6_K) == 2048
    assert packed.default_dense_min_rows(8, FORMATS["Q5_0"].id) == 0
    _cpu(monkeypatch, "GenuineIntel", "avx512_bf16")
    assert packed.default_dense_min_rows(16, Q6_K) == packed.default_dense_min_rows(8, Q6_K) == 0
    _cpu(monkeypatch, "GenuineIntel", "avx2")
    assert packed.default_dense_min_rows(8, Q4_K) == packed.DENSE_MIN_ROWS["avx2"]


def _mixed_layer(method: packed.PackedLinearMethod, rows: list[int], k: int) -> SimpleNamespace:
    rng = np.random.default_rng(0)
    blocks = [torch.from_numpy(random_blocks(packed.BY_ID[qt].name, n, k, rng)).reshape(-1)
              for qt, n in zip(method.qtypes, rows)]
    offsets = [0]
    for b in blocks:
        offsets.append(offsets[-1] + b.numel())
    return SimpleNamespace(weight=torch.nn.Parameter(torch.cat(blocks), requires_grad=False), q_offsets=offsets,
                           q_rows=rows, q_in=k, q_views=None)


def test_a_mixed_layer_takes_the_crossover_of_most_of_its_bytes(monkeypatch):
    _cpu(monkeypatch, "AuthenticAMD", "avx512_bf16")
    # Qwen2.5-Coder-1.5B's qkv in half its layers: q and k in Q4_K, v in Q6_K
    method = packed.PackedLinearMethod([Q4_K, Q4_K, Q6_K], act_bits=8)
    method.process_raw_rows(_mixed_layer(method, [1536, 256, 256], 1536))
    assert method.main_qtype == Q4_K and method.dense_min_rows == 0
    method = packed.PackedLinearMethod([Q4_K, Q6_K], act_bits=8)
    method.process_raw_rows(_mixed_layer(method, [256, 1536], 1536))
    assert method.main_qtype == Q6_K and method.dense_min_rows == 512
    method.set_act_bits(16)
    assert method.dense_min_rows == 128
    fixed = packed.PackedLinearMethod([Q6_K], dense_min_rows=64, act_bits=16)
    fixed.set_act_bits(8)
    assert fixed.dense_min_rows == 64  # --quant-dense-min-rows holds whatever the codes


@pytest.mark.parametrize("bits", ["auto", "auto-kept-8", 8])
def test_loaded_model_uses_the_crossover_of_its_codes(bits, tmp_path, monkeypatch):
    """The crossover is settled after `auto` picks the codes (built as 16, then 8 from a kept
    verdict), and the fused decode layers (set up at the first step) run the same."""
    cache = tmp_path / "act_bits.json"
    monkeypatch.setattr(act_bits, "_cache_path", lambda: cache)
    args = dict(kv_cache_memory="256MiB", max_model_len=512, progress=False)
    if bits == "auto-kept-8":
        first = LLM(**args)  # measures SmolLM2: 16 bits; the verdict is then made 8
        del first
        cache.write_text(json.dumps({k: {**v, "bits": 8} for k, v in json.loads(cache.read_text()).items()}))
    llm = LLM(quant_act_bits="auto" if bits == "auto-kept-8" else bits, **args)
    model = llm.engine.core.worker.model
    methods = act_bits.packed_methods(model)
    assert methods and {m.act_bits for m in methods} == ({8} if bits != "auto" else {16})
    for m in methods:
        assert m.dense_min_rows == packed.default_dense_min_rows(m.act_bits, m.main_qtype)
    llm.generate(["Hello"], use_tqdm=False)
    fused = model.model.fused_decode
    if fused is not None and fused.usable:  # built at the first step: it holds what the layers hold now
        layers = [model.model.layers[i] for i in model.model.stage_layers]
        again = FusedDecode(layers, layers[0].self_attn.backend)
        assert fused.ints == again.ints and fused.act_bits == again.act_bits == methods[0].act_bits

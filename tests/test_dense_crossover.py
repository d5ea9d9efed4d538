"""Where a packed layer hands its products to dequantize + dense GEMM: the measured crossover per CPU
kind, activation precision and weight format (layers/quantization/packed.py)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tokenmill import LLM
from tokenmill.config import EngineConfig
from tokenmill.errors import ConfigError
from tokenmill.model.fused_decode import FusedDecode
from tokenmill.model.layers.quantization import act_bits, crossover, packed
from tokenmill.model.layers.quantization.formats import FORMATS, random_blocks
from tokenmill.model.loader.cache import VerdictFile
from tokenmill.model.quant_kernels import quant_kernels_available

pytestmark = pytest.mark.skipif(not quant_kernels_available(), reason="no C++ toolchain")
Q4_K, Q6_K, Q4_1 = (FORMATS[f].id for f in ("Q4_K", "Q6_K", "Q4_1"))


def _cpu(monkeypatch, vendor: str, level: str, family: str = "6", model: str = "85") -> None:
    monkeypatch.setattr(packed, "cpu_vendor", lambda: vendor)
    monkeypatch.setattr(packed, "active_isa", lambda: level)
    monkeypatch.setattr(packed, "cpu_family", lambda: family)
    monkeypatch.setattr(packed, "cpu_model_number", lambda: model)


def test_crossover_follows_cpu_kind_codes_and_format(monkeypatch):
    _cpu(monkeypatch, "AuthenticAMD", "avx512_bf16", "26")
    assert packed.default_dense_min_rows(16, Q4_K) == 128
    assert packed.default_dense_min_rows("auto", Q6_K) == 128  # as 16 until measured
    assert packed.default_dense_min_rows(8, Q4_K) == 0  # the packed kernel at every row count
    assert packed.default_dense_min_rows(8, Q6_K) == 512
    _cpu(monkeypatch, "AuthenticAMD", "avx512_bf16", "25")  # a Zen 4: its own (empty) table first
    assert packed.default_dense_min_rows(8, Q6_K) == 0
    assert packed.default_dense_min_rows(8, FORMATS["Q5_0"].id) == 0
    _cpu(monkeypatch, "GenuineIntel", "avx512_bf16")
    assert packed.default_dense_min_rows(16, Q6_K) == packed.default_dense_min_rows(8, Q6_K) == 0
    _cpu(monkeypatch, "GenuineIntel", "avx2")
    assert packed.default_dense_min_rows(8, Q4_K) == packed.DENSE_MIN_ROWS["avx2"]
    _cpu(monkeypatch, "AuthenticAMD", "avx2", "25", "17")  # measured: 8-bit codes keep the packed kernel
    assert packed.default_dense_min_rows(8, Q4_K) == 0
    assert packed.default_dense_min_rows(8, Q6_K) == 2048
    assert packed.default_dense_min_rows(16, Q4_K) == 512  # its own 16-bit crossover, not the level's
    _cpu(monkeypatch, "AuthenticAMD", "avx2", "25", "1")  # a Zen 3: its model's table first
    assert packed.default_dense_min_rows(8, Q6_K) == 0
    assert packed.default_dense_min_rows(16, Q4_K) == 512


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


@pytest.mark.slow
@pytest.mark.parametrize("bits", ["auto", "auto-kept-8", 8])
def test_loaded_model_uses_the_crossover_of_its_codes(bits, tmp_path, monkeypatch):
    """The crossover is settled after `auto` picks the codes (built as 16, then 8 from a kept
    verdict), and the fused decode layers (set up at the first step) run the same."""
    cache = tmp_path / "act_bits.json"
    monkeypatch.setattr(act_bits, "VERDICTS", VerdictFile("act_bits.json", cache))
    args = dict(kv_cache_memory="256MiB", max_model_len=512, progress=False)
    if bits == "auto-kept-8":
        first = LLM(**args)  # measures SmolLM2; the verdict is then made 8 for every kind
        del first
        cache.write_text(json.dumps({k: {**v, "bits": 8} for k, v in json.loads(cache.read_text()).items()}))
    llm = LLM(quant_act_bits="auto" if bits == "auto-kept-8" else bits, **args)
    model = llm.engine.core.worker.model
    methods = act_bits.packed_methods(model)
    # auto: the codes measured per kind of layer (act_bits.py)
    expected = {8} if bits != "auto" else {b for v in json.loads(cache.read_text()).values()
                                           for b in v["bits"].values()}
    assert methods and {m.act_bits for m in methods} == expected
    measured = crossover.wants_measurement(None)  # an AMX CPU: no table entry, measured at load
    for m in methods:
        assert m.dense_min_rows == (_kept(m, model.dtype) if measured else
                                    packed.default_dense_min_rows(m.act_bits, m.main_qtype))
    llm.generate(["Hello"], use_tqdm=False)
    fused = model.model.fused_decode
    if fused is not None and fused.usable:  # built at the first step: it holds what the layers hold now
        layers = [model.model.layers[i] for i in model.model.stage_layers]
        again = FusedDecode(layers, layers[0].self_attn.backend)
        assert fused.ints == again.ints
        linears = [lin for ly in layers for lin in (ly.self_attn.qkv_proj, ly.self_attn.o_proj,
                                                  ly.mlp.gate_up_proj, ly.mlp.down_proj)]
        assert _ints_bits(fused.ints, len(layers)) == [lin.method.act_bits for lin in linears]


def _ints_bits(ints: list[int], num_layers: int) -> list[int]:
    """Each linear's activation codes as decode_layers.cpp reads them from the fused layers' ints."""
    out, i = [], 0
    for _ in range(num_layers):
        i += 1  # has_bias
        for _ in range(4):  # dense_min_rows, act_bits, has outliers, n, then n (qtype, rows)
            out.append(ints[i + 1])
            i += 4 + 2 * ints[i + 3]
    return out


def _kept(method, dtype) -> int:
    """The crossover kept for this CPU, the method's format and codes (crossover.py)."""
    return crossover.VERDICTS.read()[crossover.cache_key(method.main_qtype, method.act_bits, dtype)]["rows"]


def test_the_rule_dense_from_where_it_wins_at_every_larger_count():
    assert crossover.crossover_from({16: (1, 3), 64: (4, 5), 256: (16, 10), 1024: (64, 30)}) == 256
    assert crossover.crossover_from({16: (1, 3), 64: (4, 5), 256: (16, 10), 1024: (30, 31)}) == 0  # loses last
    assert crossover.crossover_from({16: (1, 0.5), 64: (4, 5), 256: (16, 10)}) == 256  # a win below a loss
    assert crossover.crossover_from({16: (1, 0.97), 64: (4, 3.9)}) == 0  # within the 5% margin: packed
    assert crossover.crossover_from({}) == 0


def test_only_kinds_without_a_table_entry_or_measure_are_measured(monkeypatch):
    monkeypatch.setattr(crossover, "active_isa", lambda: "amx")
    assert crossover.wants_measurement(None) and crossover.wants_measurement("measure")
    assert not crossover.wants_measurement(64)  # --quant-dense-min-rows 64 holds
    monkeypatch.setattr(crossover, "active_isa", lambda: "avx512_bf16")
    assert not crossover.wants_measurement(None) and crossover.wants_measurement("measure")


def test_the_flag_takes_rows_or_measure():
    assert EngineConfig.from_kwargs(quant_dense_min_rows="measure").quant.quant_dense_min_rows == "measure"
    assert EngineConfig.from_kwargs(quant_dense_min_rows="256").quant.quant_dense_min_rows == 256
    for bad in (0, "0", "soon", -4):
        with pytest.raises(ConfigError, match="quant_dense_min_rows"):
            EngineConfig.from_kwargs(quant_dense_min_rows=bad)


def test_measured_at_load_per_format_then_kept(tmp_path, monkeypatch):
    """SmolLM2's Q4_1 layers and Q8_0 head: each format measured on its largest layer, set on every
    layer of that format, kept, and read back without measuring again by the next load, which takes
    the default policy on a CPU kind that has no table entry (as an AMX Xeon)."""
    monkeypatch.setattr(crossover, "VERDICTS", VerdictFile("dense_crossover.json", tmp_path / "kept.json"))
    args = dict(kv_cache_memory="64MiB", max_model_len=256, quant_act_bits=16, quant_dense_min_rows="measure",
                progress=False)
    llm = LLM(**args)
    model = llm.engine.core.worker.model
    kept = json.loads((tmp_path / "kept.json").read_text())
    assert {k.split("|")[-3] for k in kept} == {"Q4_1", "Q8_0"}
    for entry in kept.values():
        assert list(map(int, entry["ms"]))[:3] == [16, 32, 64] and entry["shape"][0] <= crossover.SLICE_ROWS
        assert entry["rows"] == crossover.crossover_from({int(m): tuple(t) for m, t in entry["ms"].items()})
    methods = act_bits.packed_methods(model)
    assert {m.dense_min_rows for m in methods} <= {e["rows"] for e in kept.values()}
    for m in methods:
        assert m.dense_min_rows == _kept(m, model.dtype)
    assert llm.generate(["Hello"], use_tqdm=False)[0].outputs[0].token_ids
    del llm

    def no_measuring(*a, **k):
        raise AssertionError("measured again")

    monkeypatch.setattr(crossover, "measure", no_measuring)
    monkeypatch.setattr(crossover, "active_isa", lambda: "amx")  # the default on a kind without a table entry
    again = LLM(**{**args, "quant_dense_min_rows": None})
    for m in act_bits.packed_methods(again.engine.core.worker.model):
        assert m.dense_min_rows == _kept(m, model.dtype)


def test_measured_for_weights_quantized_at_load(tiny_qwen2_dir, tmp_path, monkeypatch):
    """--quantization int4 (groups of 32, i.e. Q4_1) on a small Qwen2 folder, whose largest layer
    (704 x 256) has fewer rows than the measurement's slice: every packed format measured."""
    monkeypatch.setattr(crossover, "VERDICTS", VerdictFile("dense_crossover.json", tmp_path / "kept.json"))
    llm = LLM(model=str(tiny_qwen2_dir), quantization="int4", quant_group_size=32, quant_dense_min_rows="measure",
              dtype="float32", kv_cache_memory="32MiB", max_model_len=128, progress=False)
    kept = json.loads((tmp_path / "kept.json").read_text())
    methods = act_bits.packed_methods(llm.engine.core.worker.model)
    assert methods and all(e["ms"] and e["shape"][0] <= 704 for e in kept.values())
    for m in methods:
        assert m.dense_min_rows == _kept(m, torch.float32)
    assert llm.generate(["Hello"], use_tqdm=False)[0].outputs[0].token_ids

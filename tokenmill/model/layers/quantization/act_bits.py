"""`--quant-act-bits auto`: the packed kernels' activation precision, measured once per model.

8-bit codes (one int8 per activation and a scale per 32, as llama.cpp's and vLLM's GGUF kernels; for
K-quant weights a power-of-two fraction of a 256-value super-block's, so that their sub-block scales
apply in integers) take half the integer work of 16-bit ones (int8 plus an int8 code of its rounding
residual, as exact as fp32): what bounds many-row products (verification, batches) on a CPU without
AMX. What they cost in accuracy depends on the model: on Qwen2.5-Coder-0.5B nothing measurable, on
SmolLM2-135M +0.44% perplexity, most of issue 8's 0.5% budget (BENCHMARKS.md). So the choice is
measured: the perplexity of 512 tokens of built-in text (calibration.py) with 8-bit codes against
16-bit ones; 8 bits when the change is within `MAX_CHANGE` (0.3%, margin under the 0.5% budget for
another text), else 16. The verdict is kept in the cache folder, keyed by the weight files' size and
time, the dtype and the codes (`CODES`), so a model pays the measurement (two passes over the text:
1.3 s for SmolLM2, 6.2 s for Qwen2.5-Coder-1.5B on 2 cores) once. With tensor or pipeline
parallelism no rank can run the whole model alone: 16 bits without measuring. Perplexity is the
budget's measure; a model with near-uniform predictions (random weights) hardly moves it whatever
its logits do, so tests of the products themselves pin the bits.
"""

from __future__ import annotations

import logging
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from tokenmill.model.layers.quantization.packed import PackedLinearMethod
from tokenmill.model.loader.cache import VerdictFile

logger = logging.getLogger(__name__)
TOKENS = 512
MAX_CHANGE = 0.003  # relative perplexity change allowed for 8-bit codes
# what 8-bit codes are; a verdict measured on other codes is measured again. 2: power-of-two chunk
# scales under each 256-value super-block for K-quant weights (csrc/quant_act.h), per 32 for the rest.
CODES = 2
VERDICTS = VerdictFile("act_bits.json")


def packed_methods(model: torch.nn.Module) -> list[PackedLinearMethod]:
    seen: dict[int, PackedLinearMethod] = {}
    for m in model.modules():
        method = getattr(m, "method", None)
        if isinstance(method, PackedLinearMethod):
            seen.setdefault(id(method), method)
    return list(seen.values())


def set_act_bits(model: torch.nn.Module, bits: int) -> None:
    for method in packed_methods(model):
        method.set_act_bits(bits)


def fingerprint(path: Path, dtype: torch.dtype) -> str:
    """The weight files' names, sizes and modification times, the activations' dtype, and the codes."""
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
    stats = [f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files]
    return f"{path.resolve()}|{dtype}|codes{CODES}|" + ",".join(stats)


def _nll(model: torch.nn.Module, ids: list[int]) -> float:
    """Mean negative log-likelihood of ids[1:] given the prefix, one causal pass, no KV cache."""
    from tokenmill.model.layers.quantization.calibration import causal_pass

    hidden = causal_pass(model, ids)
    target = torch.tensor(ids[1:])
    total = 0.0
    with torch.inference_mode():
        for i in range(0, len(ids) - 1, 128):  # the logits of 128 positions at a time
            logits = model.compute_logits(hidden[i:i + 128][: len(ids) - 1 - i]).float()
            total += F.cross_entropy(logits, target[i:i + 128], reduction="sum").item()
    return total / (len(ids) - 1)


def measure_change(model: torch.nn.Module, ids: list[int]) -> float:
    """Relative perplexity change of 8-bit codes against 16-bit ones (the packed kernel both times:
    the dense path's bf16 weights would add their own rounding to the reference)."""
    methods = packed_methods(model)
    saved = [(m.dense_min_rows, m.act_bits) for m in methods]
    try:
        nll = {}
        for bits in (16, 8):
            for m in methods:
                m.dense_min_rows, m.act_bits = 0, bits  # the packed kernel at every row count
            nll[bits] = _nll(model, ids)
    finally:
        for m, (rows, bits) in zip(methods, saved):
            m.dense_min_rows, m.act_bits = rows, bits
    return math.exp(nll[8] - nll[16]) - 1


def choose_act_bits(model: torch.nn.Module, source, dtype: torch.dtype, calibration_ids) -> int:
    """8 or 16 for a model whose packed layers were built with act_bits "auto"; sets it on them.
    calibration_ids(source, n): the first n tokens of the built-in text (QuantConfig.calibration_ids)."""
    from tokenmill import distributed

    st = distributed.state()
    if not packed_methods(model):
        return 16
    if st.tp_size > 1 or st.pp_size > 1:
        set_act_bits(model, 16)
        logger.info("activation codes: 16-bit (auto is not measured with tensor or pipeline parallelism)")
        return 16
    key = fingerprint(Path(source.path), dtype)
    entry = VERDICTS.read().get(key)
    cached = isinstance(entry, dict) and entry.get("bits") in (8, 16)  # else (hand-edited, older): measured
    if not cached:
        from tokenmill.model.layers.quantization.calibration import max_positions

        t0 = time.perf_counter()
        ids = calibration_ids(source, min(TOKENS, max_positions(model)))
        change = measure_change(model, ids)
        entry = {"change": change, "bits": 8 if change <= MAX_CHANGE else 16, "tokens": len(ids),
                 "seconds": round(time.perf_counter() - t0, 2)}
        # gone models, and older verdicts of this model and dtype: dropped
        prefix = key.split("|codes", 1)[0] + "|"
        VERDICTS.put(key, entry, keep=lambda k: Path(k.split("|", 1)[0]).exists() and not k.startswith(prefix))
    set_act_bits(model, entry["bits"])
    logger.info("activation codes: %d-bit (8-bit codes measured %+.3f%% perplexity against 16-bit ones "
                "on %d tokens of built-in text, limit %+.1f%%%s)", entry["bits"], 100 * entry["change"],
                entry["tokens"], 100 * MAX_CHANGE, "; cached" if cached else f"; {entry['seconds']}s")
    return entry["bits"]

"""Outlier channels of 8-bit activation codes, chosen with `--quant-act-bits auto` (act_bits.py).

A few input columns of a layer hold values 10-40x their row's RMS, and they are the same columns for
every token (RMSNorm's weights and the model's "massive activations" put them there). With one scale
per 32 values, such a column's block spends its 8 bits on it and rounds its other 31 values coarsely.
Each packed layer leaves up to `MAX_CHANNELS` such columns out of its codes and adds them back exactly
(csrc/quant_outliers.h): on SmolLM2, 8-bit codes everywhere then change perplexity by an expected
0.07% against 16-bit codes, where they changed it by ~0.3% without (BENCHMARKS.md). They cost a
product ~1-15% (the most at few rows and on small products, whose fp32 W columns are ~9% of their
bytes), so `auto` gives them only to the kinds that need them. The columns are those whose largest
|x| / RMS(row) over the calibration text reaches `MIN_SCORE`; the same columns chosen on the next
512 tokens of the text gave the same change (0.069% against 0.062%).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from tokenmill.model.layers.quantization.packed import PackedLinearMethod

MAX_CHANNELS = 8
MIN_SCORE = 6.0


def packed_layers(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The layers that multiply by packed weights, by module name (an embedding only looks rows up)."""
    from tokenmill.model.layers.embedding import VocabEmbedding

    return {name: m for name, m in model.named_modules()
            if isinstance(getattr(m, "method", None), PackedLinearMethod) and not isinstance(m, VocabEmbedding)}


@contextlib.contextmanager
def scores(model: torch.nn.Module) -> Iterator[dict[str, torch.Tensor]]:
    """While open, each packed layer's input columns are scored as they pass: the largest |x| / RMS of
    its row seen so far, per column."""
    found: dict[str, torch.Tensor] = {}
    layers = packed_layers(model)
    by_id = {id(layer): name for name, layer in layers.items()}
    methods = {id(layer.method): layer.method for layer in layers.values()}
    saved = {key: m.__dict__.get("apply") for key, m in methods.items()}

    def scoring(method):
        def apply(layer, x, bias, out_dtype=None):
            name = by_id.get(id(layer))
            if name is not None and x.numel():
                rows = x.reshape(-1, x.shape[-1]).float()
                rms = rows.pow(2).mean(1, keepdim=True).sqrt().clamp(min=1e-30)
                score = (rows.abs() / rms).amax(0)
                found[name] = score if name not in found else torch.maximum(found[name], score)
            return type(method).apply(method, layer, x, bias, out_dtype)
        return apply

    for m in methods.values():
        m.apply = scoring(m)
    try:
        yield found
    finally:
        for key, m in methods.items():
            if saved[key] is None:
                del m.apply
            else:
                m.apply = saved[key]


def choose(found: dict[str, torch.Tensor]) -> dict[str, list[int]]:
    """Per layer, its columns that reach MIN_SCORE, the highest MAX_CHANNELS of them."""
    chosen = {}
    for name, score in found.items():
        top = score.topk(min(MAX_CHANNELS, score.numel()))
        cols = top.indices[top.values >= MIN_SCORE].tolist()
        if cols:
            chosen[name] = sorted(cols)
    return chosen


def apply_channels(model: torch.nn.Module, channels: dict[str, list[int]]) -> int:
    """Sets each packed layer's outlier channels (none where not named); returns the columns set."""
    total = 0
    for name, layer in packed_layers(model).items():
        cols = channels.get(name)
        layer.method.set_outliers(layer, cols)
        total += len(cols or ())
    return total

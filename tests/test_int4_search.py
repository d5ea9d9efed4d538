"""The int4 quantizer of `--quantization int4` (int4_search.py): its scale/minimum search leaves less
error than min/max round-to-nearest, and what it stores is always valid (codes 0..15, finite fp16
scales, zero and constant groups exact). Read back through the stored bytes, as the kernels do."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenmill.model.layers.quantization.formats import dequantize_own, quantize_q4_groups
from tokenmill.model.layers.quantization.int4_search import importance, search_groups


def _dequantized(w: torch.Tensor, group: int, search: bool) -> torch.Tensor:
    packed = quantize_q4_groups(w, group, search=search).numpy()
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
def test_search_beats_round_to_nearest(kind, group):
    w = _weights(kind)
    rtn, searched = _dequantized(w, group, search=False), _dequantized(w, group, search=True)
    err_rtn, err = (rtn - w).square().sum(), (searched - w).square().sum()
    assert err < 0.9 * err_rtn, (err, err_rtn)
    # the objective itself (importance-weighted) improves in every row, not just on average
    imp = importance(w.view(w.shape[0], -1, group)).view_as(w)
    row_rtn, row = (imp * (rtn - w).square()).sum(1), (imp * (searched - w).square()).sum(1)
    assert (row <= row_rtn * 1.001).all()


@pytest.mark.parametrize("group", [32, 128])
def test_codes_scales_and_degenerate_groups(group):
    w = _weights("heavy_tailed", rows=6, k=256)
    w[0] = 0.0  # an all-zero row
    w[1] = 0.75  # constant groups
    w[2, :group] = 0.0  # one zero group in an otherwise ordinary row
    w[3] *= 3e4  # near fp16's largest
    w[4, 5] = -1e-7  # one tiny weight in a zero group
    w[4, 6:group] = 0.0
    d, m, q = search_groups(w.view(6, -1, group))
    assert torch.isfinite(d).all() and torch.isfinite(m).all() and (d >= 0).all()
    assert ((q >= 0) & (q <= 15) & (q == q.round())).all()
    out = _dequantized(w, group, search=True)
    assert torch.isfinite(out).all()
    assert (out[0] == 0).all() and (out[2, :group] == 0).all()
    torch.testing.assert_close(out[1], w[1], rtol=1e-3, atol=0)  # fp16 m
    assert (out[3] - w[3]).abs().max() <= (w[3].abs().max() / 7)  # no overflow to inf at the extremes

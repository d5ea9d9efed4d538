"""Choosing each int4 group's scale d and minimum m (w ~ d * q + m, q in 0..15) to minimise the
weighted squared reconstruction error, as llama.cpp's k-quants do when they quantize
(`make_qkx2_quants` / `make_qkx3_quants` in ggml-quants.c), instead of min/max round-to-nearest.

For each of a few grids a little narrower and wider than the group's min..max, the codes are
rounded on that grid, then d and m are refitted to those codes by weighted least squares (closed
form); the grid with the least error wins. A couple of alternating steps (re-round the codes for
the fitted d, m; refit) finish it. All groups of a tensor are searched at once, chunk by chunk
(so each chunk stays in cache); d and m are rounded to fp16, as stored, before the final codes.

The importance weight of each weight w_i is sqrt(sigma^2 + w_i^2), sigma^2 the group's mean square:
what llama.cpp's k-quants multiply their importance matrix by (without one, the weight's own
magnitude is the only hint of which errors matter).
"""

from __future__ import annotations

import torch

NMAX = 15
GRID_STEPS = torch.linspace(-1.0, 1.0, 9)  # grids of NMAX-1 .. NMAX+1 steps over min..max
REFITS = 2
CHUNK = 1 << 12  # groups per chunk (a chunk stays in cache)
FP16_MAX = 65504.0


def importance(x: torch.Tensor) -> torch.Tensor:
    return (x.square().mean(-1, keepdim=True) + x.square()).sqrt()


def _fit(w: torch.Tensor, x: torch.Tensor, q: torch.Tensor, sums: tuple) -> tuple:
    """Least-squares d, m for codes q (float64 per group) and the error they leave."""
    sw, sx, sxx = sums
    wq = w * q
    sq = wq.sum(-1).double()
    sqq = torch.linalg.vecdot(wq, q).double()
    sxq = torch.linalg.vecdot(wq, x).double()
    det = sw * sqq - sq * sq
    ok = det > 1e-12 * (sw * sqq).clamp_min(1e-300)
    det = torch.where(ok, det, torch.ones_like(det))
    d = (sw * sxq - sx * sq) / det
    m = (sqq * sx - sq * sxq) / det
    err = d * d * sqq + 2 * d * m * sq - 2 * d * sxq + m * m * sw - 2 * m * sx + sxx
    return d, m, torch.where(ok & (d > 0), err, torch.full_like(err, float("inf")))


def _codes(x: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    inv = torch.where(d > 0, 1.0 / d.clamp_min(1e-30), torch.zeros_like(d))
    return ((x - m) * inv).round_().clamp_(0, NMAX)


def _to_fp16(v: torch.Tensor) -> torch.Tensor:
    return v.clamp(-FP16_MAX, FP16_MAX).half().float()


def _search_chunk(x: torch.Tensor, scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    w = importance(x) if scale is None else importance(x) * scale
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    span = hi - lo
    u = (x - lo) / span.clamp_min(1e-30)  # in [0, 1]
    sums = (w.sum(-1).double(), torch.linalg.vecdot(w, x).double(), torch.linalg.vecdot(w * x, x).double())
    # round-to-nearest on min..max, the starting point (and all a flat group gets)
    best_d, best_m = (span / NMAX).squeeze(-1).double(), lo.squeeze(-1).double()
    q = (u * NMAX).round_()
    best_err = (torch.linalg.vecdot(w, (q * span / NMAX + lo - x).square())).double()
    for step in GRID_STEPS.tolist():
        q = (u * (NMAX + step)).round_().clamp_(0, NMAX)
        d, m, err = _fit(w, x, q, sums)
        better = err < best_err
        best_d, best_m, best_err = (torch.where(better, d, best_d), torch.where(better, m, best_m),
                                    torch.where(better, err, best_err))
    for _ in range(REFITS):
        q = _codes(x, best_d.float().unsqueeze(-1), best_m.float().unsqueeze(-1))
        d, m, err = _fit(w, x, q, sums)
        better = err < best_err
        best_d, best_m, best_err = (torch.where(better, d, best_d), torch.where(better, m, best_m),
                                    torch.where(better, err, best_err))
    d, m = _to_fp16(best_d.float()).unsqueeze(-1), _to_fp16(best_m.float()).unsqueeze(-1)
    return d, m, _codes(x, d, m)


def search_groups(g: torch.Tensor, input_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """g: [rows, groups, group] float. Returns d, m ([rows, groups, 1], fp16 values in float32) and
    q ([rows, groups, group], 0..15 as float32), minimising per group
    sum_i input_scale_i * importance_i * (d * q_i + m - g_i)^2; input_scale (one per input column,
    e.g. the mean square of what the layer multiplies) says which columns' errors matter more."""
    shape = g.shape
    flat = g.float().reshape(-1, shape[-1])
    scale = None if input_scale is None else input_scale.float().view(1, *shape[1:]).expand(shape).reshape(flat.shape)
    d, m = torch.empty(flat.shape[0], 1), torch.empty(flat.shape[0], 1)
    q = torch.empty_like(flat)
    for s in range(0, flat.shape[0], CHUNK):
        d[s:s + CHUNK], m[s:s + CHUNK], q[s:s + CHUNK] = _search_chunk(
            flat[s:s + CHUNK], None if scale is None else scale[s:s + CHUNK])
    return d.reshape(*shape[:-1], 1), m.reshape(*shape[:-1], 1), q.reshape(shape)

"""Choosing each int4 group's scale d and minimum m (w ~ d * q + m, q in 0..15) at load, better
than min/max round-to-nearest. Two fits, each where it measured best on Qwen2.5-Coder-0.5B
(BENCHMARKS.md, "int4 quantizer"):

- groups of 32: a search of scale and minimum minimising the weighted squared error, as llama.cpp's
  k-quants do (`make_qkx2_quants` in ggml-quants.c): for grids a little narrower and wider than the
  group's min..max, round the codes, refit d and m to them by weighted least squares (closed form),
  keep the best; two alternating refits finish it. Weight of each element: sqrt(sigma^2 + w^2)
  (sigma^2 the group's mean square), as llama.cpp's k-quants use.
- groups of 128: HQQ's zero-point optimisation (Badri & Shaji, "Half-Quadratic Quantization of
  Large Machine Learning Models", 2023). The scale stays (max - min) / 15, so the extremes stay
  representable; the zero point minimises an l_p (p = 0.7) loss by half-quadratic splitting:
  round the codes, shrink the residual (small errors vanish, large ones stay, so a few weights
  absorb what would spread over all), refit the zero point to what is left, as a mean weighted by
  the input columns' mean squares when calibration.py measured them; stop when the error grows.
  On groups of 128 the search clips too much; on groups of 32 HQQ keeps too coarse a scale.

All groups are fitted at once, chunk by chunk; d and m are rounded to fp16, as stored, before the
final codes.
"""

from __future__ import annotations

import torch

NMAX = 15
GRID_STEPS = [-1.0, -0.75, -0.5, -0.25, 0.0, 0.25, 0.5, 0.75, 1.0]  # grids of 14..16 steps over min..max
REFITS = 2
P, BETA, KAPPA, ITERS = 0.7, 10.0, 1.01, 20  # HQQ's published defaults
CHUNK = 1 << 18  # weights per chunk
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


def _search_chunk(x: torch.Tensor, scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    w = importance(x) if scale is None else importance(x) * scale
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    span = hi - lo
    u = (x - lo) / span.clamp_min(1e-30)  # in [0, 1]
    sums = (w.sum(-1).double(), torch.linalg.vecdot(w, x).double(), torch.linalg.vecdot(w * x, x).double())
    # round-to-nearest on min..max, the starting point (and all a flat group gets)
    best_d, best_m = (span / NMAX).squeeze(-1).double(), lo.squeeze(-1).double()
    q = (u * NMAX).round_()
    best_err = (torch.linalg.vecdot(w, (q * span / NMAX + lo - x).square())).double()
    for step in GRID_STEPS:
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
    return best_d.float().unsqueeze(-1), best_m.float().unsqueeze(-1)


def _fit_zero(x: torch.Tensor, colw: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [groups, group]; colw: matching weights of each element's input column, or None."""
    lo, hi = x.amin(-1, keepdim=True), x.amax(-1, keepdim=True)
    s_inv = NMAX / (hi - lo).clamp_min(1e-30)
    d = 1.0 / s_inv
    xs = x * s_inv  # the weights in steps of d
    z = -lo * s_inv  # in steps: w ~ d * (q - z)
    wsum = None if colw is None else colw.sum(-1, keepdim=True).clamp_min(1e-30)
    beta, best_err, best_z = BETA, None, z
    for _ in range(ITERS):
        q = (xs + z).round_().clamp_(0, NMAX)
        e = xs - q + z  # residual, in steps
        a = e.abs()
        err = (a * d).mean()
        if best_err is not None and err > best_err:
            break
        best_err, best_z = err, z
        # l_p shrinkage of the residual in weight units, |e| - |e|^(p-1) / beta, back in steps
        t = (a * d).clamp_min_(1e-30).pow_(P - 1).div_(beta).mul_(s_inv)
        e = e.sign_().mul_(a.sub_(t).relu_())
        target = q.sub_(xs).add_(e)  # the zero point each weight asks for
        z = target.mean(-1, keepdim=True) if colw is None else (target * colw).sum(-1, keepdim=True) / wsum
        beta *= KAPPA
    return d, -best_z * d


def _to_fp16(v: torch.Tensor) -> torch.Tensor:
    return v.clamp(-FP16_MAX, FP16_MAX).half().float()


def fit_groups(g: torch.Tensor, input_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """g: [rows, groups, group] float; input_scale: [groups * group] (each input column's mean
    square) or None. Returns d, m ([rows, groups, 1], fp16 values as float32) and the codes q
    ([rows, groups, group], 0..15 as float32) nearest to g for them. Groups of 32 or fewer: the
    least-squares search; larger: HQQ."""
    shape = g.shape
    flat = g.float().reshape(-1, shape[-1])
    colw = None if input_scale is None else input_scale.float().view(1, *shape[1:]).expand(shape).reshape(flat.shape)
    fit = _search_chunk if shape[-1] <= 32 else _fit_zero
    d, m = torch.empty(flat.shape[0], 1), torch.empty(flat.shape[0], 1)
    step = max(1, CHUNK // shape[-1])
    for s in range(0, flat.shape[0], step):
        d[s:s + step], m[s:s + step] = fit(flat[s:s + step], None if colw is None else colw[s:s + step])
    d, m = _to_fp16(d), _to_fp16(m)
    return d.reshape(*shape[:-1], 1), m.reshape(*shape[:-1], 1), _codes(flat, d, m).reshape(shape)

"""The step cost model: seconds for one engine step of a given shape.

    t = G(tokens) + per_seq * seqs + per_decode_context * decode_context
        + per_prefill_pair * prefill_pairs + per_prefill_context * prefill_context
        + per_sampled[_greedy] * sampled + step_overhead + seq_overhead * seqs
        + stream_overhead * sampled

G, the cost of the dense layers, is piecewise linear in the batch's tokens through knots at powers of
two (flat-ish while GEMMs stream the weights from memory, then linear once they are compute-bound);
beyond the last knot it extends with the last slope. Every term is non-negative and G never
decreases. The same form is either fitted to measured steps (`fit`, non-negative least squares
weighted for relative error) or filled in from the machine's measured bandwidth and FLOP/s
(`planning.roofline`).
"""

from __future__ import annotations

import bisect
from dataclasses import asdict, dataclass, field

import numpy as np

from tokenmill.planning.step_shape import StepShape

KNOTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
_LINEAR_TERMS = ("per_seq", "per_decode_context", "per_prefill_pair", "per_prefill_context", "per_sampled",
                 "per_sampled_greedy")


@dataclass
class StepCostModel:
    knots: list[int] = field(default_factory=lambda: list(KNOTS))
    gemm: list[float] = field(default_factory=lambda: [0.0] * len(KNOTS))  # G at each knot, seconds
    per_seq: float = 0.0
    per_decode_context: float = 0.0  # per token of context a decode attends to
    per_prefill_pair: float = 0.0  # per (query, key) pair of a prefill chunk
    per_prefill_context: float = 0.0  # per cached token a prefill chunk attends to (gathered)
    per_sampled: float = 0.0  # per sampled row (LM head + temperature/top-p sampling)
    per_sampled_greedy: float = 0.0  # per sampled row when the whole batch is greedy
    step_overhead: float = 0.0  # the engine around the runner: scheduling, outputs, detokenizing
    seq_overhead: float = 0.0  # ... and its part per sequence
    stream_overhead: float = 0.0  # per sampled row: CPU the server's front end and a local client take per token
    source: str = "roofline"  # "roofline" or "calibrated"

    def gemm_time(self, tokens: int) -> float:
        k, g = self.knots, self.gemm
        if tokens <= k[0]:
            return g[0]
        i = min(bisect.bisect_right(k, tokens) - 1, len(k) - 2)
        slope = (g[i + 1] - g[i]) / (k[i + 1] - k[i])
        return g[i] + slope * (tokens - k[i])

    def step_time(self, s: StepShape) -> float:
        if s.num_seqs == 0:
            return 0.0
        sampled = self.per_sampled_greedy if s.greedy else self.per_sampled
        return (self.gemm_time(s.num_tokens) + (self.per_seq + self.seq_overhead) * s.num_seqs
                + self.per_decode_context * s.decode_context + self.per_prefill_pair * s.prefill_pairs
                + self.per_prefill_context * s.prefill_context + (sampled + self.stream_overhead) * s.num_sampled
                + self.step_overhead)

    def runner_time(self, s: StepShape) -> float:
        """The model runner's part alone (what calibration measures first)."""
        return (self.step_time(s) - self.step_overhead - self.seq_overhead * s.num_seqs
                - self.stream_overhead * s.num_sampled)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> StepCostModel:
        m = cls(**d)
        if len(m.knots) != len(m.gemm) or len(m.knots) < 2:
            raise ValueError("cost model: knots and gemm must have the same length (>= 2)")
        return m

    @classmethod
    def fit(cls, shapes: list[StepShape], seconds: list[float], knots=KNOTS) -> StepCostModel:
        """Non-negative least squares on relative error. Knots beyond the largest measured batch are
        dropped (the last slope extends past them)."""
        top = max(s.num_tokens for s in shapes)
        knots = [k for k in knots if k < top] + [top] if top > knots[0] else list(knots[:2])
        X = np.array([_features(s, knots) for s in shapes], dtype=np.float64)
        y = np.asarray(seconds, dtype=np.float64)
        w = 1.0 / y
        scale = np.abs(X).max(axis=0)
        scale[scale == 0] = 1.0
        coef = nnls((X / scale) * w[:, None], y * w) / scale
        n_ramps = len(knots) - 1
        gemm = list(np.cumsum(np.concatenate([[coef[0]], coef[1:1 + n_ramps] * np.diff(knots)])))
        linear = dict(zip(_LINEAR_TERMS, coef[1 + n_ramps:].tolist()))
        return cls(knots=list(knots), gemm=[float(g) for g in gemm], source="calibrated", **linear)


def _features(s: StepShape, knots) -> list[float]:
    t = s.num_tokens
    ramps = [min(max(t - a, 0), b - a) for a, b in zip(knots, knots[1:])]
    ramps[-1] = max(t - knots[-2], 0)  # the last segment extends beyond its knot
    sampled_random = 0 if s.greedy else s.num_sampled
    sampled_greedy = s.num_sampled if s.greedy else 0
    return [1.0, *ramps, s.num_seqs, s.decode_context, s.prefill_pairs, s.prefill_context, sampled_random,
            sampled_greedy]


def nnls(A: np.ndarray, b: np.ndarray, max_iter: int | None = None) -> np.ndarray:
    """min ||Ax - b|| subject to x >= 0 (Lawson and Hanson's active-set method)."""
    m, n = A.shape
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    tol = 10 * np.finfo(float).eps * np.abs(A).sum(axis=0).max() * max(m, n)
    for _ in range(max_iter or 3 * n):
        w = A.T @ (b - A @ x)
        if passive.all() or w[~passive].max() <= tol:
            break
        passive[np.argmax(np.where(passive, -np.inf, w))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(A[:, passive], b, rcond=None)[0]
            if (z[passive] > tol).all():
                break
            neg = passive & (z <= tol)
            gap = x[neg] - z[neg]
            alpha = float(np.min(np.where(gap > 0, x[neg] / np.where(gap > 0, gap, 1.0), 0.0)))
            x = x + alpha * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
        x = z
    return x

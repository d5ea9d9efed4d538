"""Timing what the engine measures about its machine (planning/machine.py, crossover.py)."""

from __future__ import annotations

import time


def best_of(fn, reps: int = 3) -> float:
    """Seconds of fn's fastest run of `reps`, after one untimed warm-up run."""
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best

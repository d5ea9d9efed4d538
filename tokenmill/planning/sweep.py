"""Load sweeps and the goodput knee for `tokenmill simulate`: traces per load point (as `bench serve`
builds them), one simulation per (setting, load point), and a bisection for the highest load whose
requests still meet the SLO."""

from __future__ import annotations

import math
from dataclasses import dataclass

from tokenmill.planning.cost_model import StepCostModel
from tokenmill.planning.simulator import SimSettings, Simulation
from tokenmill.planning.step_shape import StepShape
from tokenmill.planning.workload import TraceRequest, synthetic_trace, with_arrivals


@dataclass
class Workload:
    input_len: int = 128
    output_len: int = 128
    range_ratio: float = 0.0
    shared_prefix_len: int = 0
    vocab_size: int = 32000
    temperature: float = 0.0
    burstiness: float = 1.0
    seed: int = 0
    num_prompts: int | None = None  # per load point; None: from duration, else bench serve's 100
    duration: float | None = None  # simulated seconds of traffic
    dataset: list[TraceRequest] | None = None

    def base(self, n: int, seed: int) -> list[TraceRequest]:
        if self.dataset is not None:
            return [self.dataset[i % len(self.dataset)] for i in range(n)]
        return synthetic_trace(n, self.input_len, self.output_len, self.range_ratio, self.shared_prefix_len,
                               self.vocab_size, seed)

    def replayable(self) -> bool:
        return bool(self.dataset) and self.dataset[0].arrival is not None


def min_request_time(cost: StepCostModel, w: Workload) -> float:
    """A lower bound on a request's time alone: its prefill, then one-sequence decode steps."""
    prompt = w.shared_prefix_len + max(1, int(w.input_len * (1 - w.range_ratio)))
    prefill = cost.step_time(StepShape.build([prompt], [prompt], [True], w.temperature == 0))
    decode = cost.step_time(StepShape.build([1], [prompt + 1], [True], w.temperature == 0))
    return prefill + max(1, int(w.output_len * (1 - w.range_ratio)) - 1) * decode


def run_point(cost: StepCostModel, settings: SimSettings, w: Workload, mode: str, value: float, seed: int,
              slo: dict[str, float], admission=None) -> dict:
    """One load point, as `bench serve` would run it: mode "concurrency" (closed loop), "request_rate"
    (open loop; inf = all at once) or "replay" (the dataset's timestamps). `admission` makes a fresh
    SLOAdmission for the run (open loop only)."""
    stop_at = None
    if mode == "replay":
        trace, concurrency = w.dataset, None
    elif mode == "request_rate":
        n = w.num_prompts or (math.ceil(value * w.duration * 1.2) + 10 if w.duration and math.isfinite(value)
                              else 100)
        trace, concurrency = with_arrivals(w.base(n, seed), value, w.burstiness, seed), None
        if w.duration and math.isfinite(value) and not w.num_prompts:
            trace = [r for r in trace if r.arrival < w.duration]
    else:
        concurrency = int(value)
        if w.duration and not w.num_prompts:
            n = concurrency * (math.ceil(w.duration / max(min_request_time(cost, w), 1e-6)) + 1)
            stop_at = w.duration
        else:
            n = w.num_prompts or 100
        trace = w.base(min(n, 2_000_000), seed)
    gate = admission() if admission is not None and concurrency is None else None
    result = Simulation(cost, settings, w.temperature, gate).run(trace, concurrency, stop_at)
    out = result.summary(slo)
    out["load"] = {"mode": mode, "value": "inf" if math.isinf(value) else value}
    out["slo_attainment"] = out["goodput"] / out["request_throughput"] if slo and out["request_throughput"] else None
    return out


def attained(run: dict, target: float) -> bool:
    return run["slo_attainment"] is not None and run["slo_attainment"] >= target


def goodput_knee(cost: StepCostModel, settings: SimSettings, w: Workload, mode: str, slo: dict[str, float],
                 target: float, seed: int = 0, upper: int = 4096, iterations: int = 10, admission=None) -> dict:
    """The highest load (request rate, or concurrency for a closed loop) at which `target` of the
    requests meet the SLO, and the goodput there."""
    def at(v: float) -> dict:
        return run_point(cost, settings, w, mode, v, seed, slo, admission)

    if mode == "concurrency":
        runs: dict[int, dict] = {}

        def holds(c: int) -> bool:
            runs[c] = at(c)
            return attained(runs[c], target)

        good, bad = slo_break(holds, upper)
        run = runs.get(good)
        return {"mode": mode, "load": good, "breaks_at": bad, "goodput": run["goodput"] if run else 0.0,
                "output_tok_per_s": run["output_token_throughput"] if run else 0.0}
    capacity = at(math.inf)["request_throughput"]
    lo, hi = 0.0, 2 * capacity
    best = None
    if attained(top := at(hi), target):
        return {"mode": mode, "load": hi, "breaks_at": None, "goodput": top["goodput"],
                "output_tok_per_s": top["output_token_throughput"], "capacity_req_s": capacity}
    for _ in range(iterations):
        mid = (lo + hi) / 2
        run = at(mid)
        if attained(run, target):
            lo, best = mid, run
        else:
            hi = mid
    return {"mode": mode, "load": lo, "breaks_at": hi, "goodput": best["goodput"] if best else 0.0,
            "output_tok_per_s": best["output_token_throughput"] if best else 0.0, "capacity_req_s": capacity}


def slo_break(evaluate, upper: int) -> tuple[int, int | None]:
    """(largest concurrency where the SLO holds, smallest where it breaks or None) by doubling, then
    bisection; `evaluate(c)` returns whether it holds at c. 0 when it fails even alone."""
    if not evaluate(1):
        return 0, 1
    good, c = 1, 2
    while c <= upper and evaluate(c):
        good, c = c, c * 2
    if c > upper:
        if good == upper or evaluate(upper):
            return upper, None
        c = upper
    bad = c
    while bad - good > 1:
        mid = (good + bad) // 2
        if evaluate(mid):
            good = mid
        else:
            bad = mid
    return good, bad

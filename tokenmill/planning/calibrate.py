"""`tokenmill calibrate`: fit the step cost model to real steps on this machine.

1. Runner steps of designed shapes (decodes at several batch sizes and contexts, prefill chunks with
   and without context, several sequences, mixes, greedy or not), each executed by the real model
   runner on the real KV cache (the cached context is zeros: attention reads it all the same). A
   quarter of the shapes is held out, the model fitted on the rest, and its error on them reported;
   the saved model is then fitted on all.
2. A short real workload through the whole engine: its steps' time beyond the runner (scheduling,
   output processing, detokenizing) is fitted per step and per sequence, and the full model's error
   on these real steps is reported too.
"""

from __future__ import annotations

import logging
import random
import statistics
import time
from dataclasses import dataclass, field

from tokenmill.errors import ConfigError
from tokenmill.planning.cost_model import StepCostModel, nnls
from tokenmill.planning.step_shape import StepShape

logger = logging.getLogger(__name__)

MAX_KV_TOKENS = 65536  # context the designed steps hold at once (bounds the cache calibration allocates)
MAX_CONTEXT = 4096


@dataclass
class ShapeSpec:
    """A step to build: decodes (their context after the step), then chunks (query, cached before,
    whether the chunk reaches its sequence's end and samples)."""

    decodes: list[int] = field(default_factory=list)
    chunks: list[tuple[int, int, bool]] = field(default_factory=list)
    greedy: bool = False

    def shape(self) -> StepShape:
        q = [1] * len(self.decodes) + [c[0] for c in self.chunks]
        ctx = list(self.decodes) + [c[0] + c[1] for c in self.chunks]
        sampled = [True] * len(self.decodes) + [c[2] for c in self.chunks]
        return StepShape.build(q, ctx, sampled, self.greedy and any(sampled))

    @property
    def kv_tokens(self) -> int:
        return sum(self.decodes) + sum(q + before for q, before, _ in self.chunks)


def _prefill(tokens: int, max_context: int, samples: bool = True) -> list[tuple[int, int, bool]]:
    """`tokens` of prefill from scratch, in as few equal chunks as max_context allows."""
    n = -(-tokens // max_context)
    return [(tokens // n, 0, samples)] * n


def design_shapes(max_tokens: int, max_seqs: int, max_context: int, max_kv_tokens: int = MAX_KV_TOKENS
                  ) -> list[ShapeSpec]:
    """Shapes covering what the scheduler builds, in an order where a truncated run still covers
    every term (categories interleaved)."""
    pow2 = [1 << i for i in range(1, 16) if (1 << i) <= max_tokens]
    if pow2[-1] != max_tokens:
        pow2.append(max_tokens)
    ctxs = [c for c in (64, 512, 2048) if c <= max_context] or [max_context]
    seqs = [1 << i for i in range(0, 12) if (1 << i) <= max_seqs]
    cats = [
        [ShapeSpec(chunks=_prefill(q, max_context)) for q in pow2],
        [ShapeSpec(decodes=[c] * d) for c in ctxs for d in seqs],
        [ShapeSpec(chunks=_prefill(q, max_context - 1, False)) for q in sorted({16, 256, max_tokens})],
        [ShapeSpec(chunks=[(16, 0, s)] * k) for k in (4, 16, 64) if 16 * k <= max_tokens and k <= max_seqs
         for s in (True, False)],
        [ShapeSpec(chunks=[(q, before, True)]) for q in (32, 256, 1024) for before in (512, 2048)
         if q <= max_tokens and q + before <= max_context],
        [ShapeSpec(decodes=[min(256, max_context)] * d, greedy=True) for d in (1, 16, 64) if d <= max_seqs],
        [ShapeSpec(decodes=[min(512, max_context - q)] * d, chunks=[(q, 0, True)]) for d in (8, 64)
         for q in (256, 1024) if d <= max_seqs and q + d <= max_tokens and q < max_context],
    ]
    out, i = [], 0
    while any(cats):
        cat = cats[i % len(cats)]
        if cat:
            spec = cat.pop(0)
            if spec.kv_tokens <= max_kv_tokens and spec.shape().num_tokens <= max_tokens:
                out.append(spec)
        i += 1
    return out


def held_out_split(shapes: list[StepShape], seed: int = 0) -> set[int]:
    """A quarter of the shapes, at random, but never one of the last two measurements between two
    knots of the GEMM curve (without them the fit cannot know the curve there)."""
    import bisect

    from tokenmill.planning.cost_model import KNOTS

    segment = [bisect.bisect_right(KNOTS, s.num_tokens) for s in shapes]
    left = {k: segment.count(k) for k in set(segment)}
    idx = list(range(len(shapes)))
    random.Random(seed).shuffle(idx)
    held: set[int] = set()
    for i in idx:
        if len(held) >= len(shapes) // 4:
            break
        if left[segment[i]] > 2:
            held.add(i)
            left[segment[i]] -= 1
    return held


def errors_pct(model: StepCostModel, shapes: list[StepShape], seconds: list[float],
               runner_only: bool = True) -> list[float]:
    predict = model.runner_time if runner_only else model.step_time
    return [100 * (predict(s) - t) / t for s, t in zip(shapes, seconds)]


def summarize_errors(errs: list[float]) -> dict:
    a = [abs(e) for e in errs]
    return {"median": statistics.median(a), "mean": statistics.fmean(a), "max": max(a), "count": len(a)} if a else {}


class StepDriver:
    """Runs designed steps through the engine core's executor, on every rank (the engine idle)."""

    def __init__(self, engine):
        self.core = engine.core
        self.block_size = engine.config.cache.block_size
        self.num_blocks = engine.core.kv.num_blocks
        self.vocab = engine.model_config.vocab_size
        self.rng = random.Random(0)

    def build(self, spec: ShapeSpec):
        """The step as the scheduler would send it: every sequence new to the runner, its cached
        context already "computed" (the blocks hold zeros), distinct blocks per sequence."""
        from tokenmill.core.messages import CoreSamplingParams
        from tokenmill.core.scheduler_output import NewRequestData, SchedulerOutput

        params = CoreSamplingParams(temperature=0.0 if spec.greedy else 1.0, ignore_eos=True)
        items = [(c, c - 1, 1) for c in spec.decodes]
        items += [(before + q + (0 if samples else 1), before, q) for q, before, samples in spec.chunks]
        new, num_tokens, block = [], {}, 0
        for i, (total, computed, n) in enumerate(items):
            n_blocks = -(-total // self.block_size)
            prompt = [self.rng.randrange(self.vocab) for _ in range(total)]
            new.append(NewRequestData(f"cal-{i}", prompt, params, [], list(range(block, block + n_blocks)), computed))
            num_tokens[f"cal-{i}"] = n
            block += n_blocks
        assert block <= self.num_blocks, "calibration shape does not fit the KV cache"
        return SchedulerOutput(new, [], num_tokens, sum(num_tokens.values()))

    def time(self, spec: ShapeSpec, reps: int) -> float:
        """Median of `reps` runs after a warm-up (oneDNN picks and caches kernels per shape); a long
        step (> 0.5 s, where a warm-up is noise) is the faster of two runs."""
        sched = self.build(spec)
        (first,) = self.core.time_step(sched, 1)
        if first > 0.5:
            return min(first, *self.core.time_step(sched, 1))
        return statistics.median(self.core.time_step(sched, reps))


def engine_overhead_run(engine, num_requests: int = 16, output_len: int = 24, seed: int = 0):
    """A real mixed workload through LLMEngine.step(): per step its shape, the executor's time (as
    the core recorded it) and the whole step's time."""
    from tokenmill.sampling_params import SamplingParams

    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    for i in range(num_requests):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(16, 256))]
        engine.add_request(f"overhead-{i}", prompt, SamplingParams(temperature=1.0, max_tokens=output_len,
                                                                   ignore_eos=True, seed=i))
    rows = []
    engine.core.record_step_times(True)
    try:
        while engine.has_unfinished_requests():
            t = time.perf_counter()
            engine.step()
            total = time.perf_counter() - t
            for shape, runner in engine.core.record_step_times(True):
                if shape.num_seqs:
                    rows.append((shape, runner, total))
    finally:
        engine.core.record_step_times(False)
    return rows


def fit_overhead(rows) -> tuple[float, float]:
    """(per step, per sequence) seconds beyond the runner, by non-negative least squares."""
    import numpy as np

    A = np.array([[1.0, s.num_seqs] for s, _, _ in rows])
    b = np.array([total - runner for _, runner, total in rows])
    step, seq = nnls(A, b)
    return float(step), float(seq)


def calibration_config(config):
    """The engine to calibrate with: the user's, with a KV cache sized for the designed steps."""
    import dataclasses

    from tokenmill.model.loader import load_model_config, resolve_model

    mc = load_model_config(resolve_model(config.model.model))
    max_len = min(MAX_CONTEXT, mc.max_position_embeddings, config.model.max_model_len or MAX_CONTEXT)
    model = dataclasses.replace(config.model, max_model_len=max_len)
    kv_bytes = mc.kv_bytes_per_token * 4  # enough for fp32; smaller dtypes get more room
    cache = dataclasses.replace(config.cache, kv_cache_memory=(MAX_KV_TOKENS + 4 * max_len) * kv_bytes,
                                memory_utilization=None, enable_prefix_caching=False)
    return dataclasses.replace(config, model=model, cache=cache), max_len


def calibrate(config, max_seconds: float = 80.0, reps: int = 3, progress=None, serving_run: bool = True):
    """Measure, fit and return a Profile (not yet saved). `progress(what)` is called as it goes."""
    from tokenmill.engine.llm_engine import LLMEngine
    from tokenmill.planning.machine import machine_of, measure
    from tokenmill.planning.model_spec import model_spec
    from tokenmill.planning.profile import Profile

    if config.parallel.data_parallel_size > 1:
        raise ConfigError("calibrate measures one replica: drop --data-parallel-size (every replica runs the same "
                          "steps; estimate and simulate plan one replica)")
    progress = progress or (lambda what: None)
    t0 = time.perf_counter()
    run_config, max_len = calibration_config(config)
    spec = model_spec(config)
    engine = LLMEngine(run_config, progress=False, multiprocess=False)
    load_s = time.perf_counter() - t0
    measurements = measure(dtypes=(spec.dtype,))
    sched = config.scheduler
    specs = design_shapes(sched.max_num_batched_tokens, sched.max_num_seqs, max_len)
    driver = StepDriver(engine)
    shapes, seconds, t_measure = [], [], time.perf_counter()
    try:
        for i, s in enumerate(specs):
            if time.perf_counter() - t_measure > max_seconds:
                logger.warning("calibration budget of %.0fs reached after %d of %d shapes", max_seconds, i, len(specs))
                break
            progress(f"step shape {i + 1} of {len(specs)}")
            shapes.append(s.shape())
            seconds.append(driver.time(s, reps))
        # a step slowed by something else on the machine is measured again (the faster time counts)
        model = StepCostModel.fit(shapes, seconds)
        t_retry = time.perf_counter()
        for i, err in enumerate(errors_pct(model, shapes, seconds)):
            if abs(err) > 15 and i < len(specs) and time.perf_counter() - t_retry < max_seconds / 6:
                seconds[i] = min(seconds[i], driver.time(specs[i], reps))
        progress("a real workload through the engine")
        rows = engine_overhead_run(engine)
    finally:
        engine.shutdown()
    held = held_out_split(shapes)
    train = [i for i in range(len(shapes)) if i not in held]
    partial = StepCostModel.fit([shapes[i] for i in train], [seconds[i] for i in train])
    held_errs = errors_pct(partial, [shapes[i] for i in held], [seconds[i] for i in held])
    model = StepCostModel.fit(shapes, seconds)
    model.step_overhead, model.seq_overhead = fit_overhead(rows)
    engine_errs = errors_pct(model, [r[0] for r in rows], [r[2] for r in rows], runner_only=False)
    machine = machine_of(config)
    streaming = None
    if serving_run:
        from tokenmill.planning.stream_overhead import measure_stream_overhead

        progress("streaming through a real server on loopback")
        streaming = measure_stream_overhead(config)
        # it competes with the model's threads only when they hold every core
        if machine["num_threads"] >= machine["cores"]:
            model.stream_overhead = streaming["front_end_s_per_token"] + streaming["client_s_per_token"]
    points = [{"shape": s.to_dict(), "measured_ms": 1000 * t, "predicted_ms": 1000 * model.runner_time(s),
               "held_out": i in held} for i, (s, t) in enumerate(zip(shapes, seconds))]
    calibration = {
        "shapes": len(shapes), "held_out": len(held), "reps": reps,
        "held_out_error_pct": summarize_errors(held_errs),
        "engine_steps": len(rows), "engine_step_error_pct": summarize_errors(engine_errs),
        "engine_step_ms_mean": 1000 * statistics.fmean(r[2] for r in rows) if rows else None,
        "streaming": streaming, "load_s": load_s, "duration_s": time.perf_counter() - t0, "points": points,
    }
    return Profile(machine=machine, model=spec.fingerprint(), cost_model=model, measurements=measurements,
                   calibration=calibration)

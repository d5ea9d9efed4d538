"""The simulator (the real scheduler in virtual time) against the real engine, its open and closed
loops, priorities, and the traces it runs."""

from __future__ import annotations

import dataclasses
import random

import pytest

from tokenmill import EngineConfig, SamplingParams
from tokenmill.errors import ConfigError
from tokenmill.planning.cost_model import StepCostModel
from tokenmill.planning.simulator import SimSettings, Simulation
from tokenmill.planning.step_shape import StepShape, shape_of
from tokenmill.planning.workload import synthetic_trace, with_arrivals

from .test_planning import TRUE_MODEL


class Recording(StepCostModel):
    """A cost model that remembers the shape of every step it timed."""

    def __init__(self):
        super().__init__(**TRUE_MODEL.to_dict())
        self.shapes: list[StepShape] = []

    def step_time(self, s: StepShape) -> float:
        self.shapes.append(s)
        return super().step_time(s)


def test_simulator_makes_the_engines_scheduling_decisions(tiny_llama_dir):
    """Same trace, same settings: the real engine's steps and the simulator's have the same shapes,
    step by step, through chunked prefill, prefix-cache hits and preemptions."""
    from tokenmill.engine.llm_engine import LLMEngine

    bytes_per_token = 2 * 3 * 2 * 64 * 4
    engine = LLMEngine(EngineConfig.from_kwargs(
        model=str(tiny_llama_dir), dtype="float32", kv_cache_memory=30 * 16 * bytes_per_token, max_model_len=256,
        max_num_batched_tokens=64, max_num_seqs=8), progress=False)
    trace = synthetic_trace(12, 40, 30, range_ratio=0.5, shared_prefix_len=20, vocab_size=49152, seed=3)
    for i, r in enumerate(trace):
        engine.add_request(str(i), r.prompt_token_ids, SamplingParams(temperature=0, max_tokens=r.output_len,
                                                                      ignore_eos=True))
    real, schedule = [], engine.core.scheduler.schedule

    def capture():
        out = schedule()
        real.append(shape_of(out, engine.core.scheduler.requests))
        return out

    engine.core.scheduler.schedule = capture
    while engine.has_unfinished_requests():
        engine.step()
    cost = Recording()
    settings = SimSettings(engine.core.kv.num_blocks, 16, 64, 8, True, 256)
    result = Simulation(cost, settings, temperature=0).run(with_arrivals(trace, float("inf")))
    assert engine.core.scheduler.num_preemptions > 0 and engine.core.kv.prefix_hits > 0
    assert cost.shapes == [s for s in real if s.num_seqs]
    assert result.num_preemptions == engine.core.scheduler.num_preemptions
    assert [r.output_tokens for r in result.records] == [r.output_len for r in trace]


def test_closed_loop_keeps_concurrency_and_times_add_up():
    cost = Recording()
    trace = synthetic_trace(40, 64, 16, vocab_size=1000, seed=1)
    result = Simulation(cost, SimSettings(num_blocks=1000), temperature=1.0).run(trace, concurrency=4)
    assert max(s.num_seqs for s in cost.shapes) == 4
    assert result.busy == pytest.approx(sum(TRUE_MODEL.step_time(s) for s in cost.shapes))
    assert result.duration == pytest.approx(result.busy)  # a closed loop never idles
    for r in result.records:
        assert r.output_tokens == 16 and len(r.chunk_times) == 16
        assert r.sent_at < r.first_token_at <= r.end_at
    summary = result.summary({"ttft": 1.0})
    assert summary["completed"] == 40 and summary["total_output_tokens"] == 640


def test_open_loop_idles_between_arrivals_and_runs_minutes_of_traffic():
    trace = with_arrivals(synthetic_trace(600, 128, 64, vocab_size=1000), rate=1.0, seed=2)
    result = Simulation(TRUE_MODEL, SimSettings(num_blocks=4000)).run(trace)
    assert result.summary()["completed"] == 600
    assert result.duration > trace[-1].arrival > 500
    assert result.busy < result.duration


def test_workload_jsonl(tmp_path, tiny_llama_dir):
    from tokenmill.model.loader import load_tokenizer, resolve_model
    from tokenmill.planning.workload import jsonl_trace

    tok = load_tokenizer(resolve_model(str(tiny_llama_dir)))
    path = tmp_path / "trace.jsonl"
    path.write_text('{"prompt": "hello there", "output_len": 5, "timestamp": 100.5}\n'
                    '{"prompt_len": 30, "timestamp": 100.0, "priority": 2}\n')
    trace = jsonl_trace(str(path), tok, 7)
    assert [r.arrival for r in trace] == [0.0, 0.5] and [r.output_len for r in trace] == [7, 5]
    assert len(trace[0].prompt_token_ids) == 30 and trace[0].priority == 2
    assert trace[1].prompt_token_ids == tok.encode("hello there", add_special_tokens=False)
    path.write_text('{"prompt_len": 3, "timestamp": 1}\n{"prompt_len": 3}\n')
    with pytest.raises(ConfigError, match="every line has a timestamp or none"):
        jsonl_trace(str(path), tok, 7)
    path.write_text('{"text": "x"}\n')
    with pytest.raises(ConfigError, match="trace.jsonl:1"):
        jsonl_trace(str(path), tok, 7)


def test_simulated_priorities_serve_the_better_class_first():
    """The simulator runs the real scheduler's priority policy: under overload, priority-0 requests
    wait less than priority-5 ones of the same trace; fcfs treats them alike."""
    rng = random.Random(0)
    trace = with_arrivals(synthetic_trace(200, 128, 32, 0.0, 0, 1000, seed=1), 40.0, 1.0, seed=1)
    trace = [dataclasses.replace(r, priority=5 * rng.randint(0, 1)) for r in trace]

    def mean_ttft(policy):
        settings = SimSettings(num_blocks=4096, max_num_seqs=8, scheduling_policy=policy, priority_aging=0)
        res = Simulation(TRUE_MODEL, settings).run(trace)
        by = {0: [], 5: []}
        for rec, r in zip(res.records, trace):
            by[r.priority].append(rec.first_token_at - rec.sent_at)
        return {p: sum(v) / len(v) for p, v in by.items()}

    prio, fcfs = mean_ttft("priority"), mean_ttft("fcfs")
    assert prio[0] < 0.5 * prio[5]
    assert 0.7 < fcfs[0] / fcfs[5] < 1.3

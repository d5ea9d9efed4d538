"""The step cost model, its fit and profiles, and the planner's memory arithmetic (the simulator:
test_planning_simulator.py)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import random

import numpy as np
import pytest

from tokenmill import EngineConfig
from tokenmill.errors import ConfigError
from tokenmill.planning.calibrate import design_shapes
from tokenmill.planning.cost_model import StepCostModel, nnls
from tokenmill.planning.machine import MachineMeasurements, machine_fingerprint
from tokenmill.planning.model_spec import model_spec
from tokenmill.planning.profile import Profile, choose_cost_model, default_profile_path
from tokenmill.planning.roofline import roofline_model
from tokenmill.planning.step_shape import StepShape

TRUE_MODEL = StepCostModel(gemm=[10e-3, 10.1e-3, 10.2e-3, 10.5e-3, 11e-3, 12e-3, 14e-3, 20e-3, 35e-3, 65e-3, 125e-3,
                                 245e-3, 485e-3], per_seq=30e-6, per_decode_context=1.2e-6, per_prefill_pair=2e-9,
                           per_prefill_context=0.5e-6, per_sampled=60e-6, per_sampled_greedy=15e-6)


def test_nnls_satisfies_the_optimality_conditions():
    rng = np.random.default_rng(0)
    for _ in range(20):
        A, b = rng.normal(size=(40, 9)), rng.normal(size=40)
        x = nnls(A, b)
        grad = A.T @ (b - A @ x)
        assert (x >= 0).all()
        assert np.allclose(grad[x > 0], 0, atol=1e-8) and (grad[x == 0] <= 1e-8).all()


def test_step_shape_counts_attention_work():
    # two decodes (contexts 10 and 20), a fresh 4-token chunk, a 3-token chunk after 5 cached tokens
    s = StepShape.build([1, 1, 4, 3], [10, 20, 4, 8], [True, True, True, False])
    assert (s.num_seqs, s.num_decodes, s.prefill_tokens, s.num_tokens) == (4, 2, 7, 9)
    assert s.decode_context == 30 and s.prefill_context == 5 and s.num_sampled == 3
    assert s.prefill_pairs == (4 * 5 // 2) + (3 * 5 + 3 * 4 // 2)


def test_fit_recovers_a_known_cost_model_from_the_designed_shapes():
    shapes = [spec.shape() for spec in design_shapes(2048, 128, 4096)]
    fitted = StepCostModel.fit(shapes, [TRUE_MODEL.step_time(s) for s in shapes])
    rng = random.Random(0)
    for _ in range(200):  # shapes the design never had
        d, q = rng.randint(0, 100), rng.choice([0, 0, rng.randint(2, 1500)])
        s = StepShape.build([1] * d + ([q] if q else []), [rng.randint(2, 3000) for _ in range(d)] + ([q + 100] if q
                            else []), [True] * (d + (1 if q else 0)), greedy=rng.random() < 0.2)
        if s.num_seqs:
            assert fitted.step_time(s) == pytest.approx(TRUE_MODEL.step_time(s), rel=0.02)


def test_roofline_is_monotone_and_memory_bound_at_one_token(tiny_llama_dir):
    spec = model_spec(EngineConfig.from_kwargs(model=str(tiny_llama_dir), dtype="float32"))
    m = roofline_model(spec, MachineMeasurements(20e9, {"float32": 1e12}))
    times = [m.gemm_time(t) for t in (1, 2, 8, 64, 512, 4096)]
    assert times == sorted(times)
    assert m.gemm_time(1) == pytest.approx(m.gemm_time(2), rel=0.01)  # weights streamed once either way
    decode = [m.step_time(StepShape.build([1] * 8, [c] * 8, [True] * 8)) for c in (100, 1000)]
    assert decode[1] - decode[0] == pytest.approx(8 * 900 * spec.kv_bytes_per_token / 20e9)


@pytest.mark.parametrize("dtype,extra", [("float32", {}), ("bfloat16", {}),
                                         ("bfloat16", {"quantization": "int8", "kv_cache_dtype": "int8"}),
                                         ("float32", {"quantization": "int4", "quant_group_size": 32}),
                                         ("bfloat16", {"quantization": "int8", "kv_cache_dtype": "fp8_e4m3"})])
def test_planner_memory_matches_the_engine(tiny_qwen2_dir, dtype, extra):
    """Weight bytes, KV bytes per token and blocks: what estimate computes without loading weights
    is what the engine allocates, also with quantized weights and a quantized KV cache."""
    from tokenmill.engine.llm_engine import LLMEngine
    from tokenmill.planning.estimate import plan_memory

    config = EngineConfig.from_kwargs(model=str(tiny_qwen2_dir), dtype=dtype, kv_cache_memory="24MiB",
                                      max_model_len=512, **extra)
    spec = model_spec(config)
    plan = plan_memory(config, spec)
    engine = LLMEngine(config, progress=False)
    worker = engine.core.worker
    assert spec.weight_bytes == worker.weight_bytes
    assert spec.kv_bytes_per_token == worker.kv_bytes_per_token
    assert plan.kv.num_blocks == worker.num_blocks
    assert plan.to_dict()["max_concurrency"] == worker.num_blocks // (512 // 16)


def test_planner_errors(tiny_llama_dir):
    from tokenmill.planning.estimate import plan_memory

    with pytest.raises(ConfigError, match="not found"):
        model_spec(EngineConfig.from_kwargs(model="/no/such/model"))
    config = EngineConfig.from_kwargs(model=str(tiny_llama_dir), dtype="float32", max_model_len=1024)
    spec = model_spec(config)
    with pytest.raises(ConfigError, match="impossible memory budget.*weights"):
        plan_memory(config, spec, memory_budget=spec.weight_bytes // 2)
    with pytest.raises(ConfigError, match="holds .* tokens, fewer than max_model_len=1024"):
        plan_memory(config, spec, memory_budget=spec.weight_bytes + 1000 * spec.kv_bytes_per_token)
    with pytest.raises(ConfigError, match="exceed this machine"):
        plan_memory(config, spec, memory_budget=2**50)


def _profile(spec, threads: int) -> Profile:
    return Profile(machine=machine_fingerprint("cpu", threads), model=spec.fingerprint(), cost_model=TRUE_MODEL,
                   calibration={"held_out_error_pct": {"median": 1.0, "max": 2.0, "mean": 1.0, "count": 3}})


def test_profiles_are_tied_to_machine_and_model(tiny_llama_dir, tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
    spec = model_spec(EngineConfig.from_kwargs(model=str(tiny_llama_dir), dtype="float32"))
    path = default_profile_path(machine_fingerprint("cpu", 2), spec.fingerprint())
    _profile(spec, 2).save(path)
    choice = choose_cost_model(spec, machine_fingerprint("cpu", 2))  # found by fingerprint
    assert choice.model.to_dict() == TRUE_MODEL.to_dict() and not choice.warnings
    # another thread count is another configuration: not found, roofline
    with caplog.at_level(logging.WARNING):
        assert choose_cost_model(spec, machine_fingerprint("cpu", 1)).model.source == "roofline"
    assert "no calibration profile" in caplog.text
    # given explicitly, a profile of another machine or model is an error
    other = _profile(spec, 2)
    other.machine["cpu"] = "AMD EPYC 9999"
    other.save(tmp_path / "other-machine.json")
    with pytest.raises(ConfigError, match="machine cpu: profile 'AMD EPYC 9999'.*tokenmill calibrate"):
        choose_cost_model(spec, machine_fingerprint("cpu", 2), str(tmp_path / "other-machine.json"))
    fp32 = _profile(spec, 2)
    fp32.model["dtype"] = "bfloat16"
    fp32.save(tmp_path / "other-model.json")
    with pytest.raises(ConfigError, match="model dtype"):
        choose_cost_model(spec, machine_fingerprint("cpu", 2), str(tmp_path / "other-model.json"))
    (tmp_path / "junk.json").write_text("{}")
    with pytest.raises(ConfigError, match="not a tokenmill calibration profile"):
        choose_cost_model(spec, machine_fingerprint("cpu", 2), str(tmp_path / "junk.json"))
    # a stale one (older tokenmill, or months old) warns and falls back to the roofline
    stale = json.loads(path.read_text())
    stale["tokenmill_version"] = "0.0.1"
    path.write_text(json.dumps(stale))
    choice = choose_cost_model(spec, machine_fingerprint("cpu", 2))
    assert choice.model.source == "roofline" and "stale" in choice.warnings[0]
    old = _profile(spec, 2)
    old.created = "2020-01-01T00:00:00+00:00"
    old.save(path)
    assert "days old" in choose_cost_model(spec, machine_fingerprint("cpu", 2)).warnings[0]


def test_a_machine_measured_while_busy_is_not_cached(tmp_path, monkeypatch, caplog):
    """Another process spinning on a core during the measurement: the figures are used, not kept
    (kept, a figure measured beside a model's load halved the FLOP/s for good)."""
    import subprocess
    import sys

    from tokenmill.planning.machine import machine_measurements

    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
    spin = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        with caplog.at_level(logging.WARNING):
            m = machine_measurements(machine_fingerprint("cpu", 2))
    finally:
        spin.kill()
        spin.wait()
    assert m.bandwidth > 0 and m.flops["float32"] > 0
    assert "not caching them" in caplog.text and not list(tmp_path.glob("profiles/machine-*.json"))
    # a file written before that check (no format) may hold such figures: it is measured again
    from tokenmill.planning.machine import _FORMAT

    fingerprint = machine_fingerprint("cpu", 2)
    key = hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:16]
    old = tmp_path / "profiles" / f"machine-{key}.json"
    old.parent.mkdir(parents=True)
    old.write_text(json.dumps({"bandwidth": 1.0, "flops": {"float32": 1.0}, "machine": fingerprint}))
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        m = machine_measurements(fingerprint)
    assert m.flops["float32"] > 1.0
    if "not caching them" not in caplog.text:  # rewritten, unless something ran meanwhile
        assert json.loads(old.read_text())["format"] == _FORMAT


def test_serve_checks_its_profile_before_loading_the_model(tiny_llama_dir, tmp_path, monkeypatch, caplog):
    """`serve --slo` picks its cost model when the server is built, before the weights load: a
    profile of another machine stops it at once, a stale one warns and falls back to the roofline."""
    import socket
    import subprocess
    import sys

    from tokenmill.config import ServerConfig
    from tokenmill.entrypoints.openai.api_server import ServerState

    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path))
    config = EngineConfig.from_kwargs(model=str(tiny_llama_dir), dtype="float32", num_threads=2)
    spec = model_spec(config)
    other = _profile(spec, 2)
    other.machine["cpu"] = "AMD EPYC 9999"
    other.save(tmp_path / "other.json")
    with pytest.raises(ConfigError, match="AMD EPYC 9999.*tokenmill calibrate"):
        ServerState(config, ServerConfig(slo="ttft=1s", profile=str(tmp_path / "other.json")))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    r = subprocess.run([sys.executable, "-m", "tokenmill.entrypoints.cli.main", "serve", str(tiny_llama_dir),
                        "--dtype", "float32", "--num-threads", "2", "--port", str(port), "--slo", "ttft=1s",
                        "--profile", str(tmp_path / "other.json")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "AMD EPYC 9999" in r.stderr, r.stderr
    assert "loaded" not in r.stderr and "engine ready" not in r.stderr  # refused before the weights load
    stale = _profile(spec, 2)
    stale.torch_version = "1.0"
    stale.save(tmp_path / "stale.json")
    with caplog.at_level(logging.WARNING):
        state = ServerState(config, ServerConfig(slo="ttft=1s", profile=str(tmp_path / "stale.json")))
    # the roofline is measured once the model has loaded (not beside the core process's load)
    assert state.engine is None and state.slo_cost.model is None and "roofline" in state.slo_cost.description
    assert "stale" in state.slo_cost.warnings[0] and "falling back to the roofline" in caplog.text


def test_admission_never_refuses_on_an_idle_engine():
    """A request whose idle prediction lies between the margin (90%) and its bound is admitted on an
    idle engine (refused, no retry could ever pass); under load, one that waiting can help is refused."""
    from tokenmill.core.messages import SchedulerLoad
    from tokenmill.planning.admission import SLOAdmission

    probe = SLOAdmission(TRUE_MODEL, {"ttft": 1.0}, 512, 16)
    idle_ttft = probe.predict(SchedulerLoad(), 400, 8, 0.0).ttft
    for bound in (idle_ttft / 0.95, idle_ttft / 0.5):  # above the margin, then well within it
        gate = SLOAdmission(TRUE_MODEL, {"ttft": bound}, 512, 16)
        assert gate.predict(SchedulerLoad(), 400, 8, 0.0).admit
    busy = SchedulerLoad(num_running=1, num_waiting=8, running_prefill_tokens=400, waiting_prompt_tokens=3200)
    assert not gate.predict(busy, 400, 8, 0.0).admit  # 9 prompts ahead: waiting helps
    near = SLOAdmission(TRUE_MODEL, {"ttft": idle_ttft / 0.95}, 512, 16)
    assert near.predict(busy, 400, 8, 0.0).admit  # never admissible: waiting cannot help


def test_slo_messages_say_what_each_command_accepts():
    from tokenmill.bench.serve_metrics import parse_slo
    from tokenmill.planning.admission import parse_admission_slo

    with pytest.raises(ValueError, match="NAME one of ttft, tpot, itl, e2e"):
        parse_slo("latency=1s")  # bench serve, estimate, simulate: all four
    assert parse_admission_slo("ttft=1s, tpot=100") == {"ttft": 1.0, "tpot": 0.1}
    for bad in ("itl=50ms", "e2e=2s", "ttft=fast"):
        with pytest.raises(ConfigError, match="NAME ttft and/or tpot") as e:
            parse_admission_slo(bad)
        assert "itl," not in str(e.value) and "e2e," not in str(e.value)
    with pytest.raises(ConfigError, match="ttft and/or tpot"):
        parse_admission_slo("")


def test_profile_round_trip(tmp_path, tiny_llama_dir):
    spec = model_spec(EngineConfig.from_kwargs(model=str(tiny_llama_dir), dtype="float32"))
    p = _profile(spec, 2)
    p.save(tmp_path / "p.json")
    from tokenmill.planning.profile import load_profile

    q = load_profile(tmp_path / "p.json")
    assert dataclasses.asdict(q.cost_model) == dataclasses.asdict(p.cost_model) and q.machine == p.machine

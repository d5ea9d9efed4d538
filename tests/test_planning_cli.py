"""`tokenmill calibrate`, `estimate` and `simulate` from the command line, on a tiny model, with a
private cache (profiles and machine measurements land there)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.server_utils import private_cache

pytestmark = pytest.mark.slow

ENGINE = ["--dtype", "float32", "--max-num-batched-tokens", "256", "--max-num-seqs", "16", "--max-model-len", "512"]


def _cli(cache, *args, check=True):
    if not (cache / "kernels").exists():  # profiles and machine measurements are private, kernels shared
        private_cache(cache)
    env = {**os.environ, "TOKENMILL_CACHE_DIR": str(cache)}
    r = subprocess.run([sys.executable, "-m", "tokenmill.entrypoints.cli.main", *args], capture_output=True,
                       text=True, timeout=600, env=env)
    if check:
        assert r.returncode == 0, r.stderr
    return r


@pytest.fixture(scope="module")
def calibrated(tiny_llama_dir, tmp_path_factory):
    """A real calibration of the tiny model (short budget), saved where estimate looks for it."""
    cache = tmp_path_factory.mktemp("cache")
    r = _cli(cache, "calibrate", str(tiny_llama_dir), *ENGINE, "--max-seconds", "20", "--reps", "2")
    assert "held-out shapes" in r.stdout and "profile:" in r.stdout
    (path,) = (cache / "profiles").glob("tiny-llama*-float32-*.json")
    return cache, path


def test_calibrate_writes_a_profile_of_this_machine_and_model(calibrated):
    _, path = calibrated
    p = json.loads(path.read_text())
    assert p["model"]["dtype"] == "float32" and p["model"]["architecture"] == "LlamaForCausalLM"
    assert p["machine"]["num_threads"] == int(os.environ.get("OMP_NUM_THREADS", os.cpu_count()))
    cal = p["calibration"]
    assert cal["shapes"] >= 12 and cal["held_out"] >= 3 and cal["engine_steps"] > 5
    assert cal["held_out_error_pct"]["count"] == cal["held_out"]
    measured = [pt["measured_ms"] for pt in cal["points"]]
    assert all(m > 0 for m in measured)
    gemm = p["cost_model"]["gemm"]
    assert gemm == sorted(gemm) and gemm[0] > 0  # G never decreases with the batch
    # the streaming run through a real server: its CPU per token is charged when the model holds every core
    st = cal["streaming"]
    assert st["front_end_s_per_token"] > 0 and st["client_s_per_token"] >= 0 and st["output_tokens"] >= 24 * 64
    holds_every_core = p["machine"]["num_threads"] >= p["machine"]["cores"]
    expected = st["front_end_s_per_token"] + st["client_s_per_token"] if holds_every_core else 0.0
    assert p["cost_model"]["stream_overhead"] == pytest.approx(expected)


def test_estimate_json_from_the_profile(calibrated, tiny_llama_dir):
    cache, path = calibrated
    r = _cli(cache, "estimate", str(tiny_llama_dir), *ENGINE, "--kv-cache-memory", "16MiB", "--json",
             "--concurrency", "1,4,16", "--input-len", "64", "--output-len", "16", "--slo", "ttft=10s,tpot=1s",
             "--price-per-hour", "2.0")
    out = json.loads(r.stdout)
    assert out["cost_model"]["source"] == "calibrated" and str(path) in out["cost_model"]["description"]
    mem = out["memory"]
    assert mem["kv_bytes_per_token"] == 2 * 3 * 2 * 64 * 4 and mem["num_blocks"] == 16 * 2**20 // (16 * 3072)
    assert mem["max_concurrency"] == mem["num_blocks"] // (80 // 16)
    points = out["points"]
    assert [p["concurrency"] for p in points] == [1, 4, 16]
    for p in points:
        assert {"concurrency", "output_tok_per_s", "ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99"} <= set(p)
        assert p["usd_per_1m_output_tokens"] == pytest.approx(2.0 / (p["output_tok_per_s"] * 3600) * 1e6)
    # batching: more users, more throughput, slower tokens
    assert points[2]["output_tok_per_s"] > points[0]["output_tok_per_s"]
    assert points[2]["tpot_ms_p50"] >= points[0]["tpot_ms_p50"]
    slo = out["slo"]
    assert slo["max_concurrency"] >= 1 and (slo["breaks_at"] is None or slo["breaks_at"] == slo["max_concurrency"] + 1
                                           or slo["breaks_at"] > slo["max_concurrency"])
    r = _cli(cache, "estimate", str(tiny_llama_dir), *ENGINE, "--kv-cache-memory", "16MiB", "--concurrency", "2",
             "--slo", "ttft=10s", "--price-per-hour", "1")
    assert "max concurrency" in r.stdout and "$/1M out tok" in r.stdout and "SLO ttft<=10000ms" in r.stdout


def test_estimate_bad_inputs(calibrated, tiny_llama_dir, tmp_path):
    cache, path = calibrated
    r = _cli(cache, "estimate", "--model", "/no/such/model", check=False)
    assert r.returncode == 1 and "not found" in r.stderr
    r = _cli(cache, "estimate", str(tiny_llama_dir), *ENGINE, "--memory-budget", "1MiB", check=False)
    assert r.returncode == 1 and "impossible memory budget" in r.stderr
    other = json.loads(path.read_text())
    other["machine"]["cpu"] = "Some Other CPU"
    (tmp_path / "other.json").write_text(json.dumps(other))
    r = _cli(cache, "estimate", str(tiny_llama_dir), *ENGINE, "--profile", str(tmp_path / "other.json"), check=False)
    assert r.returncode == 1 and "Some Other CPU" in r.stderr and "tokenmill calibrate" in r.stderr
    stale = json.loads(path.read_text())
    stale["torch_version"] = "1.0"
    (tmp_path / "stale.json").write_text(json.dumps(stale))
    r = _cli(cache, "estimate", str(tiny_llama_dir), *ENGINE, "--profile", str(tmp_path / "stale.json"), "--json",
             "--concurrency", "1")
    assert "stale" in r.stderr and json.loads(r.stdout)["cost_model"]["source"] == "roofline"


def test_simulate_compares_settings_and_finds_the_knee(calibrated, tiny_llama_dir):
    cache, _ = calibrated
    r = _cli(cache, "simulate", str(tiny_llama_dir), *ENGINE, "--kv-cache-memory", "16MiB", "--json",
             "--request-rate", "2,8", "--duration", "30", "--input-len", "32", "--shared-prefix-len", "256",
             "--output-len", "8", "--enable-prefix-caching", "on,off", "--slo", "ttft=2s,tpot=500ms")
    out = json.loads(r.stdout)
    on, off = out["results"]
    assert on["setting"]["enable_prefix_caching"] and not off["setting"]["enable_prefix_caching"]
    for res in (on, off):
        assert [run["load"]["value"] for run in res["runs"]] == [2.0, 8.0]
        assert res["runs"][0]["completed"] > 35  # ~2/s for 30 simulated seconds
        assert res["knee"]["mode"] == "request_rate" and res["knee"]["load"] > 0
    # the shared 256-token prefix is served from the cache: faster first tokens, a higher knee
    assert on["runs"][0]["ttft_ms"]["median"] < off["runs"][0]["ttft_ms"]["median"]
    assert on["knee"]["load"] > off["knee"]["load"]
    r = _cli(cache, "simulate", str(tiny_llama_dir), *ENGINE, "--concurrency", "1,4", "--num-prompts", "20",
             "--max-num-seqs", "2,16", "--slo", "ttft=5s", "--no-knee")
    assert "max_num_seqs=2" in r.stdout and "max_num_seqs=16" in r.stdout


def test_simulate_replays_a_timestamped_trace(calibrated, tiny_llama_dir, tmp_path):
    cache, _ = calibrated
    lines = [json.dumps({"prompt_len": 20 + i, "output_len": 4, "timestamp": 1000 + 0.5 * i}) for i in range(10)]
    (tmp_path / "trace.jsonl").write_text("\n".join(lines))
    r = _cli(cache, "simulate", str(tiny_llama_dir), *ENGINE, "--dataset", str(tmp_path / "trace.jsonl"), "--json")
    (res,) = json.loads(r.stdout)["results"]
    (run,) = res["runs"]
    assert run["load"]["mode"] == "replay" and run["completed"] == 10
    assert run["duration_s"] >= 4.5  # the last request arrives 4.5 s after the first


def test_calibrate_with_tensor_parallelism(tiny_llama_dir, tmp_path):
    """Two ranks in other processes: the designed steps and the engine's steps are timed through the
    core's executor (plain data), and the profile is tied to that rank layout."""
    cache = tmp_path / "cache"
    out = tmp_path / "tp2.json"
    r = _cli(cache, "calibrate", str(tiny_llama_dir), *ENGINE, "--tensor-parallel-size", "2", "--max-seconds", "8",
             "--reps", "1", "--no-serving-run", "--output", str(out))
    assert "held-out shapes" in r.stdout
    p = json.loads(out.read_text())
    assert p["machine"]["ranks"] == "tp2-pp1" and p["calibration"]["engine_steps"] > 5
    assert all(pt["measured_ms"] > 0 for pt in p["calibration"]["points"]) and p["calibration"]["streaming"] is None
    r = _cli(cache, "estimate", str(tiny_llama_dir), *ENGINE, "--tensor-parallel-size", "2", "--profile", str(out),
             "--concurrency", "2", "--json")
    assert json.loads(r.stdout)["cost_model"]["source"] == "calibrated"
    r = _cli(cache, "estimate", str(tiny_llama_dir), *ENGINE, "--profile", str(out), check=False)
    assert r.returncode == 1 and "machine ranks: profile 'tp2-pp1', here None" in r.stderr

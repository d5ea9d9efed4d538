"""`tokenmill bench serve` against real servers on loopback: a `tokenmill serve` process (shared by
the module) and the naive Hugging Face baseline in benchmarks/hf_server.py."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from tests.server_utils import ServerProcess, free_port
from tokenmill.bench.serve import arrival_times
from tokenmill.bench.serve_metrics import RequestRecord, summarize
from tokenmill.entrypoints.cli.main import build_parser
from tokenmill.entrypoints.cli.main import main as cli_main

REPO = Path(__file__).resolve().parent.parent
FINISHED = "tokenmill:e2e_request_latency_seconds_count"  # one per request the engine finished


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess().wait_ready()
    yield srv
    assert srv.stop() == 0, srv.log()


def bench(server, tmp_path, *flags: str, name: str = "result") -> tuple[int, dict]:
    """Run `tokenmill bench serve` in-process (as the CLI does); returns (exit code, the JSON result)."""
    out = tmp_path / f"{name}.json"
    args = build_parser().parse_args(["bench", "serve", "--base-url", server.url, "--local-only", "--no-progress",
                                      "--output-json", str(out), *flags])
    code = args.func(args)
    return code, json.loads(out.read_text())


def ok_requests(run: dict) -> list[dict]:
    return [r for r in run["requests"] if r["ok"]]


def check_percentiles(stats: dict, values_ms: list[float]) -> None:
    """The summary equals percentiles computed here from the per-request records (ms, rounded to us)."""
    assert stats["count"] == len(values_ms) > 0
    assert stats["median"] <= stats["p90"] <= stats["p99"] <= max(values_ms) + 0.01
    assert min(values_ms) - 0.01 <= stats["mean"] <= max(values_ms) + 0.01
    for key, expected in (("mean", np.mean(values_ms)), ("median", np.median(values_ms)),
                          ("p90", np.percentile(values_ms, 90)), ("p99", np.percentile(values_ms, 99))):
        assert stats[key] == pytest.approx(expected, abs=0.01), key



def test_completions_metrics_are_consistent_and_bounded(server, tmp_path):
    before = server.metrics()
    png = tmp_path / "one-point.png"
    code, result = bench(server, tmp_path, "--num-prompts", "6", "--concurrency", "3", "--input-len", "24",
                         "--output-len", "6", "--ignore-eos", "--slo", "ttft=60s,tpot=30s,itl=30s,e2e=120s",
                         "--plot", str(png))
    assert code == 0 and not result["interrupted"] and len(result["runs"]) == 1
    run = result["runs"][0]
    assert run["load"] == {"mode": "concurrency", "value": 3, "label": "concurrency 3"}
    assert (run["completed"], run["failed"], run["cancelled"], run["not_sent"]) == (6, 0, 0, 0)
    for r in run["requests"]:
        assert r["ok"] and r["status"] == 200 and r["error"] is None and r["usage_reported"]
        # exact lengths: the prompts were built with the server's own /tokenize
        assert r["prompt_tokens"] == r["expected_prompt_len"] == 24 and r["output_tokens"] == 6
        assert 1 <= r["num_chunks"] <= 6 and len(r["itl_ms"]) == r["num_chunks"] - 1
        assert 0 <= r["sent_at_s"] < r["first_token_at_s"] <= r["end_at_s"]
        assert r["ttft_ms"] > 0 and r["e2e_ms"] == pytest.approx(r["ttft_ms"] + 5 * r["tpot_ms"], abs=0.01)
        assert sum(r["itl_ms"]) <= r["e2e_ms"] - r["ttft_ms"] + 0.01
    done = ok_requests(run)
    for key in ("ttft_ms", "tpot_ms", "e2e_ms"):
        check_percentiles(run[key], [r[key] for r in done])
    check_percentiles(run["itl_ms"], [gap for r in done for gap in r["itl_ms"]])
    duration = run["duration_s"]
    assert duration >= max(r["end_at_s"] for r in done)
    assert run["total_output_tokens"] == 36 and run["total_input_tokens"] == 6 * 24
    assert run["request_throughput"] == pytest.approx(6 / duration)
    assert run["output_token_throughput"] == pytest.approx(36 / duration)
    assert run["total_token_throughput"] == pytest.approx((36 + 144) / duration)
    # an SLO everything meets: goodput is the request throughput
    assert run["slo_ms"] == {"ttft": 60000, "tpot": 30000, "itl": 30000, "e2e": 120000}
    assert run["goodput"] == pytest.approx(run["request_throughput"])
    assert 0 < run["client_overhead_ms_per_request"] < 50 and 0 < run["client_cpu_ms_per_request"] < 50
    assert run["connection_pool_limit"] == 3
    # the server saw exactly the requests asked for, and generated exactly what the client counted
    after = server.metrics()
    assert after[FINISHED] - before[FINISHED] == 6
    assert after["tokenmill:generation_tokens_total"] - before["tokenmill:generation_tokens_total"] == 36
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000


def test_goodput_against_an_independent_count_and_a_strict_slo(server, tmp_path):
    code, result = bench(server, tmp_path, "--num-prompts", "5", "--concurrency", "2", "--input-len", "16",
                         "--output-len", "4", "--ignore-eos", "--slo", "ttft=0.001ms")
    run = result["runs"][0]
    assert code == 0 and run["completed"] == 5 and run["goodput"] == 0.0  # nothing meets 1 us
    # recount goodput from the records' raw timestamps, under bounds that split them: the median TTFT and TPOT
    records, ttfts, tpots = [], [], []
    for r in run["requests"]:
        records.append(RequestRecord(r["index"], r["expected_prompt_len"], r["max_tokens"], sent_at=r["sent_at_s"],
                                     first_token_at=r["first_token_at_s"], end_at=r["end_at_s"],
                                     output_tokens=r["output_tokens"], status=200))
        ttfts.append(r["first_token_at_s"] - r["sent_at_s"])
        tpots.append((r["end_at_s"] - r["first_token_at_s"]) / (r["output_tokens"] - 1))
    slo = {"ttft": float(np.median(ttfts)), "tpot": float(np.median(tpots))}
    good = sum(a <= slo["ttft"] and b <= slo["tpot"] for a, b in zip(ttfts, tpots))
    assert 1 <= good <= 3
    assert summarize(records, run["duration_s"], slo)["goodput"] == pytest.approx(good / run["duration_s"])


def test_chat_shared_prefix_hits_the_prefix_cache(server, tmp_path):
    before = server.metrics()
    code, result = bench(server, tmp_path, "--endpoint", "chat", "--num-prompts", "5", "--concurrency", "1",
                         "--input-len", "16", "--shared-prefix-len", "96", "--output-len", "3", "--ignore-eos")
    run = result["runs"][0]
    assert code == 0 and run["completed"] == 5
    for r in run["requests"]:
        # the content is 96 + 16 tokens; the server's count adds the chat template around it
        assert r["expected_prompt_len"] == 112 and r["prompt_tokens"] > 112 and r["output_tokens"] == 3
    hits = server.metrics()["tokenmill:prefix_cache_hits_total"] - before["tokenmill:prefix_cache_hits_total"]
    assert hits >= 4 * 96, hits  # one at a time: each later request reuses at least the 96 shared tokens


def test_request_rate_sweep_follows_the_arrival_schedule(server, tmp_path):
    png = tmp_path / "sweep.png"
    code, result = bench(server, tmp_path, "--request-rate", "6,inf", "--burstiness", "0.5", "--num-prompts", "5",
                         "--input-len", "12", "--output-len", "3", "--seed", "7", "--plot", str(png))
    assert code == 0 and [r["load"]["label"] for r in result["runs"]] == ["request rate 6/s", "request rate inf"]
    paced, burst = result["runs"]
    assert paced["completed"] == burst["completed"] == 5
    # load point k uses seed + k: its sends follow that gamma schedule (never early, barely late)
    schedule = arrival_times(5, 6.0, 0.5, seed=7)
    for r, at in zip(paced["requests"], schedule):
        assert at - 1e-3 <= r["sent_at_s"] <= at + 0.5
    assert max(r["sent_at_s"] for r in burst["requests"]) < 0.5  # rate inf: all at once
    assert paced["connection_pool_limit"] == 0  # open loop: no cap on connections
    assert png.stat().st_size > 20_000


def test_sweep_in_concurrency_mode_with_a_local_tokenizer(server, tmp_path, capsys):
    hits_before = server.metrics()["tokenmill:prefix_cache_hits_total"]
    code, result = bench(server, tmp_path, "--sweep", "1,3", "--num-prompts", "3", "--input-len", "20",
                         "--output-len", "2", "--ignore-eos", "--tokenizer", "smollm2-135m", "--seed", "101")
    assert code == 0 and [r["load"]["value"] for r in result["runs"]] == [1, 3]
    assert result["config"]["tokenizer"] == "local tokenizer smollm2-135m"
    for run in result["runs"]:
        assert run["completed"] == 3 and all(r["prompt_tokens"] == 20 for r in run["requests"])
    # each load point has its own prompts (seeds 101, 102; no other test uses them): the prefix cache
    # cannot serve one point from the previous one
    assert server.metrics()["tokenmill:prefix_cache_hits_total"] == hits_before
    out = capsys.readouterr().out
    assert "sweep" in out and "concurrency 3" in out and "TTFT (ms)" in out


def test_failed_requests_are_counted(server, tmp_path):
    code, result = bench(server, tmp_path, "--model", "no-such-model", "--num-prompts", "3", "--input-len", "8",
                         "--output-len", "2", "--slo", "ttft=1s")
    run = result["runs"][0]
    assert code == 1  # nothing completed
    assert (run["completed"], run["failed"]) == (0, 3) and run["goodput"] == 0.0
    assert all(r["status"] == 404 and "no-such-model" in r["error"] for r in run["requests"])
    assert list(run["errors"].values()) == [3] and next(iter(run["errors"])).startswith("404:")
    assert run["ttft_ms"]["mean"] is None and run["request_throughput"] == 0.0
    # a dataset with one prompt longer than the server's context: that one fails with 400, the rest run
    dataset = tmp_path / "prompts.jsonl"
    rows = [{"prompt": "The sea is", "output_len": 3}, {"prompt": "word " * 3000}, {"prompt": "Once upon a time"}]
    dataset.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    code, result = bench(server, tmp_path, "--dataset", str(dataset), "--num-prompts", "5", "--output-len", "2",
                         "--concurrency", "3", name="dataset")
    run = result["runs"][0]
    assert code == 0 and (run["completed"], run["failed"]) == (2, 1)
    statuses = [r["status"] for r in run["requests"]]
    assert statuses == [200, 400, 200] and [r["max_tokens"] for r in run["requests"]] == [3, 2, 2]


def test_queue_full_429s_are_failures_not_crashes(tmp_path):
    srv = ServerProcess("--max-num-seqs", "1", "--max-queue-len", "1").wait_ready()
    try:
        code, result = bench(srv, tmp_path, "--num-prompts", "6", "--concurrency", "6", "--input-len", "8",
                             "--output-len", "24", "--ignore-eos")
        run = result["runs"][0]
        assert code == 0 and run["completed"] + run["failed"] == 6 and run["completed"] >= 1
        assert run["failed"] >= 1 and {r["status"] for r in run["requests"] if not r["ok"]} == {429}
        srv.wait_idle()
    finally:
        srv.stop()


def test_ctrl_c_stops_cleanly_and_reports_what_finished(server, tmp_path):
    out = tmp_path / "interrupted.json"
    before = server.metrics()[FINISHED]
    proc = subprocess.Popen(
        [sys.executable, "-m", "tokenmill.entrypoints.cli.main", "bench", "serve", "--base-url", server.url,
         "--local-only", "--num-prompts", "40", "--concurrency", "2", "--input-len", "16", "--output-len", "12",
         "--ignore-eos", "--output-json", str(out)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while server.metrics()[FINISHED] - before < 3 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 130, output
    assert "Traceback" not in output and "interrupted" in output
    result = json.loads(out.read_text())
    run = result["runs"][0]
    assert result["interrupted"] and 1 <= run["completed"] < 40 and run["failed"] == 0
    assert run["completed"] + run["cancelled"] + run["not_sent"] == 40 and run["cancelled"] <= 2
    assert run["ttft_ms"]["count"] == run["completed"]
    server.wait_idle(timeout=30)  # the cancelled streams were aborted on the server
    assert server.metrics()[FINISHED] - before <= 40



def test_local_only_unreachable_and_bad_flags_are_one_line_errors(capsys):
    base = ["bench", "serve", "--num-prompts", "1"]
    for url in ("http://10.1.2.3:8000", "http://192.168.0.1"):
        assert cli_main([*base, "--base-url", url, "--local-only"]) == 1
        err = capsys.readouterr().err
        assert "not a loopback address" in err and err.count("\n") == 1
    assert cli_main([*base, "--base-url", f"http://127.0.0.1:{free_port()}", "--local-only"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("tokenmill: error: cannot reach") and "Traceback" not in err
    for flags, message in ((["--slo", "ttft=soon"], "bad SLO bound"),
                           (["--concurrency", "2", "--sweep", "1,2"], "not both"),
                           (["--sweep", "1.5"], "whole numbers"),
                           (["--range-ratio", "1.5"], "--range-ratio 1.5 is out of range")):
        assert cli_main([*base, "--base-url", "http://127.0.0.1:1", *flags]) == 1
        assert message in capsys.readouterr().err



@pytest.mark.slow
def test_hf_baseline_server_serves_one_request_at_a_time(tmp_path):
    port = free_port()
    log = open(tmp_path / "hf.log", "w")
    proc = subprocess.Popen([sys.executable, str(REPO / "benchmarks" / "hf_server.py"), "--port", str(port)],
                            stdout=log, stderr=subprocess.STDOUT)

    class Target:
        url = f"http://127.0.0.1:{port}"

    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "hf.log").read_text()
            try:
                if httpx.get(Target.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        code, result = bench(Target, tmp_path, "--endpoint", "chat", "--num-prompts", "2", "--concurrency", "2",
                             "--input-len", "12", "--output-len", "4", "--ignore-eos")
        run = result["runs"][0]
        assert code == 0 and run["completed"] == 2
        assert all(r["output_tokens"] == 4 and r["prompt_tokens"] > 12 for r in run["requests"])
        first, second = sorted(run["requests"], key=lambda r: r["end_at_s"])
        # the second request waited for the first to finish (its role chunk came earlier, and is no token)
        assert second["first_token_at_s"] >= first["end_at_s"] - 0.01
        code, result = bench(Target, tmp_path, "--num-prompts", "1", "--input-len", "12", "--output-len", "3",
                             "--ignore-eos", name="completions")
        assert code == 0 and result["runs"][0]["requests"][0]["prompt_tokens"] == 12
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()

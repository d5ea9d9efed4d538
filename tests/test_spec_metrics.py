"""Speculation per request: each RequestOutput's metrics, the server's usage.spec_decode, the
dashboard's request records and `tokenmill bench serve`'s acceptance figures add up to the engine's
own counters (/metrics)."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.server_utils import ServerProcess
from tokenmill import LLM, SamplingParams
from tokenmill.entrypoints.cli.main import build_parser

K = 4
NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 4, "prompt_lookup_min": 2,
                    "adaptive": False})
REPEATS = ["a b c d e " * 8, "def f(x):\n    return x + 1\n" * 6, "one two three four " * 6]
COUNTS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


def _check_bounds(drafts: int, draft_tokens: int, accepted: int) -> None:
    assert 0 < drafts <= draft_tokens <= K * drafts and 0 <= accepted <= draft_tokens


def test_each_request_reports_its_own_speculation():
    llm = LLM(speculative_config=NGRAM, kv_cache_memory="64MiB", max_model_len=256, progress=False)
    one = SamplingParams(temperature=0, max_tokens=1)  # one token leaves no room for a draft
    params = [SamplingParams(temperature=0, max_tokens=32)] * len(REPEATS) + [one]
    outs = llm.generate(REPEATS + ["Is the sky blue?"], params, use_tqdm=False)
    # two sampled sequences of one prompt: their counts add up in the request's metrics
    outs += llm.generate([REPEATS[0]], SamplingParams(n=2, temperature=0.7, seed=3, max_tokens=24), use_tqdm=False)
    metrics = [o.metrics for o in outs]
    for m in metrics[:3] + metrics[4:]:
        _check_bounds(*(getattr(m, c) for c in COUNTS[:2]), m.num_accepted_tokens)
        assert m.spec_acceptance_rate == m.num_accepted_tokens / m.num_draft_tokens
        assert m.spec_mean_acceptance_length == 1 + m.num_accepted_tokens / m.num_drafts
    assert metrics[3].num_drafts == 0 and metrics[3].spec_acceptance_rate is None
    assert metrics[3].spec_mean_acceptance_length is None
    total = llm.engine.core.stats().spec_decoding
    for c in COUNTS:
        assert sum(getattr(m, c) for m in metrics) == getattr(total, c), c


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--speculative-config", NGRAM).wait_ready()
    yield srv
    assert srv.stop() == 0, srv.log()


def _spec_counters(srv) -> list[float]:
    m = srv.metrics()
    return [m[f"tokenmill:spec_decode_{c}_total"] for c in COUNTS]


def test_usage_reports_the_requests_speculation(server):
    before = _spec_counters(server)
    seen = []
    r = httpx.post(server.url + "/v1/completions", json={"prompt": REPEATS[0], "max_tokens": 32, "temperature": 0},
                   timeout=120)
    seen.append(r.json()["usage"]["spec_decode"])
    r = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
        "messages": [{"role": "user", "content": "Repeat exactly: " + REPEATS[1]}], "max_tokens": 48,
        "temperature": 0, "stream": True, "stream_options": {"include_usage": True}})
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    usage = [e["usage"] for e in events if e.get("usage")]
    assert len(usage) == 1
    seen.append(usage[0].get("spec_decode", dict.fromkeys(COUNTS, 0)))
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 1}, timeout=60)
    assert "spec_decode" not in r.json()["usage"]  # one token: nothing to verify
    _check_bounds(*(seen[0][c] for c in COUNTS))
    after = _spec_counters(server)
    for i, c in enumerate(COUNTS):
        assert sum(s[c] for s in seen) == after[i] - before[i], c
    # the dashboard's records of recent requests carry the same counts
    recent = httpx.get(server.url + "/dashboard/api/state", timeout=10).json()["recent_requests"][-3:]
    assert [r["spec_decode"]["num_drafts"] for r in recent] == [seen[0]["num_drafts"], seen[1]["num_drafts"], 0]


def test_bench_serve_reports_acceptance_from_the_server(server, tmp_path):
    data = tmp_path / "repeats.jsonl"
    data.write_text("".join(json.dumps({"prompt": p, "output_len": 32}) + "\n" for p in REPEATS * 2))
    out = tmp_path / "result.json"
    before = _spec_counters(server)
    args = build_parser().parse_args(["bench", "serve", "--base-url", server.url, "--local-only", "--no-progress",
                                      "--dataset", str(data), "--num-prompts", "6", "--concurrency", "2",
                                      "--ignore-eos", "--output-json", str(out)])
    assert args.func(args) == 0
    after = _spec_counters(server)
    run = json.loads(out.read_text())
    run = run["runs"][0] if "runs" in run else run
    assert run["completed"] == 6
    assert [run[f"spec_{c}"] for c in COUNTS] == [a - b for a, b in zip(after, before)]
    assert run["spec_acceptance_rate"] == run["spec_num_accepted_tokens"] / run["spec_num_draft_tokens"]
    assert 1 < run["spec_mean_acceptance_length"] <= 1 + K
    assert sum(r.get("spec_num_drafts", 0) for r in run["requests"]) == run["spec_num_drafts"]

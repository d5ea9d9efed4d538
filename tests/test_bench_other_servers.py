"""`tokenmill bench serve` against a server that is not tokenmill: a loopback server with llama.cpp's
habits (tests/llama_like_server.py) — keep-alive connections closed after a few requests, and the
llama.cpp form of /tokenize."""

from __future__ import annotations

import json

import pytest

from tests.llama_like_server import LlamaLikeServer
from tokenmill.entrypoints.cli.main import build_parser


def bench(url: str, tmp_path, *flags: str) -> tuple[int, dict]:
    out = tmp_path / "result.json"
    args = build_parser().parse_args(["bench", "serve", "--base-url", url, "--local-only", "--no-progress",
                                      "--output-json", str(out), *flags])
    return args.func(args), json.loads(out.read_text())


@pytest.fixture
def llama_like():
    servers = []

    def start(**kwargs) -> LlamaLikeServer:
        servers.append(LlamaLikeServer(**kwargs).start())
        return servers[-1]

    yield start
    for srv in servers:
        srv.stop()


def test_requests_on_connections_the_server_closed_are_resent_not_failed(llama_like, tmp_path):
    srv = llama_like(max_requests_per_connection=5)
    code, result = bench(srv.url, tmp_path, "--num-prompts", "40", "--concurrency", "4", "--input-len", "16",
                         "--output-len", "8")
    run = result["runs"][0]
    assert code == 0 and (run["completed"], run["failed"]) == (40, 0), run["errors"]
    # every connection the server dropped cost one request a resend, and nothing else
    assert srv.closed_unread >= 4 and run["connection_retries"] == srv.closed_unread
    assert sum(r["retries"] for r in run["requests"]) == srv.closed_unread
    assert max(r["retries"] for r in run["requests"]) == 1
    # the server processed each request exactly once
    assert srv.completions_received == 40
    # /tokenize in llama.cpp's form was detected: prompt lengths are exact in the server's tokens
    assert result["config"]["tokenizer"] == "the server's /tokenize (llama.cpp form)"
    assert all(r["prompt_tokens"] == r["expected_prompt_len"] == 16 and r["output_tokens"] == 8
               for r in run["requests"])


def test_requests_that_reached_the_server_count_as_failed(llama_like, tmp_path):
    srv = llama_like(max_requests_per_connection=100)
    dataset = tmp_path / "prompts.jsonl"
    prompts = ["one two three", "HANGUP_MIDSTREAM four five", "HANGUP_UNANSWERED six", "seven eight"]
    dataset.write_text("".join(json.dumps({"prompt": p, "output_len": 6}) + "\n" for p in prompts))
    code, result = bench(srv.url, tmp_path, "--dataset", str(dataset), "--num-prompts", "4", "--concurrency", "1")
    run = result["runs"][0]
    # one at a time: the mid-stream hang-up is on a reused connection but after response bytes; the
    # unanswered one is on a fresh connection (the previous one was hung up): neither is sent again
    assert code == 0 and (run["completed"], run["failed"]) == (2, 2)
    assert [r["ok"] for r in run["requests"]] == [True, False, False, True]
    assert run["connection_retries"] == 0 and srv.completions_received == 4
    hung_up, unanswered = (r for r in run["requests"] if not r["ok"])
    assert hung_up["status"] == 200 and hung_up["error"].startswith("ClientPayloadError")
    assert unanswered["status"] is None and unanswered["error"].startswith("ServerDisconnectedError")


def test_a_server_without_tokenize_falls_back_to_a_local_tokenizer(llama_like, tmp_path, capsys):
    srv = llama_like(tokenize=False)
    code, result = bench(srv.url, tmp_path, "--num-prompts", "3", "--input-len", "8", "--output-len", "2")
    assert code == 0 and result["runs"][0]["completed"] == 3
    assert result["config"]["tokenizer"].startswith("tokenmill's default tokenizer")
    assert "/tokenize is unavailable" in capsys.readouterr().err

"""Hostile input: whatever a body holds (lone surrogates, NUL, NaN, 10 MB strings, deep nesting),
the server answers with OpenAI-shaped JSON that any strict parser reads, keeps the connection, and
logs no traceback."""

from __future__ import annotations

import json
import math
import socket

import httpx
import pytest

from tests.server_utils import ServerProcess
from tokenmill.entrypoints.openai.wire import dumps, parse_json
from tokenmill.errors import InvalidRequestError
from tokenmill.sampling_params import SamplingParams

BIG = "x" * 10_000_000


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess().wait_ready()
    yield srv
    assert srv.stop() == 0, srv.log()
    log = srv.log()
    assert "Traceback" not in log and "Exception in ASGI application" not in log, log


def raw(server, path: str, body: bytes, sock: socket.socket | None = None,
        send_body: bool = True) -> tuple[int, bytes, socket.socket]:
    """POST over a raw HTTP/1.1 keep-alive socket; returns (status, body, the socket to reuse)."""
    sock = sock or socket.create_connection(("127.0.0.1", server.port), timeout=60)
    sock.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                 % (path.encode(), len(body), body if send_body else b""))
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed without a response: {data!r}"
        data += chunk
    head, rest = data.split(b"\r\n\r\n", 1)
    headers = dict(line.split(b":", 1) for line in head.split(b"\r\n")[1:])
    length = int(next(v for k, v in headers.items() if k.lower() == b"content-length"))
    while len(rest) < length:
        chunk = sock.recv(65536)
        assert chunk, "connection closed mid-body"
        rest += chunk
    return int(head.split()[1]), rest, sock


def strict_json(content: bytes):
    """What a strict client does: UTF-8 without surrogates, RFC 8259 JSON (no NaN)."""
    return parse_json(content)


HOSTILE = [
    ("/v1/completions", rb'{"model": "\ud800", "prompt": "hi"}', 400),  # the original crash: 500 or no answer
    ("/v1/completions", rb'{"prompt": "a\udc00b", "echo": true}', 400),
    ("/v1/completions", rb'{"prompt": "hi", "stop": ["\ud800"]}', 400),
    ("/v1/completions", rb'{"prompt": "hi", "\ud800": 1}', 400),
    ("/v1/chat/completions", rb'{"messages": [{"role": "user", "content": "\ud83d"}]}', 400),
    ("/tokenize", rb'{"prompt": "\ud800"}', 400),
    ("/v1/completions", rb'{"model": "a\u0000b", "prompt": "x"}', 404, "model_not_found"),
    ("/v1/completions", rb'{"prompt": "hi", "temperature": NaN}', 400),
    ("/v1/completions", rb'{"prompt": "hi", "temperature": Infinity}', 400),
    ("/v1/completions", rb'{"prompt": "hi", "repetition_penalty": 1e400}', 400),
    ("/v1/completions", rb'{"prompt": "hi", "logit_bias": {"5": -Infinity}}', 400),
    ("/v1/completions", rb'{"prompt": "hi", "seed": 100000000000000000000000000}', 400),
    ("/v1/completions", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400),
    ("/v1/chat/completions", b'{"messages": [], "chat_template_kwargs": ' + b'{"a":' * 3000 + b"1" + b"}" * 3001, 400),
    ("/v1/chat/completions", rb'{"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": '
                             rb'{"messages": 1}}', 400),
    ("/tokenize", rb'{"prompt": "x", "chat_template_kwargs": {"truncation": 1}}', 400),  # unused, still refused
    ("/tokenize", rb'{"prompt": "x", "continue_final_message": true}', 400),  # the schema's rule, prompt or messages
    ("/v1/chat/completions", rb'{"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}', 400),
    ("/v1/completions", b'{"prompt": "\xff\xfe"}', 400),
    ("/v1/completions", b"[1, 2]", 400),
    ("/v1/completions", json.dumps({"model": BIG, "prompt": "x"}).encode(), 404, "model_not_found"),
    ("/v1/completions", json.dumps({"prompt": BIG}).encode(), 400, "context_length_exceeded"),
    ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": BIG}]}).encode(), 400,
     "context_length_exceeded"),
    ("/tokenize", json.dumps({"prompt": BIG}).encode(), 400, "context_length_exceeded"),
    ("/v1/completions", json.dumps({"prompt": BIG * 2}).encode(), 413),
]


@pytest.mark.parametrize("path,body,status,err_code", [(*h, h[2])[:4] for h in HOSTILE],
                         ids=[f"{i}-{h[0]}" for i, h in enumerate(HOSTILE)])
def test_hostile_bodies_get_a_clean_error_and_the_connection_survives(server, path, body, status, err_code):
    """err_code: OpenAI's string code where the error has one, else the status (as vLLM sends)."""
    code, content, sock = raw(server, path, body, send_body=status != 413)  # 413: refused before it is read
    try:
        assert code == status, content[:300]
        err = strict_json(content)["error"]
        assert err["message"] and err["type"] and err["code"] == err_code
        assert len(content) < 4096  # a 10 MB input is not echoed back
        if status == 413:
            return  # the server closes a connection whose body it did not read
        # the same keep-alive connection still serves the next request
        code, content, _ = raw(server, "/v1/completions", b'{"prompt": "Hello", "max_tokens": 2}', sock)
        assert code == 200 and strict_json(content)["usage"]["completion_tokens"] == 2
    finally:
        sock.close()


def test_unknown_paths_and_methods_are_openai_errors(server):
    r = httpx.get(server.url + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.get(server.url + "/v1/completions")
    assert r.status_code == 405 and "POST" in r.headers["allow"] and r.json()["error"]["code"] == 405


def test_health_and_ready_are_json(server):
    for path in ("/health", "/ready"):
        r = httpx.get(server.url + path)
        assert r.status_code == 200 and r.headers["content-type"] == "application/json" and r.json() == {"status": "ok"}
    assert httpx.get(server.url + "/metrics").headers["content-type"].startswith("text/plain")


def test_long_prompts_are_tokenized_off_the_loop_and_served_the_same(server):
    fits = "=" * 17_000 + " The end."  # > OFFLOAD_CHARS characters, under 300 tokens
    count = httpx.post(server.url + "/tokenize", json={"prompt": fits}).json()["count"]
    r = httpx.post(server.url + "/v1/completions", json={"prompt": fits, "max_tokens": 2, "echo": True}, timeout=60)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == count < 2048
    assert r.json()["choices"][0]["text"].startswith(fits)
    too_long = "The quick brown fox jumps over the lazy dog. " * 400  # about 4000 tokens
    count = httpx.post(server.url + "/tokenize", json={"prompt": too_long}).json()["count"]
    r = httpx.post(server.url + "/v1/completions", json={"prompt": too_long, "max_tokens": 2}, timeout=60)
    assert r.status_code == 400 and f"your prompt has {count} tokens" in r.json()["error"]["message"]



def test_dumps_never_raises():
    out = dumps({"a": "\ud800", "b": float("nan"), "c": [float("-inf")], "\udc00": 1, "d": object()})
    parsed = parse_json(out)
    assert parsed["a"] == "\\ud800" and parsed["b"] is None and parsed["c"] == [-9999.0]
    assert dumps({"text": "héllo 😀"}) == '{"text":"héllo 😀"}'.encode()


def test_sampling_params_reject_non_finite_and_huge_seeds():
    for kwargs in ({"temperature": math.nan}, {"temperature": math.inf}, {"repetition_penalty": math.nan},
                   {"top_p": math.nan}, {"seed": 2**64}, {"logit_bias": {3: math.nan}}):
        with pytest.raises(InvalidRequestError):
            SamplingParams(**kwargs)
    params = SamplingParams(top_k=10**30)
    params.check_vocab(1000, 20)
    assert params.top_k == 0  # more than the vocabulary: all tokens, and no huge int reaches a tensor

"""End-to-end: `tokenmill serve` as a real process on a loopback port, driven by the official
`openai` client and raw HTTP."""

from __future__ import annotations

import json
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.server_utils import checked_server, suffix_schema

MODEL = "SmolLM2-135M-Instruct"
CHAT = [{"role": "user", "content": "Write one sentence about the sea."}]


@pytest.fixture(scope="module")
def server():
    # fp32: seeded sampling is then reproducible across batch shapes and prefix-cache hits (in bf16
    # those shift logits by a few ulps, enough to move a sample); the other servers below run bf16
    yield from checked_server("--dtype", "float32")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


def post(server, path, body, **kw):
    return httpx.post(server.url + path, json=body, timeout=120, **kw)



def test_models_version_tokenize_detokenize(server, client):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert httpx.get(server.url + "/version").json()["version"]
    toks = post(server, "/tokenize", {"prompt": "Hello world"}).json()
    assert toks["count"] == len(toks["tokens"]) > 0 and toks["max_model_len"] == 2048
    assert post(server, "/detokenize", {"tokens": toks["tokens"]}).json()["prompt"] == "Hello world"
    chat = post(server, "/tokenize", {"messages": CHAT}).json()
    assert chat["count"] > toks["count"]
    # /tokenize renders messages exactly as a chat request does: developer as system, tool calls, tools
    messages = [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
                    "name": "weather", "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    for extra in ({}, {"tools": tools}):
        counted = post(server, "/tokenize", {"messages": messages, **extra}).json()["count"]
        used = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 1, **extra}).json()
        assert counted == used["usage"]["prompt_tokens"], extra


def test_completion_text_and_token_prompts(client):
    r = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0)
    assert r.object == "text_completion" and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 8 and r.usage.total_tokens == r.usage.prompt_tokens + 8
    ids = client.completions.create(model=MODEL, prompt=[[504, 3458, 282, 4649, 314]], max_tokens=4, temperature=0)
    assert ids.usage.prompt_tokens == 5
    many = client.completions.create(model=MODEL, prompt=["One", "Two", "Three"], max_tokens=3, temperature=0, n=2)
    assert sorted(c.index for c in many.choices) == list(range(6))
    assert many.usage.completion_tokens == 18


def test_n_samples_and_seed(client):
    a = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, n=3, temperature=1.0, seed=7)
    b = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=12, n=3, temperature=1.0, seed=7)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]
    assert len({c.message.content for c in a.choices}) > 1


def test_completion_logprobs_legacy_format(client):
    r = client.completions.create(model=MODEL, prompt="1, 2, 3,", max_tokens=5, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 5
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert val <= 0 and len(top) >= 3 and top[tok] == val == max(top.values())  # greedy: the top token


def test_echo_with_prompt_logprobs_for_loglikelihood(client):
    """lm-evaluation-harness's local-completions loglikelihood request."""
    prompt = "The quick brown fox jumps over the lazy dog"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0)
    c = r.choices[0]
    assert c.text == prompt and r.usage.completion_tokens == 0
    lp = c.logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v <= 0 for v in lp.token_logprobs[1:]) and len(lp.tokens) == r.usage.prompt_tokens
    assert "".join(lp.tokens) == prompt
    # with max_tokens > 0 the echo comes first, then the generation; the prompt logprobs agree
    both = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, echo=True, logprobs=1, temperature=0)
    b = both.choices[0]
    assert b.text.startswith(prompt) and len(b.logprobs.tokens) == len(lp.tokens) + 3
    assert b.logprobs.token_logprobs[1:len(lp.tokens)] == pytest.approx(lp.token_logprobs[1:], abs=1e-3)


def test_chat_logprobs_format(client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == 6
    for entry in content:
        assert entry.logprob <= 0 and entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].token == entry.token


def test_streaming_with_usage_completions_and_chat(client):
    chunks = list(client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert chunks[-1].usage.completion_tokens == 10 and not chunks[-1].choices
    full = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=10, temperature=0)
    assert text == full.choices[0].text
    chat = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=10, temperature=0,
                                               stream=True, stream_options={"include_usage": True}))
    assert chat[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chat if c.choices]
    assert finishes[-1] in ("stop", "length") and all(f is None for f in finishes[:-1])
    assert chat[-1].usage.completion_tokens <= 10


def test_streamed_chat_equals_non_streamed_for_same_seed(client):
    kw = dict(model=MODEL, messages=CHAT, max_tokens=40, temperature=0.8, seed=1234)
    full = client.chat.completions.create(**kw).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
                       if c.choices)
    assert streamed == full and len(full) > 10


def test_stream_n_samples_and_stop(client):
    chunks = list(client.completions.create(model=MODEL, prompt="Count: 1, 2, 3,", max_tokens=20, temperature=0,
                                            stream=True, n=2, stop=[" 7"]))
    texts = {0: "", 1: ""}
    for c in chunks:
        texts[c.choices[0].index] += c.choices[0].text
    assert texts[0] == texts[1] and " 7" not in texts[0]
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == ["stop", "stop"]


def test_vllm_extra_params_and_response_format(server, client):
    greedy = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0)
    top1 = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=1.5,
                                     extra_body={"top_k": 1})
    assert top1.choices[0].text == greedy.choices[0].text
    r = post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 30, "min_tokens": 30, "ignore_eos": True,
                                         "repetition_penalty": 1.3, "min_p": 0.05, "skip_special_tokens": False})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 30
    ids = post(server, "/tokenize", {"prompt": greedy.choices[0].text, "add_special_tokens": False}).json()["tokens"]
    stopped = post(server, "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 12, "temperature": 0,
                                               "stop_token_ids": [ids[3]]}).json()["choices"][0]
    assert stopped["finish_reason"] == "stop" and stopped["stop_reason"] == ids[3]
    msg = [{"role": "user", "content": "Give JSON with a key a."}]
    chat = client.chat.completions.create(model=MODEL, messages=msg,
                                          max_tokens=20, response_format={"type": "json_object"})
    assert chat.choices[0].message.content
    r = post(server, "/v1/chat/completions", {"messages": CHAT, "response_format": {"type": "json_schema",
                                                                                    "json_schema": {"name": "x"}}})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("response_format")
    r = post(server, "/v1/chat/completions", {"messages": CHAT, "tools": [{"type": "function"}]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools"


def test_raw_sse_framing(server):
    with httpx.stream("POST", server.base_url + "/chat/completions", timeout=60,
                      json={"messages": CHAT, "max_tokens": 5, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"
    for e in events[:-1]:
        assert json.loads(e[6:])["object"] == "chat.completion.chunk"



@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "temperature": -1}, "temperature"),
    ({"prompt": "x", "top_p": 2}, "top_p"),
    ({"prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ({"prompt": "x", "n": 0}, "n"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [10**9]}, "prompt"),
    ({"prompt": "x", "logprobs": 50}, "logprobs"),
    ({"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias"),
    ({"max_tokens": 3}, "prompt"),
    ({"prompt": "x", "priority": 1}, "priority"),  # this server schedules fcfs
    ({"prompt": "x", "priority": "high"}, "priority"),
    ({"prompt": "x", "suffix": "y"}, "suffix"),  # SmolLM2 has no fill-in-the-middle tokens
])
def test_invalid_completion_requests_are_400(server, body, param):
    r = post(server, "/v1/completions", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["code"] == 400 and param in (err["param"] or "")
    assert err["message"]


def test_malformed_json_and_wrong_types(server):
    r = httpx.post(server.base_url + "/chat/completions", content=b"{not json", timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
    r = post(server, "/v1/chat/completions", {"messages": "hello"})
    assert r.status_code == 400 and r.json()["error"]["param"].startswith("messages")
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]})
    assert r.status_code == 400 and "role" in r.json()["error"]["message"]


def test_over_long_prompt_names_the_numbers(server):
    r = post(server, "/v1/completions", {"prompt": [100] * 2000, "max_tokens": 100})
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert "2048" in msg and "2100" in msg and "2000" in msg


def test_unknown_model_is_404(server, client):
    r = post(server, "/v1/completions", {"model": "gpt-4", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    assert r.json()["error"]["code"] == "model_not_found"  # OpenAI's code, as clients test it
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=CHAT)



def test_stream_disconnect_aborts_and_frees_kv(server):
    server.wait_idle()
    body = {"prompt": "Tell me everything about the ocean.", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", server.base_url + "/completions", json=body, timeout=60) as r:
        # read through one iterator kept alive: breaking out of a `for` over r.iter_lines() drops the
        # generator, and httpx then closes the connection (the server would see the disconnect now)
        lines, events = r.iter_lines(), []
        while len(events) < 3:
            line = next(lines)
            if line.startswith("data: "):
                events.append(json.loads(line[6:]))
        # three token events, none final: the request is still running and holds KV blocks
        assert all(e.get("choices") and e["choices"][0]["finish_reason"] is None for e in events), events
        m = server.metrics()
        assert m["tokenmill:num_requests_running"] == 1 and m["tokenmill:kv_cache_usage_perc"] > 0, (m, events)
    m = server.wait_idle(timeout=15)  # 1500 tokens would take far longer: the abort freed them
    assert m["tokenmill:num_requests_running"] == 0


def test_non_streaming_disconnect_aborts(server):
    server.wait_idle()
    body = json.dumps({"prompt": "Write a novel.", "max_tokens": 1500, "ignore_eos": True}).encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    deadline = time.monotonic() + 20
    while server.metrics()["tokenmill:num_requests_running"] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.metrics()["tokenmill:kv_cache_usage_perc"] > 0
    sock.close()
    server.wait_idle(timeout=15)


def test_metrics_after_traffic(server, client):
    client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0)
    text = httpx.get(server.url + "/metrics").text
    for name in ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "num_preemptions_total", "prompt_tokens_total",
                 "generation_tokens_total", "request_success_total", "time_to_first_token_seconds_bucket",
                 "inter_token_latency_seconds_bucket", "e2e_request_latency_seconds_bucket",
                 "request_queue_time_seconds_bucket", "request_prompt_tokens_bucket",
                 "request_generation_tokens_bucket"]:
        assert f"tokenmill:{name}" in text, name
    m = server.metrics()
    assert m["tokenmill:generation_tokens_total"] >= 4 and m["tokenmill:e2e_request_latency_seconds_count"] >= 1
    length = [line for line in text.splitlines()
              if line.startswith("tokenmill:request_success_total{") and 'finished_reason="length"' in line]
    assert len(length) == 1 and float(length[0].rsplit(" ", 1)[1]) >= 1


def test_health_answers_under_load(server):
    """Health must not wait behind the model: it answers while 8 long streams run."""
    body = {"prompt": "Tell a long story.", "max_tokens": 100, "ignore_eos": True}
    with ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(post, server, "/v1/completions", body) for _ in range(8)]
        deadline = time.monotonic() + 60
        while server.metrics().get("tokenmill:num_requests_running", 0) < 8 and time.monotonic() < deadline:
            time.sleep(0.05)
        statuses = [httpx.get(server.url + "/health", timeout=5).status_code for _ in range(5)]
        assert not all(f.done() for f in futures), "the streams ended before health was asked: no load"
        assert all(f.result().status_code == 200 for f in futures)
    assert statuses == [200] * 5


def test_an_echo_of_a_prompt_that_fills_the_context(server, client):
    """lm-evaluation-harness cuts a loglikelihood request's context to its max_length: with that at
    the model's length, an echo with max_tokens 0 fills the context exactly (vLLM serves it). One
    token more, or any output, does not fit."""
    limit = httpx.get(server.url + "/v1/models").json()["data"][0]["max_model_len"]
    text = " ".join(f"{i} bottles of beer on the wall." for i in range(400))
    ids = post(server, "/tokenize", {"prompt": text}).json()["tokens"]
    assert len(ids) > limit
    full = client.completions.create(model=MODEL, prompt=ids[:limit], max_tokens=0, echo=True, logprobs=0)
    c = full.choices[0]
    assert full.usage.prompt_tokens == limit and full.usage.completion_tokens == 0
    assert len(c.logprobs.tokens) == limit and all(v <= 0 for v in c.logprobs.token_logprobs[1:])
    # the same prompt less its last token: the same logprobs (to a few thousandths: with 8-bit activation
    # codes, this model's default, a position's value moves that much with the other rows of its chunk)
    shorter = client.completions.create(model=MODEL, prompt=ids[:limit - 1], max_tokens=0, echo=True, logprobs=0)
    assert c.logprobs.token_logprobs[1:-1] == pytest.approx(shorter.choices[0].logprobs.token_logprobs[1:], abs=0.02)
    for body in ({"prompt": ids[:limit + 1], "max_tokens": 0, "echo": True},
                 {"prompt": ids[:limit], "max_tokens": 1, "echo": True}, {"prompt": ids[:limit], "max_tokens": 1}):
        r = post(server, "/v1/completions", body)
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text


def test_a_suffix_needs_fim_tokens_and_the_schema_says_so(server):
    """SmolLM2 has no FIM tokens: its schema takes no suffix but an empty one, and the server agrees."""
    assert suffix_schema(server)["maxLength"] == 0
    r = post(server, "/v1/completions", {"prompt": "def f():", "suffix": "\n", "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "suffix"
    assert post(server, "/v1/completions", {"prompt": "def f():", "suffix": "", "max_tokens": 2}).status_code == 200

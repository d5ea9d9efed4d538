"""OpenAI and vLLM request fields beyond the basics, and what their errors name: against `tokenmill
serve` on a loopback port."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.server_utils import checked_server

MODEL = "SmolLM2-135M-Instruct"
CHAT = [{"role": "user", "content": "Write one sentence about the sea."}]


@pytest.fixture(scope="module")
def server():
    yield from checked_server()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


def post(server, path, body):
    return httpx.post(server.url + path, json=body, timeout=120)


def test_errors_name_the_field_the_client_sent(server):
    # a union's error is the member the input matched in shape: token ids, not "a valid string"
    for prompt, where, says in (([-1], "prompt.0", "greater than or equal to 0"),
                                ([[1, 2], [-3]], "prompt.1.0", "greater than or equal to 0")):
        err = post(server, "/v1/completions", {"prompt": prompt}).json()["error"]
        assert err["param"] == where and says in err["message"], err
    err = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}).json()["error"]
    assert err["param"] == "messages.0.content.0.type" and "'text'" in err["message"], err
    err = post(server, "/v1/chat/completions", {"messages": CHAT, "logprobs": True, "top_logprobs": 25}).json()
    assert err["error"]["param"] == "top_logprobs", err


def test_continue_final_message_goes_on_with_the_assistants_text(server):
    msgs = [{"role": "user", "content": "Name three colors."}, {"role": "assistant", "content": "Sure! The colors are"}]
    flags = {"add_generation_prompt": False, "continue_final_message": True}
    toks = post(server, "/tokenize", {"messages": msgs, **flags}).json()
    assert post(server, "/detokenize", {"tokens": toks["tokens"]}).json()["prompt"].endswith("The colors are")
    r = post(server, "/v1/chat/completions", {"messages": msgs, "max_tokens": 6, "temperature": 0, **flags}).json()
    assert r["usage"]["prompt_tokens"] == toks["count"] and r["choices"][0]["message"]["content"].strip()
    bad = post(server, "/v1/chat/completions", {"messages": msgs, "continue_final_message": True})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "continue_final_message"


def test_logprobs_of_a_character_split_over_tokens(server, client):
    """An emoji is several byte-level tokens, each shown as U+FFFD: legacy text_offset counts the
    character once, a same-text entry of top_logprobs keeps the likelier token's logprob, and chat's
    `bytes` are a token's own bytes, not U+FFFD's."""
    prompt = "<|im_start|>user\nI love emoji: \U0001F600\U0001F602 ok<|im_end|>"
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, echo=True, logprobs=5, temperature=0)
    lp, text = r.choices[0].logprobs, r.choices[0].text
    assert "\ufffd" in lp.tokens and text.startswith(prompt)
    assert lp.text_offset[r.usage.prompt_tokens - 1] == prompt.index("<|im_end|>")
    n = r.usage.prompt_tokens  # each prompt token's text where its offset says (special ones too)
    for tok, at in zip(lp.tokens[:n], lp.text_offset[:n]):
        assert "\ufffd" in tok or text.startswith(tok, at), (tok, at)
    for tok, val, top in zip(lp.tokens[1:], lp.token_logprobs[1:], lp.top_logprobs[1:]):
        assert top[tok] >= val  # its own logprob, or a likelier token's that shows the same text
    emoji = post(server, "/tokenize", {"prompt": "\U0001F600"}).json()["tokens"]
    first = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1, logprobs=True,
                                           logit_bias={str(emoji[0]): 100}).choices[0].logprobs.content[0]
    assert first.token == "\ufffd" and 0 < len(first.bytes) < 4
    assert bytes(first.bytes) == "\U0001F600".encode()[:len(first.bytes)]


@pytest.mark.parametrize("path,body", [("/v1/completions", {"prompt": "Once upon a time"}),
                                       ("/v1/chat/completions", {"messages": CHAT})])
def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(server, path, body):
    body = {**body, "max_tokens": 8, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", server.url + path, json=body, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert all("usage" in c for c in chunks) and counts == sorted(counts) and counts[-1] == 8
    assert all(c["usage"]["prompt_tokens"] == chunks[-1]["usage"]["prompt_tokens"] > 0 for c in chunks)

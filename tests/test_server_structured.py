"""Structured outputs and tool calls against a real `tokenmill serve` on loopback, driven by the
official `openai` client unchanged: chat.completions.parse with a pydantic model, tools with every
tool_choice (also streamed and parsed), tool results sent back, vLLM's structured_outputs on
/v1/completions, and 400s that name the problem."""

from __future__ import annotations

import json
import re
from typing import Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.server_utils import checked_server

MODEL = "SmolLM2-135M-Instruct"


class City(BaseModel):
    name: str = Field(max_length=24)
    country: str = Field(max_length=24)
    population: int = Field(ge=0, le=100_000_000)


class GetWeather(BaseModel):
    """Current weather in a city."""

    city: str = Field(max_length=20)
    unit: Literal["celsius", "fahrenheit"]


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"]}}}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "description": "Current time",
                                              "parameters": {"type": "object", "properties": {}}}}
# Room enough for any answer the schemas allow (their strings are bounded): the tests check the
# grammar's output, not that SmolLM2's answer happens to fit a tight budget under any codes.
ROOM = 256
ASK = [{"role": "user", "content": "What is the weather in Paris for the next 3 days?"}]


@pytest.fixture(scope="module")
def server():
    yield from checked_server("--dtype", "float32")


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)


def test_parse_with_pydantic_model(client):
    r = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "Describe Paris."}],
                                      response_format=City, max_tokens=ROOM, temperature=0)
    city = r.choices[0].message.parsed
    assert isinstance(city, City) and r.choices[0].finish_reason == "stop"
    r = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "Describe a city."}],
                                      response_format=City, max_tokens=ROOM, temperature=1.0, n=3, seed=4)
    assert len(r.choices) == 3
    assert all(isinstance(c.message.parsed, City) for c in r.choices if c.finish_reason == "stop")


def _check_call(call, schema) -> dict:
    assert call.type == "function" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, schema)
    return args


def test_tool_choice_required_named_auto(client):
    schema = WEATHER_TOOL["function"]["parameters"]
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER_TOOL, TIME_TOOL],
                                       tool_choice="required", max_tokens=ROOM, temperature=0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.tool_calls
    for call in choice.message.tool_calls:
        _check_call(call, schema if call.function.name == "get_weather" else {"type": "object"})
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER_TOOL, TIME_TOOL],
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                       max_tokens=ROOM, temperature=1.0, seed=2)
    choice = r.choices[0]
    assert choice.finish_reason == "stop" and len(choice.message.tool_calls) == 1
    assert choice.message.tool_calls[0].function.name == "get_weather" and not choice.message.content
    _check_call(choice.message.tool_calls[0], schema)
    for seed in range(2):
        r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER_TOOL], max_tokens=ROOM,
                                           temperature=1.0, seed=seed)
        choice = r.choices[0]
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls"
            for call in choice.message.tool_calls:
                _check_call(call, schema)
        assert "<tool_call>" not in (choice.message.content or "")
    choice_auto_prompt_tokens = r.usage.prompt_tokens
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER_TOOL], tool_choice="none",
                                       max_tokens=20, temperature=0)
    assert r.choices[0].message.tool_calls is None and r.choices[0].message.content
    # "none" still shows the tools (vLLM's default; test_server_flags.py: the flag that hides them)
    plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1)
    assert r.usage.prompt_tokens == choice_auto_prompt_tokens > plain.usage.prompt_tokens


def test_streamed_tool_calls_match_non_streamed(client):
    kwargs = dict(model=MODEL, messages=ASK, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="required",
                  max_tokens=ROOM, temperature=0)
    whole = client.chat.completions.create(**kwargs).choices[0]
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    calls: dict[int, dict] = {}
    finish = None
    for chunk in chunks:
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for tc in c.delta.tool_calls or []:
                entry = calls.setdefault(tc.index, {"id": tc.id, "name": tc.function.name, "arguments": ""})
                entry["arguments"] += tc.function.arguments or ""
                if tc.id:
                    assert entry["id"] == tc.id and tc.type == "function"
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == \
        [(t.function.name, t.function.arguments) for t in whole.message.tool_calls]
    # the client's own stream helper (accumulates deltas, parses strict pydantic tools)
    with client.chat.completions.stream(model=MODEL, messages=ASK, tools=[openai.pydantic_function_tool(GetWeather)],
                                        tool_choice="required", parallel_tool_calls=False, max_tokens=ROOM,
                                        temperature=0) as stream:
        final = stream.get_final_completion()
    parsed = final.choices[0].message.tool_calls[0].function.parsed_arguments
    assert isinstance(parsed, GetWeather) and parsed.unit in ("celsius", "fahrenheit")


def test_tool_results_sent_back(client):
    first = client.chat.completions.create(model=MODEL, messages=ASK, tools=[WEATHER_TOOL], tool_choice="required",
                                           max_tokens=ROOM, temperature=0).choices[0].message
    history = ASK + [first.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": first.tool_calls[0].id, "content": '{"forecast": "sunny, 24C"}'}]
    r = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER_TOOL], tool_choice="none",
                                       max_tokens=30, temperature=0)
    assert r.choices[0].message.content and r.usage.prompt_tokens > 100


def test_completions_structured_outputs_streaming(client):
    stream = client.completions.create(model=MODEL, prompt="My phone number is ", max_tokens=20, temperature=1.0,
                                       seed=1, n=2, stream=True,
                                       extra_body={"structured_outputs": {"regex": r"\(\d{3}\) \d{3}-\d{4}"}})
    texts = {0: "", 1: ""}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.text
    assert all(re.fullmatch(r"\(\d{3}\) \d{3}-\d{4}", t) for t in texts.values()), texts
    r = client.completions.create(model=MODEL, prompt="Is the sky blue? Answer:", max_tokens=5, temperature=0,
                                  extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].text in ("yes", "no")


@pytest.mark.parametrize("body, param, message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "integer",
                                                                                          "not": {"const": 1}}}}},
     "response_format", "'not' is not supported"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objekt"}}}},
     "response_format", "unknown type 'objekt'"),
    ({"structured_outputs": {"regex": "(a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
    ({"structured_outputs": {"regex": "(a"}}, "structured_outputs", "invalid regex"),
    ({"structured_outputs": {"grammar": "root ::= x"}}, "structured_outputs", "not defined"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "cannot be combined"),
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "not in tools"),
    ({"tools": [WEATHER_TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "tool_choice", "cannot be combined"),
    ({"structured_outputs": {"json": {"type": "object"}}, "ignore_eos": True}, "ignore_eos", "structured outputs"),
])
def test_bad_structured_requests_are_400(server, body, param, message):
    r = httpx.post(server.base_url + "/chat/completions", json={"messages": ASK, "max_tokens": 5, **body}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and message in err["message"], err

"""Tool calling without the model: request checks, the Hermes/Qwen call grammar for each
tool_choice, prompt rendering (template tool section or the fallback prompt), and the incremental
parser (any chunking gives the same calls)."""

from __future__ import annotations

import json

import pytest

from tokenmill.entrypoints.openai.tool_parser import ToolCallParser
from tokenmill.entrypoints.openai.tools import (
    FALLBACK_TOOL_PROMPT,
    parse_tools,
    prepare_messages,
    template_supports_tools,
    tool_grammar,
)
from tokenmill.errors import InvalidRequestError
from tokenmill.structured_output.compiler import MAX_JSON_WHITESPACE
from tokenmill.structured_output.matcher import GrammarState

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object",
                                                           "properties": {"city": {"type": "string"},
                                                                          "days": {"type": "integer", "minimum": 1}},
                                                           "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'


@pytest.fixture(scope="module")
def compiler(grammar_compiler):
    return grammar_compiler


def takes(compiler, tool_choice, text, parallel=None) -> bool:
    spec = tool_grammar(parse_tools([WEATHER, TIME], tool_choice, parallel)).spec()
    m = GrammarState(compiler.get(spec)).matcher
    return m.accept_string(text) and m.is_completed()


def test_grammar_per_tool_choice(compiler):
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert takes(compiler, named, CALL)
    assert not takes(compiler, named, CALL.replace("get_weather", "get_time"))
    assert not takes(compiler, named, CALL.replace('"days": 2', '"days": 0'))  # minimum 1
    assert not takes(compiler, named, CALL.replace('"city": "Paris", ', ""))  # city is required
    assert not takes(compiler, named, "Sure! " + CALL)
    two = CALL + '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    assert takes(compiler, "required", CALL) and takes(compiler, "required", two)
    assert not takes(compiler, "required", "") and not takes(compiler, "required", "No call.")
    assert not takes(compiler, "required", two, parallel=False)
    assert takes(compiler, "auto", "No call needed.") and takes(compiler, "auto", "Let me check.\n" + CALL)
    assert not takes(compiler, "auto", "<tool_call>\n{\"name\": \"nope\", \"arguments\": {}}\n</tool_call>")
    assert tool_grammar(parse_tools([WEATHER], "none", None)) is None


@pytest.mark.parametrize("tool_choice", ["auto", "required", {"type": "function", "function": {"name": "get_weather"}}])
def test_arguments_whitespace_is_bounded(compiler, tool_choice):
    # as in response_format's JSON: a small model could otherwise spend every token between two keys
    gap = " " * MAX_JSON_WHITESPACE
    assert takes(compiler, tool_choice, CALL.replace('"city": ', '"city":' + gap))
    assert not takes(compiler, tool_choice, CALL.replace('"city": ', '"city": ' + gap))


@pytest.mark.parametrize("tools, choice, message", [
    ([{"type": "retrieval"}], None, r"tools\[0\] must be"),
    ([{"type": "function", "function": {"name": "bad name"}}], None, "must match"),
    ([WEATHER, WEATHER], None, "two functions named"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "not": {}}}}], None,
     "function 'f': unsupported JSON schema at #: 'not' is not supported"),
    ([WEATHER], {"type": "function", "function": {"name": "other"}}, "not in tools"),
    ([WEATHER], "sometimes", "tool_choice must be"),
    (None, "required", "only allowed when tools are given"),
])
def test_bad_tools(tools, choice, message):
    with pytest.raises(InvalidRequestError, match=message):
        parse_tools(tools, choice, None)


def test_fallback_prompt_and_tool_messages():
    req = parse_tools([WEATHER], "auto", None)
    history = [{"role": "system", "content": "Be brief."},
               {"role": "user", "content": "Weather in Paris?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "18C, sunny"}]
    msgs, kwargs = prepare_messages(history, req, template_has_tools=False)
    assert kwargs == {} and msgs[0]["role"] == "system"
    assert msgs[0]["content"].startswith("Be brief.\n\n# Tools") and json.dumps(WEATHER) in msgs[0]["content"]
    assert msgs[2] == {"role": "assistant", "content": '<tool_call>\n{"name": "get_weather", "arguments": '
                                                       '{"city": "Paris"}}\n</tool_call>'}
    assert msgs[3] == {"role": "user", "content": "<tool_response>\n18C, sunny\n</tool_response>"}
    msgs, kwargs = prepare_messages(history[1:], req, template_has_tools=False)
    assert msgs[0] == {"role": "system", "content": FALLBACK_TOOL_PROMPT.format(tools=json.dumps(WEATHER))}
    # a template with a tool section gets the tools and parsed arguments
    msgs, kwargs = prepare_messages(history, req, template_has_tools=True)
    assert kwargs == {"tools": [WEATHER]} and msgs[3]["role"] == "tool"
    assert msgs[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Paris"}
    # tool_choice "none": shown as with any other choice (vLLM's default), or left out when the server says so
    none = parse_tools([WEATHER], "none", None)
    assert prepare_messages(history, none, False) == prepare_messages(history, req, False)
    assert prepare_messages(history, none, True)[1] == {"tools": [WEATHER]}
    assert prepare_messages(history, none, False, exclude_when_none=True)[0][0]["content"] == "Be brief."
    assert prepare_messages(history, none, True, exclude_when_none=True)[1] == {}
    assert template_supports_tools("{% if tools %}...{% endif %}") and not template_supports_tools("{{ messages }}")


TEXT = ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa}ris", "n": {"a": [1, 2]}}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')


@pytest.mark.parametrize("step", [1, 2, 3, 5, 8, 13, len(TEXT)])
def test_parser_any_chunking(step):
    parser, deltas = ToolCallParser(), []
    for i in range(0, len(TEXT), step):
        deltas += parser.feed(TEXT[i:i + step])
    deltas += parser.finish()
    content = "".join(d.get("content", "") for d in deltas)
    assert content.strip() == "Let me look."
    calls: dict[int, dict] = {}
    for d in deltas:
        assert set(d) <= {"content", "tool_calls"}
        for tc in d.get("tool_calls", []):
            if "id" in tc:  # the first delta of a call: id, type, name, empty arguments
                assert tc["type"] == "function" and tc["function"]["arguments"] == "" and tc["index"] not in calls
                calls[tc["index"]] = {"name": tc["function"]["name"], "arguments": ""}
            else:
                calls[tc["index"]]["arguments"] += tc["function"]["arguments"]
    assert calls == {0: {"name": "get_weather", "arguments": '{"city": "Pa}ris", "n": {"a": [1, 2]}}'},
                     1: {"name": "get_time", "arguments": "{}"}}
    whole_content, whole_calls = ToolCallParser().parse(TEXT)
    assert whole_content == "Let me look."
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole_calls] == \
        [(c["name"], c["arguments"]) for c in calls.values()]
    assert all(c["id"].startswith("call_") for c in whole_calls)


@pytest.mark.parametrize("text", ["\n<tool_call>", "\n\nHi there\n",
                                  '  Sure.\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n'])
def test_streamed_content_is_the_whole_parse_s(text):
    """A stream's content deltas join to what a non-streamed response holds (a call cut off before
    its object, after a newline, was "\\n<tool_call>" streamed and "<tool_call>" whole)."""
    parser, deltas = ToolCallParser(), []
    for ch in text:
        deltas += parser.feed(ch)
    deltas += parser.finish()
    assert "".join(d.get("content", "") for d in deltas) == ToolCallParser().parse(text)[0]


def test_parser_edge_cases():
    assert ToolCallParser().parse("No tools <tool_ here") == ("No tools <tool_ here", [])
    assert ToolCallParser().parse("<tool_call>not json</tool_call> ok") == ("<tool_call>not json</tool_call> ok", [])
    content, calls = ToolCallParser().parse('<tool_call>\n{"name": "f", "arguments": {"a": 1')  # cut off
    assert content is None and calls[0]["function"] == {"name": "f", "arguments": '{"a": 1'}
    content, calls = ToolCallParser().parse('<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>')
    assert calls[0]["function"] == {"name": "f", "arguments": '{"a": 1}'}


def test_parser_keeps_the_model_s_argument_text():
    text = '<tool_call>\n{"name": "f", "arguments": {\n    "a": 1\n}}\n</tool_call>'
    assert ToolCallParser().parse(text)[1][0]["function"]["arguments"] == '{\n    "a": 1\n}'

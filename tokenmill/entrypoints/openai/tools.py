"""Tool calling on /v1/chat/completions, in the Hermes/Qwen format:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Request tools are checked (their parameter schemas like any JSON schema), rendered through the
model's chat template when it has a tool section, else through FALLBACK_TOOL_PROMPT in the system
message. `tool_choice` required / a named function / auto become a grammar (an xgrammar structural
tag): required and named allow only tool calls; auto allows free text, and once the model opens
`<tool_call>` the call must name a tool and its arguments must match that tool's schema.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from tokenmill.errors import InvalidRequestError
from tokenmill.structured_output import StructuredOutputsParams
from tokenmill.structured_output.json_schema import prepare_json_schema
from tokenmill.structured_output.params import MAX_JSON_WHITESPACE

CALL_BEGIN, CALL_END = "<tool_call>", "</tool_call>"
_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")

FALLBACK_TOOL_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


@dataclass
class ToolRequest:
    tools: list[dict]  # as the client sent them: {"type": "function", "function": {...}}
    schemas: dict[str, Any]  # function name -> its prepared parameter schema
    choice: str  # "none" | "auto" | "required" | "named"
    named: str | None = None
    parallel: bool = True


def parse_tools(tools: list[dict] | None, tool_choice: Any, parallel_tool_calls: bool | None) -> ToolRequest | None:
    """The request's tools and tool_choice, checked; None when no tool can be called."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise InvalidRequestError("tool_choice is only allowed when tools are given", param="tool_choice")
        return None
    schemas: dict[str, Any] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(fn, dict):
            raise InvalidRequestError(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}",
                                      param="tools")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise InvalidRequestError(f"tools[{i}].function.name must match [a-zA-Z0-9_-]{{1,64}}, got {name!r}",
                                      param="tools")
        if name in schemas:
            raise InvalidRequestError(f"tools has two functions named {name!r}", param="tools")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise InvalidRequestError(f"tools[{i}].function.parameters must be a JSON schema object", param="tools")
        try:
            schemas[name] = prepare_json_schema(params, "tools")
        except InvalidRequestError as e:
            raise InvalidRequestError(f"function {name!r}: {e.message}", param="tools") from None
    choice, named = _choice(tool_choice, schemas)
    return ToolRequest(list(tools), schemas, choice, named, parallel_tool_calls is not False)


def _choice(tool_choice: Any, schemas: dict) -> tuple[str, str | None]:
    if tool_choice is None:
        return "auto", None
    if tool_choice in ("none", "auto", "required"):
        return tool_choice, None
    fn = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if not isinstance(fn, dict) or tool_choice.get("type") != "function" or not isinstance(fn.get("name"), str):
        raise InvalidRequestError('tool_choice must be "none", "auto", "required" or {"type": "function", '
                                  '"function": {"name": ...}}', param="tool_choice")
    if fn["name"] not in schemas:
        raise InvalidRequestError(f"tool_choice names function {fn['name']!r}, which is not in tools",
                                  param="tool_choice")
    return "named", fn["name"]


def tool_grammar(req: ToolRequest) -> StructuredOutputsParams | None:
    """The structural tag that tool_choice enforces (None for "none")."""
    if req.choice == "none":
        return None
    names = [req.named] if req.choice == "named" else list(req.schemas)
    # the arguments' free whitespace is bounded per gap, as response_format's JSON is (compiler.py)
    tags = [{"type": "tag", "begin": f'{CALL_BEGIN}\n{{"name": "{n}", "arguments": ',
             "content": {"type": "json_schema", "json_schema": req.schemas[n],
                         "max_whitespace_cnt": MAX_JSON_WHITESPACE},
             "end": f"}}\n{CALL_END}"}
            for n in names]
    if req.choice == "named":
        fmt = tags[0]
    elif req.choice == "required":
        fmt = {"type": "tags_with_separator", "tags": tags, "separator": "\n", "at_least_one": True,
               "stop_after_first": not req.parallel}
    else:
        fmt = {"type": "triggered_tags", "triggers": [CALL_BEGIN], "tags": tags,
               "stop_after_first": not req.parallel}
    return StructuredOutputsParams(structural_tag={"type": "structural_tag", "format": fmt})


def template_supports_tools(template: str | None) -> bool:
    """Whether a chat template renders `tools` itself (Qwen2.5's does; SmolLM2's does not)."""
    return bool(template) and re.search(r"\btools\b", template) is not None


def prepare_messages(messages: list[dict], req: ToolRequest | None, template_has_tools: bool,
                     exclude_when_none: bool = False) -> tuple[list, dict]:
    """Messages and extra template arguments for the chat template: tool calls and tool results
    in the template's terms when it has a tool section, else as Hermes text around the fallback
    system prompt. The tools are shown with every tool_choice, "none" too (as vLLM does), unless
    exclude_when_none (--exclude-tools-when-tool-choice-none)."""
    tools = req.tools if req is not None and not (exclude_when_none and req.choice == "none") else None
    if template_has_tools:
        return [_with_parsed_arguments(m) for m in messages], ({"tools": tools} if tools else {})
    out = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = "\n".join(f"{CALL_BEGIN}\n{json.dumps(_call_object(c), ensure_ascii=False)}\n{CALL_END}"
                              for c in m["tool_calls"])
            text = _text(m.get("content"))
            out.append({"role": "assistant", "content": f"{text}\n{calls}" if text else calls})
        elif m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{_text(m.get('content'))}\n</tool_response>"})
        else:
            out.append(m)
    if tools:
        prompt = FALLBACK_TOOL_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{_text(out[0].get('content'))}\n\n{prompt}"}
        else:
            out.insert(0, {"role": "system", "content": prompt})
    return out, {}


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return content or ""


def _call_object(call: Any) -> dict:
    fn = call.get("function", call) if isinstance(call, dict) else {}
    return {"name": fn.get("name"), "arguments": _arguments(fn.get("arguments"))}


def _arguments(args: Any) -> Any:
    """OpenAI sends arguments as a JSON string; templates expect the object."""
    if isinstance(args, str):
        try:
            return json.loads(args)
        except ValueError:
            return args
    return {} if args is None else args


def _with_parsed_arguments(m: dict) -> dict:
    if m["role"] != "assistant" or not m.get("tool_calls"):
        return m
    calls = []
    for c in m["tool_calls"]:
        fn = c.get("function") if isinstance(c, dict) else None
        if isinstance(fn, dict):
            c = {**c, "function": {**fn, "arguments": _arguments(fn.get("arguments"))}}
        calls.append(c)
    return {**m, "tool_calls": calls}

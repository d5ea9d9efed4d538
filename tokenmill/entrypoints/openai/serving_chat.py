"""POST /v1/chat/completions: messages rendered with the model's chat template, n samples, chat
logprobs, structured outputs, tool calls, SSE streaming (role first, content or tool_calls deltas,
finish reason, optional usage, [DONE])."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from tokenmill.entrypoints.openai.logprobs import chat_logprobs
from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest
from tokenmill.entrypoints.openai.serving_base import ServingBase, Usage, check_choices
from tokenmill.entrypoints.openai.tool_parser import ToolCallParser
from tokenmill.entrypoints.openai.tools import (
    ToolRequest,
    parse_tools,
    prepare_messages,
    template_supports_tools,
    tool_grammar,
)
from tokenmill.errors import InvalidRequestError
from tokenmill.outputs import RequestOutput


class ChatServing(ServingBase):
    id_prefix = "chatcmpl"

    def render(self, messages: list, add_generation_prompt: bool, tools: ToolRequest | None,
               chat_template_kwargs: dict | None, continue_final_message: bool = False) -> str:
        """The prompt text the chat template makes of these messages (what /tokenize counts, too)."""
        dicts = [{**m.model_dump(exclude_none=True), "role": "system" if m.role == "developer" else m.role}
                 for m in messages]
        dicts, tool_kwargs = prepare_messages(dicts, tools, template_supports_tools(self.engine.chat_template),
                                              self.config.exclude_tools_when_tool_choice_none)
        return self.engine.render_chat(dicts, add_generation_prompt, continue_final_message=continue_final_message,
                                       **{**(chat_template_kwargs or {}), **tool_kwargs})

    def prepare(self, req: ChatCompletionRequest) -> tuple[str, object, ToolRequest | None]:
        """The prompt, the sampling params, and the tools whose calls are parsed out of the output."""
        self.admit(req.model)
        check_choices(req.n)
        top = req.top_logprobs
        if top is not None and not req.logprobs:
            raise InvalidRequestError("top_logprobs requires logprobs to be true", param="top_logprobs")
        if top is not None and top > self.engine.max_logprobs:  # checked here to name the client's field
            raise InvalidRequestError(f"top_logprobs must be <= {self.engine.max_logprobs} (the server's "
                                      f"max_logprobs), got {top}", param="top_logprobs")
        structured = req.structured()
        tools = parse_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
        if tools is not None and tools.choice != "none":
            if structured is None:
                structured = tool_grammar(tools)
            elif tools.choice != "auto":
                raise InvalidRequestError(f"tool_choice {tools.named or tools.choice!r} cannot be combined with "
                                          "response_format or structured_outputs", param="tool_choice")
            else:  # the client's own format wins; no call can be made
                tools = None
        prompt = self.render(req.messages, req.add_generation_prompt, tools, req.chat_template_kwargs,
                             req.continue_final_message)
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        for name in ("max_tokens", "max_completion_tokens"):  # both are checked, even the one not used
            value = getattr(req, name)
            if value is not None and value >= self.engine.max_model_len:
                raise InvalidRequestError(f"{name} must be < max_model_len ({self.engine.max_model_len}), "
                                          f"got {value}", param=name)
        params = req.sampling_params(max_tokens, logprobs=(top or 0) if req.logprobs else None,
                                     prompt_logprobs=None, default_max_tokens=None, structured=structured)
        return prompt, params, tools if tools is not None and tools.choice != "none" else None

    async def create(self, req: ChatCompletionRequest, t0: float) -> dict | AsyncIterator[bytes]:
        prompt, params, tools = self.prepare(req)
        request_id = self.new_id()
        streams = await self.submit(request_id, [prompt], params, add_special_tokens=False, priority=req.priority)
        if req.stream:
            return self._stream(req, request_id, streams, t0, tools)
        out: RequestOutput | None = None
        async for _, item in streams:
            out = item
        usage = Usage(len(out.prompt_token_ids), sum(len(o.token_ids) for o in out.outputs))
        usage.add_spec(out.metrics)
        choices = []
        for o in out.outputs:
            message: dict = {"role": "assistant", "content": o.text}
            calls = []
            if tools is not None:
                message["content"], calls = ToolCallParser().parse(o.text)
                if calls:
                    message["tool_calls"] = calls
            choices.append({"index": o.index, "message": message,
                            "logprobs": self._logprobs(req, o.token_ids, o.logprobs),
                            "finish_reason": _finish_reason(o.finish_reason, tools, bool(calls)),
                            "stop_reason": o.stop_reason})
        self.access_log(request_id, "/v1/chat/completions", 200, usage, t0, out.metrics.first_token_time)
        return {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": self.model_name,
                "choices": choices, "usage": usage.to_dict()}

    def _logprobs(self, req: ChatCompletionRequest, token_ids, positions) -> dict | None:
        if not req.logprobs:
            return None
        return {"content": chat_logprobs(token_ids, positions or [], self.piece, self.engine.token_bytes,
                                         req.top_logprobs or 0)}

    async def _stream(self, req: ChatCompletionRequest, request_id: str, streams, t0: float,
                      tools: ToolRequest | None) -> AsyncIterator[bytes]:
        created, usage, first_token, status = int(time.time()), Usage(), None, 200
        started: set[int] = set()
        parsers: dict[int, ToolCallParser] = {}
        continuous = req.usage_every_chunk()

        def chunk(choices, **extra):
            if continuous:
                extra.setdefault("usage", usage.to_dict())
            return self.sse({"id": request_id, "object": "chat.completion.chunk", "created": created,
                             "model": self.model_name, "choices": choices, **extra})

        try:
            async for _, out in streams:
                first_token = first_token or time.monotonic()
                usage.prompt_tokens = len(out.prompt_token_ids)
                if out.finished:
                    usage.add_spec(out.metrics)
                for o in out.outputs:
                    if o.index not in started:
                        started.add(o.index)
                        yield chunk([{"index": o.index, "delta": {"role": "assistant", "content": ""},
                                      "logprobs": None, "finish_reason": None}])
                    usage.completion_tokens += len(o.token_ids)
                    logprobs = self._logprobs(req, o.token_ids, o.logprobs)
                    if tools is None:
                        deltas = [{"content": o.text}] if o.text or not o.finished else [{}]
                    else:
                        parser = parsers.setdefault(o.index, ToolCallParser())
                        deltas = parser.feed(o.text) + (parser.finish() if o.finished else [])
                        if o.finished or logprobs is not None:
                            deltas = deltas or [{}]
                    for k, delta in enumerate(deltas):
                        last = k == len(deltas) - 1
                        finish = _finish_reason(o.finish_reason, tools, bool(parsers.get(o.index) and
                                                                             parsers[o.index].calls))
                        yield chunk([{"index": o.index, "delta": delta, "logprobs": logprobs if last else None,
                                      "finish_reason": finish if o.finished and last else None,
                                      "stop_reason": o.stop_reason if o.finished and last else None}])
            if req.stream_options and req.stream_options.include_usage:
                yield chunk([], usage=usage.to_dict())
        except Exception as e:  # noqa: BLE001 - the stream has started: an error event, then [DONE]
            status, event = self.stream_error(e, request_id)
            yield event
        finally:
            self.access_log(request_id, "/v1/chat/completions (stream)", status, usage, t0, first_token)
        yield b"data: [DONE]\n\n"


def _finish_reason(reason: str | None, tools: ToolRequest | None, called: bool) -> str | None:
    """OpenAI's: "tool_calls" when the model chose to call (auto, required); a named function's
    call ends with "stop"."""
    if called and reason == "stop" and tools is not None and tools.choice != "named":
        return "tool_calls"
    return reason

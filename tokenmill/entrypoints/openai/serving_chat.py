"""POST /v1/chat/completions: messages rendered with the model's chat template, n samples, chat
logprobs, SSE streaming (role first, content deltas, finish reason, optional usage, [DONE])."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from tokenmill.entrypoints.openai.logprobs import chat_logprobs
from tokenmill.entrypoints.openai.protocol import ChatCompletionRequest
from tokenmill.entrypoints.openai.serving_base import ServingBase, Usage, check_choices
from tokenmill.errors import InvalidRequestError, TokenmillError
from tokenmill.outputs import RequestOutput

_ROLES = {"system", "user", "assistant", "developer", "tool"}


class ChatServing(ServingBase):
    id_prefix = "chatcmpl"

    def prepare(self, req: ChatCompletionRequest):
        self.admit(req.model)
        if req.tools:
            raise InvalidRequestError("tools are not supported by this server", param="tools")
        if req.response_format is not None and req.response_format.type == "json_schema":
            raise InvalidRequestError("response_format json_schema is not supported yet (json_object is)",
                                      param="response_format")
        for m in req.messages:
            if m.role not in _ROLES:
                raise InvalidRequestError(f"unknown message role {m.role!r}", param="messages")
        check_choices(req.n)
        top = req.top_logprobs
        if top is not None and not req.logprobs:
            raise InvalidRequestError("top_logprobs requires logprobs to be true", param="top_logprobs")
        messages = [{**m.model_dump(exclude_none=True), "role": "system" if m.role == "developer" else m.role}
                    for m in req.messages]
        prompt = self.engine.render_chat(messages, req.add_generation_prompt, **(req.chat_template_kwargs or {}))
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = req.sampling_params(max_tokens, logprobs=(top or 0) if req.logprobs else None,
                                     prompt_logprobs=None, default_max_tokens=None)
        return prompt, params

    async def create(self, req: ChatCompletionRequest, t0: float) -> dict | AsyncIterator[str]:
        prompt, params = self.prepare(req)
        request_id = self.new_id()
        streams = self.submit(request_id, [prompt], params, add_special_tokens=False)
        if req.stream:
            return self._stream(req, request_id, streams, t0)
        out: RequestOutput | None = None
        async for _, item in streams:
            out = item
        usage = Usage(len(out.prompt_token_ids), sum(len(o.token_ids) for o in out.outputs))
        choices = [{"index": o.index, "message": {"role": "assistant", "content": o.text},
                    "logprobs": self._logprobs(req, o.token_ids, o.logprobs),
                    "finish_reason": o.finish_reason, "stop_reason": o.stop_reason} for o in out.outputs]
        self.access_log(request_id, "/v1/chat/completions", 200, usage, t0, out.metrics.first_token_time)
        return {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": self.model_name,
                "choices": choices, "usage": usage.to_dict()}

    def _logprobs(self, req: ChatCompletionRequest, token_ids, positions) -> dict | None:
        if not req.logprobs:
            return None
        return {"content": chat_logprobs(token_ids, positions or [], self.piece, req.top_logprobs or 0)}

    async def _stream(self, req: ChatCompletionRequest, request_id: str, streams, t0: float) -> AsyncIterator[str]:
        created, usage, first_token, status = int(time.time()), Usage(), None, 200
        started: set[int] = set()

        def chunk(choices, **extra):
            return self.sse({"id": request_id, "object": "chat.completion.chunk", "created": created,
                             "model": self.model_name, "choices": choices, **extra})

        try:
            async for _, out in streams:
                first_token = first_token or time.monotonic()
                usage.prompt_tokens = len(out.prompt_token_ids)
                for o in out.outputs:
                    if o.index not in started:
                        started.add(o.index)
                        yield chunk([{"index": o.index, "delta": {"role": "assistant", "content": ""},
                                      "logprobs": None, "finish_reason": None}])
                    usage.completion_tokens += len(o.token_ids)
                    delta = {"content": o.text} if o.text or not o.finished else {}
                    yield chunk([{"index": o.index, "delta": delta,
                                  "logprobs": self._logprobs(req, o.token_ids, o.logprobs),
                                  "finish_reason": o.finish_reason if o.finished else None,
                                  "stop_reason": o.stop_reason if o.finished else None}])
            if req.stream_options and req.stream_options.include_usage:
                yield chunk([], usage=usage.to_dict())
        except TokenmillError as e:
            status = e.status_code
            yield self.sse_error(e)
        finally:
            self.access_log(request_id, "/v1/chat/completions (stream)", status, usage, t0, first_token)
        yield "data: [DONE]\n\n"

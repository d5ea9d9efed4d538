"""POST /v1/completions: prompts as text or token ids, n samples each, legacy logprobs, echo with
prompt logprobs (what lm-evaluation-harness's loglikelihood requests need), SSE streaming, and
fill-in-the-middle with `suffix` for models that have FIM tokens (code models)."""

from __future__ import annotations

import functools
import time
from collections.abc import AsyncIterator

from tokenmill.entrypoints.openai.logprobs import CompletionLogprobs
from tokenmill.entrypoints.openai.protocol import CompletionRequest
from tokenmill.entrypoints.openai.serving_base import ServingBase, Usage, check_choices
from tokenmill.errors import InvalidRequestError
from tokenmill.model.special_tokens import FimTokens, find_fim_tokens
from tokenmill.outputs import CompletionOutput, RequestOutput


class CompletionServing(ServingBase):
    id_prefix = "cmpl"

    def prepare(self, req: CompletionRequest):
        self.admit(req.model)
        if req.best_of is not None and req.best_of != req.n:
            raise InvalidRequestError("best_of must equal n (no server-side ranking)", param="best_of")
        prompts = req.prompts()
        check_choices(req.n, len(prompts))
        echo_only = req.max_tokens == 0
        if echo_only and not req.echo:
            raise InvalidRequestError("max_tokens must be >= 1 (0 only with echo)", param="max_tokens")
        lp = req.logprobs
        params = req.sampling_params(1 if echo_only else req.max_tokens, logprobs=lp,
                                     prompt_logprobs=lp if req.echo and lp is not None else None,
                                     default_max_tokens=16, structured=req.structured())
        return prompts, params, echo_only

    async def create(self, req: CompletionRequest, t0: float) -> dict | AsyncIterator[bytes]:
        prompts, params, echo_only = self.prepare(req)
        if req.suffix:
            prompts = await self._fill_in_the_middle(req, prompts)
        request_id = self.new_id()
        # submit every prompt now, so that bad input fails before a stream starts
        streams = await self.submit(request_id, prompts, params, priority=req.priority, prompt_only=echo_only)
        if req.stream:
            return self._stream(req, request_id, streams, echo_only, t0)
        results: list[RequestOutput | None] = [None] * len(prompts)
        first_token = None
        async for i, out in streams:
            results[i] = out
            first_token = first_token or (out.metrics and out.metrics.first_token_time)
        usage, choices = Usage(), []
        for i, out in enumerate(results):
            usage.prompt_tokens += len(out.prompt_token_ids)
            usage.add_spec(out.metrics)
            for o in out.outputs:
                choice, n_tokens = self._choice(req, out, o, echo_only, i)
                choices.append(choice)
                usage.completion_tokens += n_tokens
        self.access_log(request_id, "/v1/completions", 200, usage, t0, first_token)
        return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": self.model_name,
                "choices": choices, "usage": usage.to_dict()}

    @property
    def fill_in_the_middle(self) -> bool:
        """Whether the model has FIM tokens (the schema's `suffix` says so)."""
        return self._fim[0] is not None

    @functools.cached_property
    def _fim(self) -> tuple[FimTokens | None, list[int]]:
        """The model's FIM tokens, and what its tokenizer puts before a text (a BOS, or nothing)."""
        fim = find_fim_tokens(self.engine.tokenizer.get_vocab())
        with_special, plain = self.engine.tokenize("a", True), self.engine.tokenize("a", False)
        head = with_special[:len(with_special) - len(plain)] if with_special[-len(plain):] == plain else []
        return fim, head

    async def _fill_in_the_middle(self, req: CompletionRequest, prompts: list) -> list[list[int]]:
        """Each prompt as the text before a gap and `suffix` as the text after it (prefix-suffix-middle,
        as llama.cpp's /infill): the completion is what the model writes into the gap."""
        fim, head = self._fim
        if fim is None:
            raise InvalidRequestError("suffix (fill-in-the-middle) needs a model with FIM tokens such as "
                                      "<|fim_prefix|>, <|fim_suffix|> and <|fim_middle|>; this one has none",
                                      param="suffix")
        if req.echo:
            raise InvalidRequestError("echo cannot be combined with suffix", param="echo")

        async def ids(text: str) -> list[int]:
            offloaded = await self.tokenize(text, False)  # None: short enough to tokenize here
            return offloaded if offloaded is not None else self.engine.tokenize(text, False)

        after = await ids(req.suffix)
        return [head + fim.prompt(await ids(p) if isinstance(p, str) else p, after) for p in prompts]

    def _logprobs(self, req: CompletionRequest, out: RequestOutput, echoed: str | None) -> CompletionLogprobs:
        """Offsets into the choice's text: the `echoed` prompt's text as sent (its special tokens kept, as
        `_prompt_text`), then the generated text after it."""
        ids = out.prompt_token_ids
        if echoed is None:
            return CompletionLogprobs(self.engine.text_offsets(ids, req.skip_special_tokens))
        return CompletionLogprobs(self.engine.text_offsets(ids, req.skip_special_tokens, start=len(echoed)),
                                  self.engine.text_offsets([], False, text=echoed))

    def _prompt_text(self, out: RequestOutput) -> str:
        return out.prompt if out.prompt is not None else self.engine.detokenize(out.prompt_token_ids)

    def _choice(self, req: CompletionRequest, out: RequestOutput, o: CompletionOutput, echo_only: bool, i: int):
        text = "" if echo_only else o.text
        tokens = [] if echo_only else o.token_ids
        echoed = self._prompt_text(out) if req.echo else None
        logprobs = None
        if req.logprobs is not None:
            lp = self._logprobs(req, out, echoed)
            if echoed is not None:
                lp.add(out.prompt_token_ids, out.prompt_logprobs, self.piece, req.logprobs, prompt=True)
            lp.add(tokens, (o.logprobs or [])[:len(tokens)], self.piece, req.logprobs)
            logprobs = lp.take()
        if echoed is not None:
            text = echoed + text
        choice = {"index": i * req.n + o.index, "text": text, "logprobs": logprobs,
                  "finish_reason": "length" if echo_only else o.finish_reason, "stop_reason": o.stop_reason}
        return choice, len(tokens)

    async def _stream(self, req: CompletionRequest, request_id: str, streams, echo_only: bool,
                      t0: float) -> AsyncIterator[bytes]:
        created, usage, first_token = int(time.time()), Usage(), None
        started: set[int] = set()
        logprobs: dict[int, CompletionLogprobs] = {}  # by choice: offsets run on across chunks
        continuous = req.usage_every_chunk()
        status = 200
        try:
            async for i, out in streams:
                first_token = first_token or time.monotonic()
                if out.finished:
                    usage.add_spec(out.metrics)
                for o in out.outputs:
                    idx = i * req.n + o.index
                    text, tokens = ("", []) if echo_only else (o.text, o.token_ids)
                    if idx not in started:
                        started.add(idx)
                        if o.index == 0:
                            usage.prompt_tokens += len(out.prompt_token_ids)
                        echoed = self._prompt_text(out) if req.echo else None
                        if req.logprobs is not None:
                            logprobs[idx] = self._logprobs(req, out, echoed)
                            if echoed is not None:
                                logprobs[idx].add(out.prompt_token_ids, out.prompt_logprobs, self.piece,
                                                  req.logprobs, prompt=True)
                        if echoed is not None:
                            text = echoed + text
                    lp = logprobs.get(idx)
                    if lp is not None:
                        lp.add(tokens, (o.logprobs or [])[:len(tokens)], self.piece, req.logprobs)
                    usage.completion_tokens += len(tokens)
                    finish = ("length" if echo_only else o.finish_reason) if o.finished else None
                    yield self.sse({"id": request_id, "object": "text_completion", "created": created,
                                    "model": self.model_name,
                                    "choices": [{"index": idx, "text": text,
                                                 "logprobs": lp.take() if lp is not None else None,
                                                 "finish_reason": finish,
                                                 "stop_reason": o.stop_reason if o.finished else None}],
                                    **({"usage": usage.to_dict()} if continuous else {})})
            if req.stream_options and req.stream_options.include_usage:
                yield self.sse({"id": request_id, "object": "text_completion", "created": created,
                                "model": self.model_name, "choices": [], "usage": usage.to_dict()})
        except Exception as e:  # noqa: BLE001 - the stream has started: an error event, then [DONE]
            status, event = self.stream_error(e, request_id)
            yield event
        finally:
            self.access_log(request_id, "/v1/completions (stream)", status, usage, t0, first_token)
        yield b"data: [DONE]\n\n"

"""What completions and chat share: admission (model name, drain, back-pressure), running one
or more engine requests with a timeout, SSE framing, and the per-request access log."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from tokenmill.config import ServerConfig
from tokenmill.core.messages import SPEC_COUNTS, spec_counts
from tokenmill.engine.async_engine import AsyncLLMEngine
from tokenmill.entrypoints.openai import wire
from tokenmill.entrypoints.openai.http_errors import clip, tokenmill_error_body
from tokenmill.errors import (
    InvalidRequestError,
    ModelNotFoundError,
    QueueFullError,
    RequestTimeoutError,
    ServiceUnavailableError,
    TokenmillError,
)
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger("tokenmill.access")
server_logger = logging.getLogger("tokenmill.server")
# Texts longer than this are tokenized on a worker thread, not the event loop (the tokenizer
# releases the GIL; ~1 ms per 1000 characters). Two threads: one huge prompt does not hold up others.
OFFLOAD_CHARS = 16_384
_tokenizer_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="tokenmill-tokenize")


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    # speculative decoding of the request's sequences, summed: verifications with drafts, draft
    # tokens, accepted ones. Reported as usage.spec_decode (tokenmill's; only when something was drafted).
    spec: tuple[int, int, int] = (0, 0, 0)

    def add_spec(self, metrics) -> None:
        """A finished request's counts (its RequestMetrics)."""
        if metrics is not None and metrics.num_drafts:
            self.spec = tuple(a + b for a, b in zip(self.spec, spec_counts(metrics)))

    def to_dict(self) -> dict:
        out = {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
               "total_tokens": self.prompt_tokens + self.completion_tokens}
        if self.spec[0]:
            out["spec_decode"] = dict(zip(SPEC_COUNTS, self.spec))
        return out


class ServingBase:
    id_prefix = "req"

    def __init__(self, engine: AsyncLLMEngine, model_name: str, config: ServerConfig, state):
        self.engine = engine
        self.model_name = model_name
        self.config = config
        self.state = state  # server-wide: draining flag
        self.piece = engine.token_piece

    def new_id(self) -> str:
        return f"{self.id_prefix}-{uuid.uuid4().hex}"

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise ModelNotFoundError(f"The model `{clip(model)}` does not exist; this server serves "
                                     f"`{self.model_name}`.")

    def admit(self, model: str | None) -> None:
        self.check_model(model)
        if self.state.draining:
            raise ServiceUnavailableError("the server is shutting down")
        if self.engine.errored:
            raise ServiceUnavailableError("the engine is not running")
        if self.engine.num_waiting >= self.config.max_queue_len:
            raise QueueFullError(f"too many waiting requests ({self.config.max_queue_len}); retry later",
                                 retry_after=max(1, self.engine.num_waiting // 64))

    async def tokenize(self, text: str, add_special_tokens: bool) -> list[int] | None:
        """A long text's ids, computed off the event loop (None: short enough to do inline)."""
        if len(text) <= OFFLOAD_CHARS:
            return None
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(_tokenizer_pool, self.engine.tokenize, text, add_special_tokens)

    async def detokenize(self, tokens: list[int]) -> str:
        if len(tokens) <= OFFLOAD_CHARS // 4:
            return self.engine.detokenize(tokens)
        return await asyncio.get_running_loop().run_in_executor(_tokenizer_pool, self.engine.detokenize, tokens)

    async def submit(self, request_id: str, prompts: list, params: SamplingParams, add_special_tokens: bool = True,
                     priority: int = 0, prompt_only: bool = False) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Submit every prompt as its own engine request (bad input, or an SLO the load would break,
        raises here, before anything streams); returns an iterator of (prompt index, output) within
        the request timeout. Leaving it early aborts every request."""
        ids = [await self.tokenize(p, add_special_tokens) if isinstance(p, str) else None for p in prompts]
        streams = []
        try:
            for i, prompt in enumerate(prompts):
                rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                streams.append(self.engine.generate(prompt, params, rid, add_special_tokens=add_special_tokens,
                                                    prompt_token_ids=ids[i], priority=priority,
                                                    admit=self.state.slo_gate, prompt_only=prompt_only))
        except BaseException:
            for s in streams:
                s.close()
            raise
        return self._merge(streams)

    async def _merge(self, streams) -> AsyncIterator[tuple[int, RequestOutput]]:
        deadline = None if self.config.request_timeout is None else time.monotonic() + self.config.request_timeout
        if len(streams) == 1:  # the common case: no pump task and no second queue per token
            try:
                while True:
                    try:
                        out = await self._within(deadline, anext(streams[0]))
                    except StopAsyncIteration:
                        return
                    yield 0, out
            finally:
                streams[0].close()
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i, stream):
            try:
                async for out in stream:
                    queue.put_nowait((i, out))
            except BaseException as e:  # noqa: BLE001 - forwarded to the consumer
                queue.put_nowait((i, e))
            finally:
                queue.put_nowait((i, None))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        running = len(tasks)
        try:
            while running:
                i, item = await self._within(deadline, queue.get())
                if item is None:
                    running -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()
            for s in streams:
                s.close()

    async def _within(self, deadline: float | None, awaitable):
        """`await awaitable` before the request's deadline. A timeout scoped to this one await
        (asyncio.wait_for would wrap each token's wait in a new task)."""
        if deadline is None:
            return await awaitable
        try:
            async with asyncio.timeout_at(asyncio.get_running_loop().time() + deadline - time.monotonic()):
                return await awaitable
        except TimeoutError:
            raise RequestTimeoutError(
                f"request exceeded the {self.config.request_timeout:g}s request timeout") from None

    @staticmethod
    def sse(payload: dict) -> bytes:
        return wire.sse(payload)

    @staticmethod
    def stream_error(e: BaseException, request_id: str) -> tuple[int, bytes]:
        """A failure after the stream started: (status for the access log, the error event)."""
        if not isinstance(e, TokenmillError):  # a bug: logged, and the client still gets a clean end
            server_logger.error("request %s failed mid-stream", request_id, exc_info=e)
            e = TokenmillError(f"internal error: {type(e).__name__}")
        return e.status_code, wire.sse(tokenmill_error_body(e))

    def access_log(self, request_id: str, endpoint: str, status: int, usage: Usage, t0: float,
                   first_token: float | None) -> None:
        ttft = "-" if first_token is None else f"{(first_token - t0) * 1000:.0f}ms"
        logger.info("%s %s %d prompt_tokens=%d completion_tokens=%d ttft=%s total=%.0fms", request_id, endpoint,
                    status, usage.prompt_tokens, usage.completion_tokens, ttft, (time.monotonic() - t0) * 1000)


def check_choices(n: int, num_prompts: int = 1) -> None:
    if n * num_prompts > 128:
        raise InvalidRequestError(f"n x prompts must be <= 128, got {n * num_prompts}", param="n")

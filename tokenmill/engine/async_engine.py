"""The asyncio engine: one engine thread runs `LLMEngine.step()` in a loop; the event loop only
submits requests and receives outputs, so an HTTP front end stays responsive while the model runs.

`generate()` is an async iterator of incremental outputs; when its consumer stops iterating
(client gone, timeout, cancellation) the request is aborted and its KV blocks freed in the next
step. A failing step fails only its batch's requests; an error outside a step kills the engine
(`errored`), fails every request, and later calls raise EngineDeadError.

The HTTP layer uses only this class's public surface: generation, tokenization and detokenization
(front-end objects that stay in this process), model facts, and the core's statistics and load.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import queue
import threading
import uuid
from collections.abc import Callable

from tokenmill.config import EngineConfig
from tokenmill.core.messages import SchedulerLoad, SchedulerStats
from tokenmill.engine.async_streams import RequestStream, Waker, resolve
from tokenmill.engine.detokenizer import TextOffsets
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine.load_tracker import LoadTracker
from tokenmill.engine.stats import StatLogger
from tokenmill.errors import EngineDeadError, EngineStepError, InvalidRequestError, ServiceUnavailableError
from tokenmill.model.model_config import ModelConfig
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger(__name__)


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = Waker()
        self._streams: dict[str, asyncio.Queue] = {}  # event-loop thread only
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.dead_error: BaseException | None = None
        self._load = LoadTracker(engine.scheduler_stats().num_received)

    @classmethod
    def from_engine_args(cls, **kwargs) -> AsyncLLMEngine:
        return cls(LLMEngine.from_engine_args(**kwargs))

    @classmethod
    def from_config(cls, config: EngineConfig, progress: bool = False, core_client=None) -> AsyncLLMEngine:
        """Loads the model: blocking, call it off the event loop. The core runs in a process of its
        own unless --no-engine-core-process; `core_client`: one already starting (see LLMEngine)."""
        return cls(LLMEngine(config, progress=progress, multiprocess=config.parallel.engine_core_process is not False,
                             core_client=core_client))

    @property
    def served_model_name(self) -> str:
        return self.engine.served_model_name

    @property
    def model_config(self) -> ModelConfig:
        return self.engine.model_config

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.model_config.vocab_size

    @property
    def max_logprobs(self) -> int:
        return self.engine.processor.max_logprobs

    @property
    def max_prompt_chars(self) -> int:
        """Texts longer than this are refused before they are tokenized."""
        return self.engine.processor.max_prompt_chars

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def chat_template(self) -> str | None:
        """The chat template in use: the --chat-template override, else the model's."""
        return self.engine.processor.chat_template or getattr(self.engine.tokenizer, "chat_template", None)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True, chat_template: str | None = None,
                    **template_kwargs) -> str:
        return self.engine.processor.render_chat(messages, add_generation_prompt, chat_template, **template_kwargs)

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.engine.processor.tokenize(text, add_special_tokens)

    def detokenize(self, token_ids: list[int]) -> str:
        vocab = self.vocab_size
        if any(not 0 <= t < vocab for t in token_ids):
            raise InvalidRequestError(f"token ids must be in [0, {vocab})", param="tokens")
        return self.engine.tokenizer.decode(token_ids)

    def text_offsets(self, context_ids: list[int], skip_special_tokens: bool = True, start: int = 0,
                     text: str | None = None) -> TextOffsets:
        """Each next token's character offset in the text decoded after `context_ids` (detokenizer.py)."""
        return TextOffsets(self.engine.output_processor.fast, context_ids, skip_special_tokens, start, text)

    def token_bytes(self, token_id: int) -> bytes:
        """One token's own bytes (a piece of a character: the bytes, not U+FFFD's)."""
        return self.engine.output_processor.piece_bytes(token_id)

    def token_piece(self, token_id: int) -> str:
        """One token's text as logprobs show it (special tokens included; cached)."""
        return self.engine.output_processor.piece(token_id)

    def scheduler_stats(self) -> SchedulerStats:
        """The core's queue and KV-cache state, read now."""
        return self.engine.scheduler_stats()

    def load(self) -> SchedulerLoad:
        """The work the core holds, as it reported with its last step, plus the requests submitted
        since that it had not received then (plain data; call from the event loop)."""
        return self._load.load()

    @property
    def replica_stats(self):
        """With data-parallel replicas: a callable giving each replica's statistics (plain data);
        else None."""
        return getattr(self.engine.core_client, "replica_stats", None)

    def add_stat_logger(self, stat_logger: StatLogger) -> None:
        """Called with every step's statistics, on the engine thread. Add before start()."""
        self.engine.stat_loggers.append(stat_logger)

    def start(self) -> None:
        """Start the engine thread; call from the event loop that will consume outputs."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="tokenmill-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self.engine.shutdown()

    @property
    def is_running(self) -> bool:
        return (self._thread is not None and self._thread.is_alive() and self.dead_error is None
                and self.engine.core_client.healthy)

    @property
    def errored(self) -> bool:
        return self.dead_error is not None

    @property
    def num_in_flight(self) -> int:
        return len(self._streams)

    @property
    def num_waiting(self) -> int:
        """Requests in flight beyond the batch's slots (read from the event loop): counted from this
        side's own streams, so a burst counts at once, whatever the core (in this process or
        another) has reported so far."""
        config = self.engine.config
        return max(0, len(self._streams) - config.scheduler.max_num_seqs * config.parallel.data_parallel_size)

    def generate(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None,
                 add_special_tokens: bool = True, prompt_token_ids: list[int] | None = None, priority: int = 0,
                 admit: Callable[[int, int, int], None] | None = None, prompt_only: bool = False) -> RequestStream:
        """Validate and submit a request; returns an async iterator of its outputs (deltas unless
        FINAL_ONLY). Bad input raises here, before anything is streamed. A caller that tokenized a
        long text off the event loop passes its ids as `prompt_token_ids`. `priority`: lower is served
        first (priority scheduling policy). `admit(prompt tokens, max tokens, sequences)` is called
        once the request is validated, before it is submitted; raising there rejects it. `prompt_only`:
        see InputProcessor.process."""
        if self.dead_error is not None:
            raise EngineDeadError("the engine is not running") from self.dead_error
        if params.output_kind == RequestOutputKind.CUMULATIVE:  # streams carry deltas
            params = copy.copy(params)
            params.output_kind = RequestOutputKind.DELTA
        request_id = request_id or uuid.uuid4().hex
        if request_id in self._streams:
            raise InvalidRequestError(f"request id {request_id!r} is in flight", param="request_id")
        processed = self.engine.process(request_id, prompt, params, add_special_tokens=add_special_tokens,
                                        prompt_token_ids=prompt_token_ids, priority=priority,
                                        prompt_only=prompt_only)
        children = processed.children
        if admit is not None:
            admit(len(processed.prompt_token_ids), children[0].max_tokens, len(children))
        stream = RequestStream(self, request_id)
        self._streams[request_id] = stream.queue
        self._load.submitted(len(processed.prompt_token_ids), children[0].max_tokens, len(children))
        self._submit(("add", processed))
        return stream

    def release_request(self, request_id: str, abort: bool) -> None:
        """A stream's consumer is done with it (aborting the request unless it finished)."""
        self._streams.pop(request_id, None)
        if abort:
            self.abort(request_id)

    async def kv_block_states(self) -> str:
        """Each KV block's state as plain data ("0" free, "1" in use, "2" cached and evictable), read
        by the engine thread between two steps."""
        future = self._loop.create_future()
        self._submit(("call", ("kv_block_states", future)))
        return await future

    def fail_all(self, error: BaseException) -> None:
        """End every in-flight request with `error` (shutdown past its grace period): each stream
        raises it, so each client gets an explicit error rather than a cut connection."""
        for rid in list(self._streams):
            self._streams[rid].put_nowait(error)
            self.abort(rid)

    def abort(self, request_id: str) -> None:
        self._submit(("abort", request_id))

    def _submit(self, op) -> None:
        self._inbox.put(op)
        self._wake.set()

    def _drain_inbox(self) -> None:
        while True:
            try:
                kind, arg = self._inbox.get_nowait()
            except queue.Empty:
                return
            if kind == "abort":
                self.engine.abort_request(arg)
                continue
            if kind == "call":
                method, future = arg
                self.engine.call_core(method, lambda value, f=future: self._post(resolve, f, value))
                continue
            try:
                self.engine.add_processed(arg)
            except (InvalidRequestError, ServiceUnavailableError) as e:  # e.g. a reused request id: fail
                # that request, not the engine
                self._load.lost(len(arg.children))
                self._post(self._fail, [arg.request_id], e)

    def _run(self) -> None:
        try:
            in_process = self.engine.core_client.runs_in_process
            while not self._stopping:
                self._drain_inbox()
                if in_process and not self.engine.has_unfinished_requests():
                    self._load.reported(self.engine.scheduler_stats())  # in process: read now
                    self._wake.wait(timeout=1.0)
                    self._wake.clear()
                    continue
                try:
                    # a core in another process: wait for its next outputs, or for new work to send
                    outputs = self.engine.step(interrupt=None if in_process else self._wake.fileno())
                    self._wake.clear()
                except EngineStepError as e:
                    self._post(self._fail, e.request_ids, e)
                    continue
                if self.engine.last_scheduler_stats is not None:
                    self._load.reported(self.engine.last_scheduler_stats)
                if outputs:
                    self._post(self._dispatch, outputs)
                for rid, why in self.engine.take_failed().items():
                    logger.error("request %s failed: %s", rid, why)
                    self._post(self._fail, [rid], EngineStepError(f"request failed: {why}", [rid]))
        except BaseException as e:  # a bug outside the model step: the engine state is suspect
            logger.exception("engine loop died")
            self.dead_error = e
            error = e if isinstance(e, EngineDeadError) else EngineDeadError(f"engine died: {type(e).__name__}: {e}")
            self._post(self._fail, None, error)

    def _post(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the event loop is closed (shutdown)
            pass

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is not None:
                stream.put_nowait(out)

    def _fail(self, request_ids, error: BaseException) -> None:
        for rid in list(self._streams) if request_ids is None else request_ids:
            stream = self._streams.get(rid)
            if stream is not None:
                stream.put_nowait(error)

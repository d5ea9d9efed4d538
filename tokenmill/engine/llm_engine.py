"""The synchronous engine: input processing -> engine core -> output processing.

`add_request`, `abort_request`, `step`, `has_unfinished_requests`. Single-threaded by contract:
the offline `LLM` drives it directly; `AsyncLLMEngine` drives it from one engine thread.
"""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tokenmill.config import EngineConfig
from tokenmill.core.messages import SchedulerStats
from tokenmill.engine import faults
from tokenmill.engine.core_client import EngineCoreClient, InprocClient
from tokenmill.engine.mp_client import MPClient
from tokenmill.engine.output_processor import OutputProcessor
from tokenmill.engine.processor import InputProcessor, ProcessedRequest
from tokenmill.engine.stats import IterationStats, StatLogger
from tokenmill.errors import ConfigError, EngineStepError, InvalidRequestError, ServiceUnavailableError
from tokenmill.model.loader import load_model_config, load_tokenizer, resolve_model
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


def load_chat_template(template: str | None) -> str | None:
    """A path to a Jinja file, or the template text itself."""
    if template is None:
        return None
    path = Path(os.path.expanduser(template))
    if "{" not in template and not path.is_file():
        raise ConfigError(f"chat template {template!r} is neither a file nor a Jinja template", param="chat_template")
    return path.read_text() if path.is_file() else template


def make_core_client(config: EngineConfig, source, model_config, progress: bool, multiprocess: bool
                     ) -> EngineCoreClient:
    parallel = config.parallel
    if parallel.data_parallel_size > 1:
        if parallel.distributed_executor_backend == "ray":
            from tokenmill.engine.ray_client import RayDPClient

            return RayDPClient(config, parallel.data_parallel_size, parallel.router_policy)
        from tokenmill.engine.dp_client import DPClient

        return DPClient(config, parallel.data_parallel_size, parallel.router_policy)
    if multiprocess:
        return MPClient(config)
    return InprocClient(config, source, model_config, progress)


class LLMEngine:
    def __init__(self, config: EngineConfig, progress: bool = True, multiprocess: bool | None = None,
                 core_client: EngineCoreClient | None = None):
        """multiprocess: run the core in its own process (default: --engine-core-process, else no).
        core_client: a core already starting (`tokenmill serve` starts its process before it imports
        the front end); this engine owns it from here, and stops it if the engine fails to build."""
        try:
            self._build(config, progress, multiprocess, core_client)
        except BaseException:
            if core_client is not None:
                core_client.shutdown()
            raise

    def _build(self, config: EngineConfig, progress: bool, multiprocess: bool | None,
               core_client: EngineCoreClient | None) -> None:
        self.config = config
        t0 = time.monotonic()
        chat_template = load_chat_template(config.model.chat_template)  # fail before the slow part
        if multiprocess is None:
            multiprocess = bool(config.parallel.engine_core_process)
        if core_client is None:
            from tokenmill.engine.engine_core import EngineCore

            # a cold start's kernel builds run while the model loads; a core in another process loads
            # what this one builds (it waits on the build's file lock), so they also overlap reading
            # the GGUF here, before that process starts. A core started earlier began its own.
            EngineCore.prefetch(config, load=not multiprocess and config.parallel.data_parallel_size == 1)
        self.source = resolve_model(config.model.model)
        self.model_config = load_model_config(self.source)
        # The tokenizer (importing transformers: ~1.3 s of Python) loads while the weights load (in
        # this process: numpy kernels that release the GIL) or the core process starts.
        with ThreadPoolExecutor(1, thread_name_prefix="tokenmill-tokenizer") as pool:
            tokenizer = pool.submit(load_tokenizer, self.source, config.model.tokenizer,
                                    config.model.trust_remote_code)
            if core_client is None:
                core_client = make_core_client(config, self.source, self.model_config, progress, multiprocess)
            else:
                core_client.wait_ready()
            self.core_client: EngineCoreClient = core_client
            self.tokenizer = tokenizer.result()
        # the EngineCore itself, for offline tools that drive its parts (calibration); None when it
        # runs in another process
        self.core = getattr(self.core_client, "core", None)
        eos = set(self.model_config.eos_token_id)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.processor = InputProcessor(self.tokenizer, self.model_config.vocab_size, self.core_client.max_model_len,
                                        config.model.max_logprobs, eos, chat_template,
                                        config.scheduler.scheduling_policy == "priority")
        self.output_processor = OutputProcessor(self.tokenizer, config.scheduler.stream_interval)
        faults.install_output(self.output_processor)  # test-only switches; nothing when unset
        self._failed: dict[str, str] = {}
        self.stat_loggers: list[StatLogger] = []
        self.served_model_name = config.model.served_model_name or self.source.name
        self.last_iteration_stats = IterationStats()
        self.last_scheduler_stats: SchedulerStats | None = None  # as the core reported it with the last step
        logger.info("engine ready in %.1fs", time.monotonic() - t0)

    @classmethod
    def from_engine_args(cls, progress: bool = True, **kwargs) -> LLMEngine:
        return cls(EngineConfig.from_kwargs(**kwargs), progress=progress)

    @property
    def max_model_len(self) -> int:
        return self.core_client.max_model_len

    def process(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                arrival_time: float | None = None, add_special_tokens: bool = True,
                prompt_token_ids: list[int] | None = None, priority: int = 0,
                prompt_only: bool = False) -> ProcessedRequest:
        """Tokenize and validate (thread-safe; raises InvalidRequestError for bad input). `priority`:
        lower is served first, under the priority scheduling policy (else it must be 0). `prompt_only`:
        see InputProcessor.process."""
        return self.processor.process(request_id, prompt, params or SamplingParams(), arrival_time,
                                      add_special_tokens, prompt_token_ids, priority, prompt_only)

    def add_processed(self, *processed: ProcessedRequest) -> None:
        """Submit validated requests; several at once reach the core before its next step."""
        ids = [p.request_id for p in processed]
        new: set[str] = set()
        for rid in ids:
            if rid in new or rid in self.output_processor.requests:
                raise InvalidRequestError(f"request id {rid!r} is already in use", param="request_id")
            new.add(rid)
        for p in processed:
            self.output_processor.add_request(p)
        try:
            self.core_client.add_requests([child for p in processed for child in p.children])
        except ServiceUnavailableError:  # e.g. every replica is restarting: these requests fail, not the engine
            self.core_client.abort_requests(self.output_processor.abort(ids))
            raise

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None, add_special_tokens: bool = True, priority: int = 0) -> None:
        self.add_processed(self.process(request_id, prompt, params, arrival_time, add_special_tokens,
                                        priority=priority))

    def abort_request(self, request_ids) -> None:
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        self.core_client.abort_requests(self.output_processor.abort(request_ids))

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished() or self.core_client.has_unfinished()

    def call_core(self, method: str, on_result) -> None:
        """A read-only core method (e.g. kv_block_states), between two steps; call on the engine's
        thread. `on_result(value)` runs on that thread."""
        self.core_client.call(method, on_result)

    def num_waiting(self) -> int:
        return self.core_client.stats().num_waiting

    def scheduler_stats(self) -> SchedulerStats:
        """In process: read now; otherwise as of the core's last message."""
        return self.core_client.stats()

    def shutdown(self) -> None:
        self.core_client.shutdown()

    def take_failed(self) -> dict[str, str]:
        """Requests that failed alone in the steps since the last call (request id -> why): a fault
        while scheduling, detokenizing or stop-checking one request fails only that request."""
        failed, self._failed = self._failed, {}
        return failed

    def step(self, interrupt: int | None = None) -> list[RequestOutput]:
        """One core step's outputs. With a core in another process, waits for them, or until the
        file descriptor `interrupt` turns readable (then returns [])."""
        try:
            core_outs = self.core_client.get_output(interrupt)
        except EngineStepError as e:  # report the failed requests by the ids their callers know
            e.request_ids = self.output_processor.parents_of(e.request_ids)
            self.output_processor.abort(e.request_ids)
            raise
        if core_outs.failed:  # failed alone while scheduled: its sibling samples end with it
            parents = {parent: why for cid, why in core_outs.failed.items()
                       for parent in self.output_processor.parents_of([cid])}
            self._failed.update(parents)
            self.core_client.abort_requests(self.output_processor.abort(list(parents)))
        outputs, to_abort, it_stats = self.output_processor.process(core_outs.outputs, time.monotonic())
        self._failed.update(self.output_processor.take_failed())
        if to_abort:  # stop strings and failed requests: the core keeps generating until told
            self.core_client.abort_requests(to_abort)
        self.last_iteration_stats = it_stats
        self.last_scheduler_stats = core_outs.scheduler_stats
        for stat_logger in self.stat_loggers:
            stat_logger.record(core_outs.scheduler_stats, it_stats)
        return outputs

"""How the front end talks to the engine core: in this process (`InprocClient`, the offline `LLM`)
or in a process of its own over ZMQ (`MPClient` in mp_client.py, `tokenmill serve`), as vLLM V1's
core clients. Both take EngineCoreRequests and abort ids and give EngineCoreOutputs: plain data
either way. `get_output(interrupt)` returns the next step's outputs.
"""

from __future__ import annotations

from collections.abc import Callable

from tokenmill.config import EngineConfig
from tokenmill.core.messages import EngineCoreOutputs, EngineCoreRequest, SchedulerStats


class EngineCoreClient:
    max_model_len: int
    num_blocks: int
    runs_in_process: bool
    healthy = True  # False while no engine core can take requests (all replicas down)

    def add_request(self, request: EngineCoreRequest) -> None:
        raise NotImplementedError

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        """Several requests that the core takes before its next step, all or none of them (an
        offline batch: the same batches, so the same results, in process or not)."""
        for request in requests:
            self.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        raise NotImplementedError

    def get_output(self, interrupt: int | None = None) -> EngineCoreOutputs:
        """The next step's outputs (raises EngineStepError when a step failed, EngineDeadError when
        the core is gone)."""
        raise NotImplementedError

    def stats(self) -> SchedulerStats:
        """The core's queue and KV-cache state (in process: now; otherwise: at its last message)."""
        raise NotImplementedError

    def call(self, method: str, on_result: Callable) -> None:
        """Run a read-only core method between two steps; `on_result(value)` gets its result, on
        the thread that calls get_output."""
        raise NotImplementedError

    def has_unfinished(self) -> bool:
        raise NotImplementedError

    def shutdown(self) -> None:
        pass


class InprocClient(EngineCoreClient):
    runs_in_process = True

    def __init__(self, config: EngineConfig, source, model_config, progress: bool = True):
        from tokenmill.engine.engine_core import EngineCore

        self.core = EngineCore(config, source, model_config, progress=progress)
        self.max_model_len = self.core.max_model_len
        self.num_blocks = self.core.kv.num_blocks

    def add_request(self, request: EngineCoreRequest) -> None:
        self.core.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.core.abort_requests(request_ids)

    def get_output(self, interrupt: int | None = None) -> EngineCoreOutputs:
        return self.core.step()

    def stats(self) -> SchedulerStats:
        return self.core.stats()

    def call(self, method: str, on_result: Callable) -> None:
        on_result(getattr(self.core, method)())

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    def shutdown(self) -> None:
        self.core.shutdown()  # the worker ranks, when they are other processes

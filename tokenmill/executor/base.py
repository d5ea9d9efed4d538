"""The executor: below the engine core, above the worker ranks. It sends each step (plain data) to
every rank and returns the sampled tokens of the last rank; the core never knows how many there are.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from concurrent.futures import Future

import msgspec

from tokenmill.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from tokenmill.structured_output.params import GrammarSpec


class StepMessage(msgspec.Struct, gc=False):
    """What one rank gets per step: the scheduler's deltas and, for ranks that do not sample (the
    earlier pipeline stages), the tokens the last stage sampled in the previous step."""

    sched: SchedulerOutput
    prev_sampled: dict[str, list[int]] = {}


class Executor(ABC):
    num_blocks: int  # KV cache blocks, the same on every rank
    max_model_len: int

    @abstractmethod
    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step on every rank; the last rank's sampled tokens. Raises WorkerDiedError when a
        rank is gone (fatal), another exception when the step failed on every rank (its batch fails)."""

    @abstractmethod
    def prepare_grammar(self, spec: GrammarSpec) -> Future:
        """The compiled grammar of a structured-output request (the core waits for it)."""

    def shutdown(self) -> None:  # noqa: B027 (optional: nothing to release in-process)
        """Stop the ranks and release what they hold."""


class RankedExecutor(Executor):
    """What executors of remote ranks share: the step messages (with the previous step's tokens for
    ranks that do not sample), the output decoding, and a grammar compiler in the engine's process
    (the core waits on it; the sampling ranks compile their own copy from the same spec)."""

    def _setup(self, config, source, model_config) -> None:
        p = config.parallel
        self.config, self.source, self.model_config = config, source, model_config
        self.first_sampling_rank = (p.pipeline_parallel_size - 1) * p.tensor_parallel_size
        self._prev_sampled: dict[str, list[int]] = {}
        self._grammars = None
        self._dead: str | None = None
        self._encode = msgspec.msgpack.Encoder().encode
        self._decode_out = msgspec.msgpack.Decoder(ModelRunnerOutput).decode

    def _messages(self, sched: SchedulerOutput) -> list[bytes]:
        """One encoded StepMessage per rank."""
        if self._dead is not None:
            from tokenmill.errors import WorkerDiedError

            raise WorkerDiedError(self._dead)
        plain = self._encode(StepMessage(sched))
        with_tokens = self._encode(StepMessage(sched, self._prev_sampled)) if self._prev_sampled else plain
        self._prev_sampled = {}  # delivered with this step, whatever becomes of it
        n = self.config.parallel.world_size
        return [plain if r >= self.first_sampling_rank else with_tokens for r in range(n)]

    def _output(self, data: bytes) -> ModelRunnerOutput:
        out = self._decode_out(data)
        self._prev_sampled = out.sampled_token_ids
        return out

    def prepare_grammar(self, spec: GrammarSpec) -> Future:
        if self._grammars is None:
            from tokenmill.worker.worker import make_grammar_compiler

            self._grammars = make_grammar_compiler(self.config, self.source, self.model_config)
        return self._grammars.submit(spec)

    def _close_grammars(self) -> None:
        if getattr(self, "_grammars", None) is not None:  # None too when start-up failed before _setup
            self._grammars.shutdown()
            self._grammars = None

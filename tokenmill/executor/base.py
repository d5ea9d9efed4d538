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

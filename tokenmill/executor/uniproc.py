"""One rank, in the engine's own process: the worker is called directly."""

from __future__ import annotations

from tokenmill.executor.base import Executor
from tokenmill.worker.worker import Worker


class UniProcExecutor(Executor):
    def __init__(self, config, source, model_config, progress: bool = True):
        self.worker = Worker(config, source, model_config, progress=progress)
        self.num_blocks = self.worker.num_blocks
        self.max_model_len = self.worker.max_model_len

    def execute(self, sched):
        return self.worker.runner.execute(sched)

    def prepare_grammar(self, spec):
        return self.worker.prepare_grammar(spec)

    def shutdown(self) -> None:
        self.worker.shutdown()

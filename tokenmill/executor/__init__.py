"""Executors: how the worker ranks are run (in-process, processes, Ray actors)."""

from __future__ import annotations

import logging

from tokenmill.config import EngineConfig
from tokenmill.executor.base import Executor, StepMessage
from tokenmill.worker.cpu_env import default_num_threads

logger = logging.getLogger(__name__)

__all__ = ["Executor", "StepMessage", "make_executor", "threads_per_rank"]


def threads_per_rank(config: EngineConfig) -> int:
    """--num-threads (default: every core) shared evenly by the ranks, at least one each."""
    total = config.parallel.num_threads or default_num_threads()
    return max(1, total // config.parallel.world_size)


def make_executor(config: EngineConfig, source, model_config, progress: bool = True) -> Executor:
    p = config.parallel
    if p.world_size == 1:
        from tokenmill.executor.uniproc import UniProcExecutor

        return UniProcExecutor(config, source, model_config, progress)
    total = p.num_threads or default_num_threads()
    logger.info("parallel: %d rank(s) (tensor %d x pipeline %d) as %s workers, %d thread(s) each of %d "
                "(--num-threads %s)", p.world_size, p.tensor_parallel_size, p.pipeline_parallel_size,
                p.distributed_executor_backend, threads_per_rank(config), total, p.num_threads or "default")
    if p.distributed_executor_backend == "ray":
        from tokenmill.executor.ray_executor import RayExecutor

        return RayExecutor(config, source, model_config, progress)
    from tokenmill.executor.multiproc import MultiprocExecutor

    return MultiprocExecutor(config, source, model_config, progress)

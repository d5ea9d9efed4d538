"""Executors: how the worker ranks are run (in-process, processes, Ray actors)."""

from __future__ import annotations

import logging
import os

from tokenmill.config import EngineConfig
from tokenmill.executor.base import Executor, StepMessage
from tokenmill.utils.cpu import default_num_threads, thread_share

logger = logging.getLogger(__name__)

__all__ = ["Executor", "StepMessage", "make_executor", "threads_per_rank"]


def threads_per_rank(config: EngineConfig) -> int:
    """--num-threads (default: every core) shared evenly by the ranks, at least one each."""
    return thread_share(config.parallel.num_threads, config.parallel.world_size)


def core_sharing(config: EngineConfig) -> tuple[str, bool]:
    """The start-up line that says how the ranks share this machine's cores, and whether they
    oversubscribe them."""
    p = config.parallel
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    total = p.num_threads or default_num_threads()
    origin = ("--num-threads" if p.num_threads else
              "$OMP_NUM_THREADS" if os.environ.get("OMP_NUM_THREADS") else "default: every core")
    per = threads_per_rank(config)
    line = (f"parallel: {p.world_size} ranks (tensor {p.tensor_parallel_size} x pipeline "
            f"{p.pipeline_parallel_size}) as {p.distributed_executor_backend} workers; {total} threads ({origin}) "
            f"shared as {per} per rank, {per * p.world_size} in all on {cores} cores here, not pinned")
    used = per * p.world_size
    if used > cores:
        return line + "; more threads than cores: the ranks will slow each other (fewer ranks, or more cores)", True
    if used > total:
        line += f" (at least one per rank: more than the {total} asked for)"
    elif used < total:
        line += f"; {total - used} thread(s) unused ({total} is not a multiple of {p.world_size} ranks)"
    return line, False


def make_executor(config: EngineConfig, source, model_config, progress: bool = True) -> Executor:
    p = config.parallel
    if p.world_size == 1:
        from tokenmill.executor.uniproc import UniProcExecutor

        return UniProcExecutor(config, source, model_config, progress)
    line, oversubscribed = core_sharing(config)
    (logger.warning if oversubscribed else logger.info)("%s", line)
    if p.distributed_executor_backend == "ray":
        from tokenmill.executor.ray_executor import RayExecutor

        return RayExecutor(config, source, model_config, progress)
    from tokenmill.executor.multiproc import MultiprocExecutor

    return MultiprocExecutor(config, source, model_config, progress)

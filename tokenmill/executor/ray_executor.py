"""Ranks as Ray actors (`--distributed-executor-backend ray`), so that they can live on other
machines of a Ray cluster. Same steps as the multiprocessing executor: one encoded StepMessage to
every actor, the last one's reply is the step's output. The ranks join torch.distributed at the
first actor's address. A dead actor raises RayActorError: WorkerDiedError, the engine reports it.
Without a cluster (`ray.init()` address unset) a local one is started on loopback."""

from __future__ import annotations

import logging
import os

from tokenmill.errors import ConfigError, WorkerDiedError
from tokenmill.executor import threads_per_rank
from tokenmill.executor.base import RankedExecutor

logger = logging.getLogger(__name__)


class _RankActor:
    def node_ip_and_port(self):
        import ray

        from tokenmill.utils.net import free_port

        return ray.util.get_node_ip_address(), free_port()

    def start(self, rank, config, source, model_config, init_method, num_threads):
        import torch

        torch.set_num_threads(num_threads)
        from tokenmill.executor.rank import RankWorker

        self.worker = RankWorker(rank, config, source, model_config, init_method, num_threads)
        return self.worker.ready_info

    def step(self, data: bytes):
        return self.worker.step(data)


class RayExecutor(RankedExecutor):
    def __init__(self, config, source, model_config, progress: bool = True):
        try:
            import ray
        except ImportError:
            raise ConfigError("distributed_executor_backend='ray' needs Ray: pip install 'tokenmill[ray]'",
                              param="distributed_executor_backend") from None
        p = config.parallel
        self._setup(config, source, model_config)
        if not ray.is_initialized():
            os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
            ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False, log_to_driver=False)
        self.ray = ray
        threads = threads_per_rank(config)
        actor_cls = ray.remote(num_cpus=0)(_RankActor)
        self.actors = [actor_cls.remote() for _ in range(p.world_size)]
        ip, port = ray.get(self.actors[0].node_ip_and_port.remote())
        init = f"tcp://{ip}:{port}"
        try:
            infos = ray.get([a.start.remote(r, config, source, model_config, init, threads)
                             for r, a in enumerate(self.actors)])
        except ray.exceptions.RayError as e:
            self.shutdown()
            raise WorkerDiedError(f"a Ray rank failed while loading the model: {e}") from e
        self.num_blocks, self.max_model_len = infos[0]
        self.timeout = p.collective_timeout + 10.0

    def execute(self, sched):
        refs = [a.step.remote(msg) for a, msg in zip(self.actors, self._messages(sched))]
        try:
            replies = self.ray.get(refs, timeout=self.timeout)
        except (self.ray.exceptions.RayActorError, self.ray.exceptions.GetTimeoutError) as e:
            self._dead = f"a Ray worker rank died or hung: {type(e).__name__}: {e}"
            self.shutdown()
            raise WorkerDiedError(self._dead) from e
        return self._output(replies[-1])

    def shutdown(self) -> None:
        self._close_grammars()
        for a in getattr(self, "actors", []):
            try:
                self.ray.kill(a)
            except Exception:  # noqa: BLE001 (already gone)
                pass
        self.actors = []

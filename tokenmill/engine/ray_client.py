"""Data-parallel replicas as Ray actors (`--distributed-executor-backend ray`).

Ray places each engine core on a node of the cluster: the one at $RAY_ADDRESS (`ray start --head`),
else a local one started here on loopback without a dashboard. The front end speaks to each actor
over the same ZMQ wire as to a local core process (engine/core_proc.py), over TCP on the Ray node
address; an actor's death shows as its `run` call failing, and the data-parallel client starts a
fresh actor through Ray in its place. Actors die with the driver (they are not detached).
"""

from __future__ import annotations

import logging
import os

from tokenmill.config import EngineConfig
from tokenmill.engine.dp_client import DPClient
from tokenmill.engine.mp_client import MPClient

logger = logging.getLogger(__name__)


def init_ray():
    """Join the cluster at $RAY_ADDRESS, or start a local one bound to loopback."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    import ray

    if not ray.is_initialized():
        if os.environ.get("RAY_ADDRESS"):
            ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=True)
        else:
            ray.init(include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=True,
                     num_cpus=os.cpu_count())
    return ray


class EngineCoreActor:
    """Runs the core loop of core_proc.py inside a Ray worker process."""

    def run(self, config: EngineConfig, input_addr: str, output_addr: str, replica: int) -> None:
        from tokenmill.engine.core_proc import run_engine_core

        run_engine_core(config, input_addr, output_addr, replica, watch_parent=False)

    def pid(self) -> int:
        return os.getpid()


class _ActorHandle:
    """What MPClient needs of its core's process (join, is_alive, kill, exitcode), for an actor."""

    sentinel = None

    def __init__(self, ray, actor, run_ref):
        self.ray, self.actor, self.run_ref = ray, actor, run_ref
        self.error: BaseException | None = None

    def _done(self, timeout: float) -> bool:
        ready, _ = self.ray.wait([self.run_ref], timeout=timeout)
        if ready and self.error is None:
            try:
                self.ray.get(self.run_ref)
                self.error = RuntimeError("the actor's core loop returned")
            except BaseException as e:  # noqa: BLE001 - RayActorError and the like
                self.error = e
        return bool(ready)

    def is_alive(self) -> bool:
        return not self._done(0)

    def join(self, timeout: float | None = None) -> None:
        self._done(timeout or 0)

    @property
    def exitcode(self):
        return None if self.error is None else 1

    @property
    def pid(self) -> str:
        return f"Ray actor {self.actor._actor_id.hex()[:12]}"

    def kill(self) -> None:
        self.ray.kill(self.actor, no_restart=True)


class RayCoreClient(MPClient):
    def _bind(self) -> tuple[str, str]:
        ray = init_ray()
        self._ipc_dir = None
        host = ray.util.get_node_ip_address()
        in_port = self._in.bind_to_random_port(f"tcp://{host}")
        out_port = self._out.bind_to_random_port(f"tcp://{host}")
        return f"tcp://{host}:{in_port}", f"tcp://{host}:{out_port}"

    def _start(self, config: EngineConfig, input_addr: str, output_addr: str, replica: int):
        ray = init_ray()
        threads = config.parallel.num_threads or 1
        actor_cls = ray.remote(num_cpus=threads, max_restarts=0)(EngineCoreActor)
        actor = actor_cls.options(name=None).remote()
        return _ActorHandle(ray, actor, actor.run.remote(config, input_addr, output_addr, replica))

    def check_dead(self) -> bool:
        return not self.proc.is_alive()

    def _death_cause(self) -> str:
        self.proc.join(0.5)
        cause = self.proc.error or "it is not responding"
        return f"the engine core ({self.proc.pid}) died: {str(cause).splitlines()[0]}"


class RayDPClient(DPClient):
    client_class = RayCoreClient

    @staticmethod
    def replica_config(config: EngineConfig, size: int) -> EngineConfig:
        return config  # each actor asks Ray for its cores, on whichever node it lands


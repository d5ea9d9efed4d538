"""How the engine's work is spread over cores, processes and machines (one group of EngineConfig)."""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.config.fields import check_bool, check_choice, check_positive, opt
from tokenmill.errors import ConfigError

EXECUTOR_BACKENDS = ("mp", "ray")


@dataclass
class ParallelConfig:
    """How the work is spread over cores, processes and machines."""

    num_threads: int | None = opt("Torch intra-op threads of the whole engine (default: $OMP_NUM_THREADS if set, "
                                  "else all cores); with several ranks each gets its share.")
    engine_core_process: bool | None = opt("Run the engine core (scheduler and model) in a process of its own, "
                                           "fed over ZMQ, so the HTTP front end never competes with it for the "
                                           "GIL. Default: yes for `serve`, no for the offline LLM.")
    tensor_parallel_size: int = opt("Ranks that split every layer (Megatron-style column/row splits, one all-reduce "
                                    "per attention block and per MLP).", 1)
    pipeline_parallel_size: int = opt("Stages that split the layers (each stage a rank group).", 1)
    data_parallel_size: int = opt("Engine cores (replicas of the model, each in its own process) behind one "
                                  "endpoint; a router picks one per request.", 1)
    router_policy: str = opt("How --data-parallel-size replicas are picked: affinity (the replica holding the "
                             "longest run of the prompt's leading KV blocks, balanced by outstanding tokens), "
                             "least_load, round_robin.", "affinity", choices=["affinity", "least_load", "round_robin"])
    distributed_executor_backend: str = opt("How worker ranks (tensor/pipeline parallelism) and data-parallel "
                                            "replicas are started: mp (processes on this machine) or ray (Ray "
                                            "actors on the cluster at $RAY_ADDRESS, else a local one).", "mp",
                                            choices=list(EXECUTOR_BACKENDS))
    collective_timeout: float = opt("Seconds a rank waits in a collective (all-reduce, send/recv) before it gives "
                                    "up: a dead or stuck rank becomes an error, not a hang.", 60.0)

    def validate(self) -> None:
        check_positive(self, "num_threads", "data_parallel_size", allow_none=True)
        check_positive(self, "tensor_parallel_size", "pipeline_parallel_size")
        check_choice(self, "router_policy", ("affinity", "least_load", "round_robin"))
        check_choice(self, "distributed_executor_backend", EXECUTOR_BACKENDS)
        if self.engine_core_process is not None:
            check_bool(self, "engine_core_process")
        t = self.collective_timeout
        if isinstance(t, bool) or not isinstance(t, (int, float)) or t <= 0:
            raise ConfigError(f"collective_timeout must be a positive number of seconds, got {t!r}",
                              param="collective_timeout")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

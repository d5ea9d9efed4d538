"""One worker rank: joins the process groups, loads its shard of the model, then runs steps.

Shared by the multiprocessing and Ray executors: `RankWorker.step(bytes)` decodes a StepMessage,
runs it, and returns the encoded ModelRunnerOutput on the last rank (None elsewhere).
"""

from __future__ import annotations

import json
import logging
import traceback

import msgspec

from tokenmill import distributed
from tokenmill.core.scheduler_output import ModelRunnerOutput
from tokenmill.executor.base import StepMessage

logger = logging.getLogger(__name__)


class RankWorker:
    def __init__(self, rank: int, config, source, model_config, init_method: str, num_threads: int,
                 progress: bool = False):
        from tokenmill.worker.worker import Worker

        p = config.parallel
        st = distributed.init_distributed(rank, p.tensor_parallel_size, p.pipeline_parallel_size, init_method,
                                          p.collective_timeout)
        self.rank, self.is_output = rank, rank == p.world_size - 1
        self.worker = Worker(config, source, model_config, progress=progress, num_threads=num_threads)
        logger.info("rank %d (tensor %d/%d, stage %d/%d): %d thread(s), %d of %d attention heads, KV %d heads%s",
                    rank, st.tp_rank, st.tp_size, st.pp_rank, st.pp_size, num_threads,
                    self.worker.model.kv_caches()[0].num_heads if self.worker.model.kv_caches() else 0,
                    model_config.num_attention_heads, self.worker.local_kv_heads,
                    "" if st.tp_size == 1 else
                    f", all-reduce {'in shared memory (gloo over 4 MiB)' if st.shm is not None else 'by gloo'}")
        self._decode = msgspec.msgpack.Decoder(StepMessage).decode
        self._encode = msgspec.msgpack.Encoder().encode

    @property
    def ready_info(self) -> tuple[int, int]:
        return self.worker.num_blocks, self.worker.max_model_len

    def step(self, data: bytes) -> bytes | None:
        msg = self._decode(data)
        out: ModelRunnerOutput = self.worker.runner.execute(msg.sched, msg.prev_sampled)
        stats = distributed.state().stats
        if stats.calls and logger.isEnabledFor(logging.DEBUG):  # benchmarks/tp_overhead.py reads these
            logger.debug("all-reduce stats %s", json.dumps(dict(tokens=msg.sched.total_num_scheduled_tokens,
                                                                calls=stats.calls, bytes=stats.bytes,
                                                                seconds=stats.seconds)))
            stats.calls = stats.bytes = 0
            stats.seconds = 0.0
        return self._encode(out) if self.is_output else None

    def close(self) -> None:
        self.worker.shutdown()
        distributed.destroy_distributed()


def describe_error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}\n{''.join(traceback.format_exception(e)[-6:])}"

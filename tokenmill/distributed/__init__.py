"""Process groups and the collectives the model's layers call (vLLM's parallel_state, small).

A process that never called `init_distributed` is rank 0 of 1: every collective is then a no-op, so
the layers are the same code with and without parallelism. Collectives time out after
`collective_timeout` seconds (set at init): a dead or stuck peer becomes an error, not a hang.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import socket
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


@dataclass
class CommStats:
    """Bytes and seconds spent in tensor-parallel all-reduces (for benchmarks)."""

    calls: int = 0
    bytes: int = 0
    seconds: float = 0.0


@dataclass
class ParallelState:
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    tp_group: object = None
    stats: CommStats = field(default_factory=CommStats)
    shm: object = None  # ShmAllReduce when the stage's tensor ranks share this machine

    @property
    def rank(self) -> int:
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def stage_rank(self, pp_rank: int) -> int:
        """Global rank of this rank's peer (same tp rank) in stage `pp_rank`."""
        return pp_rank * self.tp_size + self.tp_rank


_STATE = ParallelState()


def state() -> ParallelState:
    return _STATE


def init_distributed(rank: int, tp_size: int, pp_size: int, init_method: str, timeout_s: float,
                     backend: str | None = None) -> ParallelState:
    """Join the world (tp_size x pp_size ranks; rank = pp_rank * tp_size + tp_rank) and make one
    tensor-parallel group per pipeline stage."""
    global _STATE
    world = tp_size * pp_size
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world,
                            timeout=timedelta(seconds=timeout_s))
    groups = [dist.new_group(list(range(s * tp_size, (s + 1) * tp_size)), timeout=timedelta(seconds=timeout_s))
              for s in range(pp_size)]
    pp_rank, tp_rank = divmod(rank, tp_size)
    _STATE = ParallelState(tp_rank, tp_size, pp_rank, pp_size, groups[pp_rank])
    if tp_size > 1 and backend == "gloo":
        _STATE.shm = _shared_memory_all_reduce(init_method, groups[pp_rank], tp_rank, tp_size, pp_rank, timeout_s)
    return _STATE


def _shared_memory_all_reduce(init_method: str, group, tp_rank: int, tp_size: int, pp_rank: int,
                              timeout_s: float):
    """A shm.ShmAllReduce for this stage's tensor ranks when every one of them maps the same segment
    (same machine, same /dev/shm), else None (gloo). Every rank takes the same decision."""
    from tokenmill.distributed import shm

    def agree(ok: bool) -> bool:
        flags = [None] * tp_size
        dist.all_gather_object(flags, ok, group=group)
        return all(flags)

    here = None
    if shm.supported():
        with contextlib.suppress(OSError):
            with open("/proc/sys/kernel/random/boot_id") as f:
                here = socket.gethostname() + f.read().strip()
    hosts = [None] * tp_size
    dist.all_gather_object(hosts, here, group=group)
    if here is None or len(set(hosts)) != 1:
        return None
    name = f"tokenmill-allreduce-{hashlib.sha1(init_method.encode()).hexdigest()[:16]}-{pp_rank}"
    ar, error = None, None
    if tp_rank == 0:
        try:
            ar = shm.ShmAllReduce(name, tp_rank, tp_size, timeout_s, create=True)
        except OSError as e:
            error = e
    if agree(tp_rank != 0 or ar is not None) and tp_rank != 0:  # every rank makes the same collective calls
        try:
            ar = shm.ShmAllReduce(name, tp_rank, tp_size, timeout_s, create=False)
        except OSError as e:
            error = e
    if error is not None:
        logger.warning("shared-memory all-reduce unavailable (%s); using gloo", error)
    ok = agree(ar is not None)
    if tp_rank == 0 and ar is not None:
        ar.unlink()  # every rank has mapped it (or given up): the name is not needed any more
    if not ok:
        if ar is not None:
            ar.close()
        return None
    return ar


@contextlib.contextmanager
def whole_pipeline():
    """While inside, this rank acts as the only pipeline stage (its tensor-parallel group
    unchanged): a model built here holds every layer, e.g. the draft model of the last stage."""
    global _STATE
    saved = _STATE
    _STATE = dataclasses.replace(saved, pp_rank=0, pp_size=1)
    try:
        yield
    finally:
        _STATE = saved


def destroy_distributed() -> None:
    global _STATE
    if _STATE.shm is not None:
        _STATE.shm.close()
    if dist.is_initialized():
        dist.destroy_process_group()
    _STATE = ParallelState()


def tp_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over the tensor-parallel group, in place."""
    s = _STATE
    if s.tp_size == 1:
        return x
    t0 = time.perf_counter()
    if s.shm is not None and s.shm.fits(x):
        s.shm.all_reduce(x)
    else:
        dist.all_reduce(x, group=s.tp_group)
    s.stats.calls += 1
    s.stats.bytes += x.numel() * x.element_size()
    s.stats.seconds += time.perf_counter() - t0
    return x


def tp_all_gather_cols(x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """Concatenate each rank's [rows, sizes[r]] block along the columns (blocks padded to the
    largest for the collective, trimmed after)."""
    s = _STATE
    if s.tp_size == 1:
        return x
    width = max(sizes)
    if x.shape[1] < width:
        x = torch.nn.functional.pad(x, (0, width - x.shape[1]))
    parts = [torch.empty_like(x) for _ in range(s.tp_size)]
    dist.all_gather(parts, x.contiguous(), group=s.tp_group)
    return torch.cat([p[:, :n] for p, n in zip(parts, sizes)], dim=1)


def pp_isend(tensors: list[torch.Tensor], dst_stage: int, tag: int = 0) -> list[tuple[object, torch.Tensor]]:
    """Start sending `tensors` (tags tag, tag + 1, ...) to the same tensor rank of stage `dst_stage`;
    returns the pending sends, each with the tensor it must keep alive until `wait_all`."""
    dst = _STATE.stage_rank(dst_stage)
    out = []
    for i, t in enumerate(tensors):
        t = t.contiguous()
        out.append((dist.isend(t, dst, tag=tag + i), t))
    return out


def pp_irecv(shapes: list[tuple[int, ...]], dtype: torch.dtype, src_stage: int, tag: int = 0,
             device: torch.device | None = None) -> list[tuple[object, torch.Tensor]]:
    """Post receives for tensors sent by `pp_isend(..., tag)` from stage `src_stage`."""
    src = _STATE.stage_rank(src_stage)
    out = []
    for i, shape in enumerate(shapes):
        t = torch.empty(shape, dtype=dtype, device=device)
        out.append((dist.irecv(t, src, tag=tag + i), t))
    return out


def wait_all(pending: list[tuple[object, torch.Tensor]]) -> list[torch.Tensor]:
    """Wait for sends or receives (each fails after the collective timeout); their tensors."""
    for work, _ in pending:
        work.wait()
    return [t for _, t in pending]

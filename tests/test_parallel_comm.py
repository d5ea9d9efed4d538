"""The collectives and core sharing of tensor-parallel ranks: the shared-memory all-reduce against
exact sums (two real processes), and the start-up line that says how the ranks share the cores."""

from __future__ import annotations

import hashlib
import os

from tokenmill.config import EngineConfig


def _all_reduce_rank(rank, port, queue):
    import torch

    from tokenmill import distributed

    st = distributed.init_distributed(rank, 2, 1, f"tcp://127.0.0.1:{port}", 30.0)
    try:
        checks = []
        for dtype in (torch.float32, torch.bfloat16):
            for rows in (1, 64, 3000):  # 3000 x 576 fp32 is more than a slot: gloo
                mine, other = (torch.randn(rows, 576, generator=torch.Generator().manual_seed(10 * rows + r))
                               .to(dtype) for r in (rank, 1 - rank))
                expect = (mine + other) if rank == 0 else (other + mine)  # rank order
                checks.append(torch.equal(distributed.tp_all_reduce(mine.clone()), expect))
                strided = mine.t()  # not contiguous
                checks.append(torch.equal(distributed.tp_all_reduce(strided.clone()), expect.t()))
        for i in range(300):  # back-to-back calls, alternating slot sets, different sizes
            x = torch.full((1 + i % 5, 8), float(rank + i))
            checks.append(bool((distributed.tp_all_reduce(x) == 2 * i + 1).all()))
        queue.put((rank, st.shm is not None, checks))
    finally:
        distributed.destroy_distributed()


def test_shared_memory_all_reduce_matches_the_sum():
    """Two ranks on this machine all-reduce through /dev/shm (gloo beyond a slot): exact sums in rank
    order, contiguous or not, over many back-to-back calls; the segment's name is gone once mapped."""
    import multiprocessing as mp

    from tokenmill.distributed import shm
    from tokenmill.executor.multiproc import free_port

    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=_all_reduce_rank, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    results = dict((r, (used, checks)) for r, used, checks in (queue.get(timeout=120) for _ in procs))
    for p in procs:
        p.join(30)
    for used, checks in results.values():
        assert used == shm.supported()
        assert all(checks), checks
    name = hashlib.sha1(f"tcp://127.0.0.1:{port}".encode()).hexdigest()[:16]
    assert not [f for f in os.listdir("/dev/shm") if name in f]


def test_startup_line_says_how_cores_are_shared(monkeypatch):
    from tokenmill.executor import core_sharing

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    line, over = core_sharing(EngineConfig.from_kwargs(tensor_parallel_size=2, num_threads=4))
    assert not over and "2 ranks (tensor 2 x pipeline 1)" in line and "4 threads (--num-threads)" in line
    assert "2 per rank, 4 in all on 4 cores" in line
    line, over = core_sharing(EngineConfig.from_kwargs(pipeline_parallel_size=2, num_threads=5))
    assert not over and "1 thread(s) unused" in line
    line, over = core_sharing(EngineConfig.from_kwargs(tensor_parallel_size=4, pipeline_parallel_size=2, num_threads=4))
    assert over and "8 in all on 4 cores" in line and "slow each other" in line

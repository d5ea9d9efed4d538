"""Ranks as processes on this machine (the default with several ranks).

Each rank is a spawned process joined to the others by torch.distributed (gloo on CPU, NCCL on
CUDA) over loopback. The executor talks to each through a pipe: one encoded StepMessage out to all,
one reply back from each (the last rank's holds the sampled tokens). It waits on the replies and
on the processes' sentinels together, so a rank that dies is noticed at once: the step raises
WorkerDiedError and the engine reports itself dead; the other ranks give up their collectives
after --collective-timeout at worst, and are terminated.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import time
import weakref
from multiprocessing.connection import wait

from tokenmill.errors import ConfigError, WorkerDiedError
from tokenmill.executor import threads_per_rank
from tokenmill.executor.base import RankedExecutor
from tokenmill.executor.rank import describe_error
from tokenmill.utils.net import free_port

logger = logging.getLogger(__name__)

_LOAD_TIMEOUT_S = 600.0
_ERROR_GRACE_S = 10.0  # after one rank's error, how long the others get to report theirs


def _rank_main(rank, config, source, model_config, init_method, num_threads, conn, log_level, progress):
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the engine process handles Ctrl-C and stops us
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s [rank {rank}] %(name)s: %(message)s")
    from tokenmill.executor.rank import RankWorker

    try:
        worker = RankWorker(rank, config, source, model_config, init_method, num_threads, progress)
        conn.send(("ready", worker.ready_info))
    except BaseException as e:  # noqa: BLE001 (reported to the engine, then this process ends)
        conn.send(("error", describe_error(e), isinstance(e, ConfigError)))
        return
    while True:
        try:
            data = conn.recv_bytes()
        except (EOFError, OSError):  # the engine process is gone
            break
        if data == b"shutdown":
            break
        try:
            conn.send(("ok", worker.step(data)))
        except BaseException as e:  # noqa: BLE001
            logger.exception("step failed")
            conn.send(("error", describe_error(e), False))
    worker.close()


class MultiprocExecutor(RankedExecutor):
    def __init__(self, config, source, model_config, progress: bool = True):
        p = config.parallel
        self._setup(config, source, model_config)
        self.world_size, self.timeout = p.world_size, p.collective_timeout
        ctx = mp.get_context("spawn")
        init = f"tcp://127.0.0.1:{free_port()}"
        threads = threads_per_rank(config)
        self.procs, self.conns = [], []
        for rank in range(self.world_size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_rank_main, name=f"tokenmill-rank{rank}", daemon=True,
                               args=(rank, config, source, model_config, init, threads, child,
                                     logging.getLogger().getEffectiveLevel(), progress and rank == 0))
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)
        self._finalizer = weakref.finalize(self, _stop, self.procs, self.conns)
        try:
            infos = self._collect(_LOAD_TIMEOUT_S, "loading the model")
        except BaseException:
            self.shutdown()
            raise
        if len(set(infos)) != 1:
            self.shutdown()
            raise WorkerDiedError(f"ranks disagree on the KV cache: {infos}")
        self.num_blocks, self.max_model_len = infos[0]

    def execute(self, sched):
        for rank, (conn, msg) in enumerate(zip(self.conns, self._messages(sched))):
            try:
                conn.send_bytes(msg)
            except OSError as e:
                self._fail(f"cannot reach rank {rank}: {e}")
        return self._output(self._collect(self.timeout + 10.0, "a step")[-1])

    def _collect(self, timeout: float, what: str) -> list:
        """Every rank's reply; raises for errors, dead ranks and silence past `timeout`."""
        replies: dict[int, tuple] = {}
        deadline = time.monotonic() + timeout
        sentinels = {p.sentinel: r for r, p in enumerate(self.procs)}
        while len(replies) < self.world_size:
            pending = {self.conns[r]: r for r in range(self.world_size) if r not in replies}
            watch = [obj for obj, r in sentinels.items() if r not in replies]  # a replied rank may exit
            ready = wait([*pending, *watch], timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                if any(rep[0] == "error" for rep in replies.values()):
                    break  # the others are stuck waiting for the failed rank: report its error
                self._fail(f"no reply from rank(s) {sorted(pending.values())} within {timeout:.0f}s during {what}")
            # replies first: a rank that reported an error and exited is not a rank that died
            dead = [sentinels[obj] for obj in ready if obj in sentinels]
            for conn, r in pending.items():
                if conn in ready or (r in dead and conn.poll()):
                    try:
                        replies[r] = conn.recv()
                    except (EOFError, OSError):
                        continue  # its sentinel says why
                    if replies[r][0] == "error":  # the others fail alike at once, or hang
                        deadline = min(deadline, time.monotonic() + _ERROR_GRACE_S)
            for r in dead:
                if r not in replies:
                    self._fail(f"worker rank {r} (pid {self.procs[r].pid}) died during {what} "
                               f"(exit code {self.procs[r].exitcode})")
        errors = {r: rep for r, rep in replies.items() if rep[0] == "error"}
        if errors:
            r, first = min(errors.items())
            if len(errors) == self.world_size and len({e[1].split("\n")[0] for e in errors.values()}) == 1:
                if what == "loading the model" and first[2]:
                    self.shutdown()
                    raise ConfigError(first[1].split("\n")[0].split(": ", 1)[-1])
                if what != "loading the model":
                    raise RuntimeError(f"every rank failed the step: {first[1]}")  # the batch fails, ranks in step
            self._fail(f"rank {r} failed during {what}: {first[1]}")
        return [replies[r][1] for r in range(self.world_size)]

    def _fail(self, reason: str):
        self._dead = reason
        logger.error("%s; stopping the worker ranks", reason)
        self.shutdown()
        raise WorkerDiedError(reason)

    def shutdown(self) -> None:
        self._close_grammars()
        self._finalizer()


def _stop(procs, conns, grace: float = 5.0) -> None:
    for conn in conns:
        try:
            conn.send_bytes(b"shutdown")
        except OSError:
            pass
    deadline = time.monotonic() + grace
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
        if p.is_alive():
            p.terminate()
            p.join(1.0)
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
            p.join()
    for conn in conns:
        conn.close()

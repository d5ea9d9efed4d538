"""All-reduce through shared memory for tensor-parallel ranks on one machine (vLLM's CPU backend
does the same in C++).

gloo over loopback TCP costs about a millisecond per all-reduce on a small VM (BENCHMARKS.md), and a
decode step makes two per layer. Here each rank copies its tensor into its slot of a /dev/shm
segment, publishes the call's sequence number, waits for every rank's (spinning, then yielding the
core), and sums the slots in rank order, so every rank gets the same bits. Two sets of slots
alternate: a rank may write call n + 1 while the others still read call n, and it reaches call
n + 2 only after they all published n + 1, i.e. finished reading n. Only on x86, where one core's
stores are seen by the others in the order made; tensors larger than a slot go through gloo.
"""

from __future__ import annotations

import mmap
import os
import platform
import time

import numpy as np
import torch

SLOT_BYTES = 4 << 20
_LINE = 64  # one cache line per rank's sequence number
_SPIN_S = 50e-6  # busy-wait this long, then yield the core to other processes
_YIELD_S = 2e-3  # then sleep between looks (ranks sharing cores with others)


def supported() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64") and os.path.isdir("/dev/shm")


class ShmAllReduce:
    def __init__(self, name: str, rank: int, world: int, timeout_s: float, create: bool):
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        self.path = f"/dev/shm/{name}"
        size = _LINE * world + 2 * world * SLOT_BYTES
        fd = os.open(self.path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                os.posix_fallocate(fd, 0, size)  # tmpfs space now, not a SIGBUS at the first write
            self._mm = mmap.mmap(fd, size)
        except OSError:
            if create:
                self.unlink()
            raise
        finally:
            os.close(fd)
        raw = np.frombuffer(self._mm, dtype=np.int64, count=_LINE * world // 8)
        self._seq = raw[::_LINE // 8]  # a strided view: rank r's number at the start of line r
        self._data = torch.frombuffer(self._mm, dtype=torch.uint8, offset=_LINE * world)
        self._calls = 0

    def unlink(self) -> None:
        """Remove the name once every rank has mapped it: nothing is left behind, however we end."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def fits(self, x: torch.Tensor) -> bool:
        return x.numel() * x.element_size() <= SLOT_BYTES and x.device.type == "cpu"

    def _slot(self, parity: int, rank: int, x: torch.Tensor) -> torch.Tensor:
        start = (parity * self.world + rank) * SLOT_BYTES
        return self._data[start:start + x.numel() * x.element_size()].view(x.dtype)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over the ranks, in place."""
        self._calls += 1
        n, parity = self._calls, self._calls % 2
        flat = x.view(-1) if x.is_contiguous() else x.reshape(-1)
        self._slot(parity, self.rank, flat).copy_(flat)
        self._seq[self.rank] = n  # after the data (x86 keeps the order of stores)
        self._wait(n)
        flat.copy_(self._slot(parity, 0, flat))
        for r in range(1, self.world):
            flat.add_(self._slot(parity, r, flat))
        if not x.is_contiguous():
            x.copy_(flat.view(x.shape))
        return x

    def _wait(self, n: int) -> None:
        seq = self._seq
        if seq.min() >= n:
            return
        t0 = time.perf_counter()
        while seq.min() < n:
            elapsed = time.perf_counter() - t0
            if elapsed > _YIELD_S:
                if elapsed > self.timeout_s:
                    late = [r for r in range(self.world) if seq[r] < n]
                    raise RuntimeError(f"shared-memory all-reduce: rank(s) {late} did not arrive within "
                                       f"{self.timeout_s:.0f}s")
                time.sleep(50e-6)
            elif elapsed > _SPIN_S:
                os.sched_yield()

    def close(self) -> None:
        self._data = self._seq = None
        try:
            self._mm.close()
        except BufferError:  # a tensor still views it: the mapping goes when that does
            pass

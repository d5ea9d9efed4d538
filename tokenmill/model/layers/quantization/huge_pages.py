"""Packed weights in memory the kernel can back with 2 MiB pages.

A decode step streams every layer's packed weights once. Each layer's tensor is under the 2 MiB
that PyTorch's allocator asks huge pages for (THP_MEM_ALLOC_ENABLE), so they sat on 4 KiB pages:
SmolLM2's 126 MB over ~31,000 of them, a TLB miss every 4 KiB of a step's weight stream. Here
layers take consecutive slices of 32 MiB chunks, 2 MiB-aligned and advised MADV_HUGEPAGE (one
AMD EPYC Zen 3: a one-row SmolLM2 step 4% faster, BENCHMARKS.md). A slice keeps its chunk alive.
"""

from __future__ import annotations

import torch

from tokenmill.utils.memory import anonymous_bytes

_CHUNK = 32 << 20
_ALIGN = 64


class _Arena:
    def __init__(self) -> None:
        self.chunk: torch.Tensor | None = None
        self.used = 0

    def take(self, nbytes: int) -> torch.Tensor:
        if nbytes > _CHUNK // 4:
            return anonymous_bytes(nbytes, huge=True)
        if self.chunk is None or self.used + nbytes > self.chunk.numel():
            self.chunk, self.used = anonymous_bytes(_CHUNK, huge=True), 0
        out = self.chunk[self.used:self.used + nbytes]
        self.used += (nbytes + _ALIGN - 1) // _ALIGN * _ALIGN
        return out


_arena = _Arena()


def packed_weight_storage(nbytes: int, device) -> torch.Tensor:
    """An uninitialized uint8 tensor of nbytes for a layer's packed weights."""
    if torch.device(device or "cpu").type != "cpu":
        return torch.empty(nbytes, dtype=torch.uint8, device=device)
    return _arena.take(nbytes)

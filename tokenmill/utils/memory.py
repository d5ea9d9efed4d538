"""CPU tensors in fresh anonymous memory.

The OS maps such pages on first write and guarantees they read as zero, so a 4 GiB KV cache costs
nothing at start-up (torch.zeros writes all of it: seconds) and its RSS grows only as blocks are
used. `huge=True` starts the tensor on a 2 MiB boundary and advises MADV_HUGEPAGE: PyTorch's
allocator asks for huge pages only for allocations of 2 MiB and more, so smaller tensors streamed
every step (a layer's packed weights) took a TLB miss every 4 KiB. The tensor keeps its mapping alive.
"""

from __future__ import annotations

import math
import mmap

import torch

HUGE_PAGE = 2 << 20


def anonymous_bytes(nbytes: int, huge: bool = False) -> torch.Tensor:
    """A uint8 tensor of nbytes fresh zero bytes; with huge, 2 MiB-aligned and advised huge pages."""
    pad = HUGE_PAGE if huge else 0
    buffer = mmap.mmap(-1, max(nbytes, 1) + pad, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if huge and hasattr(mmap, "MADV_HUGEPAGE"):
        buffer.madvise(mmap.MADV_HUGEPAGE)
    whole = torch.frombuffer(buffer, dtype=torch.uint8, count=max(nbytes, 1) + pad)
    skip = -whole.data_ptr() % HUGE_PAGE if huge else 0
    return whole[skip:skip + nbytes]


def zeroed_cpu_tensor(shape: tuple[int, ...], dtype: torch.dtype, huge: bool = False) -> torch.Tensor:
    """A zero tensor of `shape` in fresh anonymous memory (see the module)."""
    return anonymous_bytes(math.prod(shape) * dtype.itemsize, huge).view(dtype).view(shape)


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device) -> torch.Tensor:
    """Zeros on `device`: on the CPU in fresh anonymous memory (a KV cache's pages are mapped as its
    blocks are used, not all written at start-up)."""
    if torch.device(device).type == "cpu":
        return zeroed_cpu_tensor(shape, dtype)
    return torch.zeros(shape, dtype=dtype, device=device)

"""Process-level CPU settings for the engine."""

from __future__ import annotations

import ctypes
import functools
import logging
import sys

import torch

from tokenmill.utils.cpu import cap_onednn, default_num_threads

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_MMAP_MAX = -1, -3, -4
_DEFAULT_MMAP_MAX = 65536  # glibc's


def configure_cpu(num_threads: int | None) -> None:
    cap_onednn()
    torch.set_num_threads(num_threads or default_num_threads())
    _keep_freed_memory()


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """glibc, or None (another platform or C library: the allocator is left as it is)."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL("libc.so.6")
            if hasattr(libc, "mallopt") and hasattr(libc, "malloc_trim"):
                return libc
        except OSError:
            pass
    logger.debug("mallopt unavailable; leaving the allocator as is")
    return None


def _keep_freed_memory() -> None:
    """glibc returns big freed buffers (logits, activations: MBs each) to the OS and page-faults
    them back in on the next step, ~1 us per 4 KiB page (~4 in this project's VMs): a third of the
    sampler's time. Never trim the heap; while loading, buffers over 32 MiB (load-time temporaries,
    the KV cache) are still mapped apart, so that freeing them gives the memory back."""
    if (libc := _libc()) is not None:
        libc.mallopt(_M_MMAP_THRESHOLD, 32 * 1024 * 1024)
        libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30)
        libc.mallopt(_M_MMAP_MAX, _DEFAULT_MMAP_MAX)


def serve_steps_from_heap() -> None:
    """Once the weights and the KV cache are allocated: every later buffer from the heap, also
    those over 32 MiB (a 2048-token prefill step of Qwen2.5-Coder-1.5B has a 70 MiB MLP activation;
    mapped apart, `bench throughput` of 16 x 512 prompt tokens took 1.2M page faults against 280k,
    and 1.08x the time, in a VM). The freed load-time memory goes back to the OS first."""
    if (libc := _libc()) is not None:
        libc.malloc_trim(0)
        libc.mallopt(_M_MMAP_MAX, 0)


def release_freed_memory() -> None:
    """Give the heap's free pages back (an engine shut down in a process that goes on)."""
    if (libc := _libc()) is not None:
        libc.malloc_trim(0)

"""Process-level CPU settings for the engine."""

from __future__ import annotations

import ctypes
import logging
import os
import sys

import torch

from tokenmill.utils.cpu import cap_onednn

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def configure_cpu(num_threads: int | None) -> None:
    cap_onednn()
    torch.set_num_threads(num_threads or default_num_threads())
    _keep_freed_memory()


def default_num_threads() -> int:
    """$OMP_NUM_THREADS when set (as torch itself reads it), else every core."""
    try:
        return max(1, int(os.environ["OMP_NUM_THREADS"]))
    except (KeyError, ValueError):
        return os.cpu_count() or 1


def _keep_freed_memory() -> None:
    """glibc returns big freed buffers (logits, activations: MBs each) to the OS and page-faults
    them back in on the next step, ~1 us per 4 KiB page: a third of the sampler's time. Serve
    buffers up to 32 MiB from the heap and never trim it."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt(_M_MMAP_THRESHOLD, 32 * 1024 * 1024)
        libc.mallopt(_M_TRIM_THRESHOLD, 1 << 30)
    except (OSError, AttributeError):  # not glibc
        logger.debug("mallopt unavailable; leaving the allocator as is")

"""Loopback helpers shared by the executors, the benchmarks and calibration."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, exited: Callable[[], str | None], timeout: float, poll: float = 0.2) -> None:
    """Poll `url`/health until it answers 200. `exited()` returns why the server is gone (then this
    raises RuntimeError with it) or None while it runs; TimeoutError after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        gone = exited()
        if gone is not None:
            raise RuntimeError(gone)
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(poll)
    raise TimeoutError(f"{url} was not ready after {timeout:.0f}s")

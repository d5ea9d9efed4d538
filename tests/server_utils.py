"""Start `tokenmill serve` as a real process on a free loopback port."""

from __future__ import annotations

import signal
import subprocess
import time

from tokenmill.bench.server_process import ServerProcess as _ServerProcess
from tokenmill.bench.server_process import free_port  # noqa: F401 (the tests' import of it)

SMALL = ["--kv-cache-memory", "192MiB", "--max-model-len", "2048"]


class ServerProcess(_ServerProcess):
    """A small server (192 MiB of KV cache, 2048-token context) unless the args say otherwise."""

    def __init__(self, *args: str, env: dict | None = None, port: int | None = None):
        super().__init__(*SMALL, *args, env=env, port=port)

    def wait_idle(self, timeout: float = 20.0) -> dict[str, float]:
        """Poll /metrics until nothing runs and the KV cache is empty (fails after `timeout`)."""
        deadline = time.monotonic() + timeout
        m = {}
        while time.monotonic() < deadline:
            m = self.metrics()
            if (m.get("tokenmill:kv_cache_usage_perc") == 0.0 and m.get("tokenmill:num_requests_running") == 0
                    and m.get("tokenmill:num_requests_waiting") == 0):
                return m
            time.sleep(0.1)
        raise AssertionError(f"engine not idle after {timeout}s: {m}")


def serve_until_exit(*args: str, env: dict | None = None, timeout: float = 120.0) -> tuple[int, str]:
    """Run `tokenmill serve` expecting it to stop on its own (a start-up failure): (exit code, log)."""
    srv = ServerProcess(*args, env=env)
    try:
        code = srv.proc.wait(timeout)
    except subprocess.TimeoutExpired:
        srv.stop(signal.SIGKILL)
        raise AssertionError(f"the server did not exit within {timeout}s:\n{srv.log()}") from None
    return code, srv.log()

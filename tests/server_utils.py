"""Start `tokenmill serve` as a real process on a free loopback port."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

SMALL = ["--kv-cache-memory", "192MiB", "--max-model-len", "2048"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    def __init__(self, *args: str, env: dict | None = None, port: int | None = None):
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_file = tempfile.NamedTemporaryFile(prefix="tokenmill-serve-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "tokenmill.entrypoints.cli.main", "serve", "--port", str(self.port), *SMALL, *args]
        self.proc = subprocess.Popen(cmd, stdout=self.log_file, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def log(self) -> str:
        with open(self.log_file.name) as f:
            return f.read()

    def wait_ready(self, timeout: float = 180.0) -> ServerProcess:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not ready after {timeout}s:\n{self.log()}")

    def stop(self, sig=signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def metrics(self) -> dict[str, float]:
        """Unlabelled view of /metrics: metric name -> value (the last sample of each name)."""
        out = {}
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line and not line.startswith("#"):
                name_labels, value = line.rsplit(" ", 1)
                out[name_labels.split("{")[0]] = float(value)
        return out

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

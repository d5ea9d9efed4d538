"""Start `tokenmill serve` as a real process on a free loopback port."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil

from tokenmill.bench.server_process import ServerProcess as _ServerProcess
from tokenmill.bench.server_process import free_port  # noqa: F401 (the tests' import of it)
from tokenmill.model.loader.cache import cache_root

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


def checked_server(*args: str) -> Iterator[ServerProcess]:
    """A module fixture's server (`yield from`): after the module it must stop with exit status 0,
    with no traceback in its log (every error was handled, none crashed a handler)."""
    srv = ServerProcess(*args).wait_ready()
    yield srv
    assert srv.stop() == 0, srv.log()
    assert "Traceback" not in srv.log(), srv.log()


def suffix_schema(server) -> dict:
    """What the server's /openapi.json says of /v1/completions' `suffix`."""
    schemas = httpx.get(server.url + "/openapi.json").json()["components"]["schemas"]
    return schemas["CompletionRequest"]["properties"]["suffix"]


def ipc_folders(pid: int) -> set[Path]:
    """The folders of the ipc:// sockets a front end bound for its engine core."""
    paths = [Path(c.laddr) for c in psutil.Process(pid).net_connections(kind="unix") if c.laddr]
    return {p.parent for p in paths if p.parent.name.startswith("tokenmill-core-")}


def serve_until_exit(*args: str, env: dict | None = None, timeout: float = 120.0) -> tuple[int, str]:
    """Run `tokenmill serve` expecting it to stop on its own (a start-up failure): (exit code, log)."""
    srv = ServerProcess(*args, env=env)
    try:
        code = srv.proc.wait(timeout)
    except subprocess.TimeoutExpired:
        srv.stop(signal.SIGKILL)
        raise AssertionError(f"the server did not exit within {timeout}s:\n{srv.log()}") from None
    srv.stop()  # it has exited: this keeps its log and removes the file
    return code, srv.log()


def private_cache(cache: Path, *, rebuild: str | None = None, model_files: bool = False) -> Path:
    """A private TOKENMILL_CACHE_DIR whose compiled kernels are the session's (symlinks): building
    every library again in each private cache costs a minute and is not what such a test is about.
    `rebuild`: the library left out (every ISA's build of it), which this cache builds itself.
    `model_files`: share the session's converted model files too (GGUF metadata, tokenizers)."""
    shared = cache_root()
    cache.mkdir(parents=True, exist_ok=True)
    (shared / "kernels").mkdir(parents=True, exist_ok=True)
    if rebuild is None:
        (cache / "kernels").symlink_to(shared / "kernels", target_is_directory=True)
    else:
        (cache / "kernels").mkdir()
        for key in (shared / "kernels").iterdir():
            if key.is_dir() and not (key / f"{rebuild}.so").exists():
                (cache / "kernels" / key.name).symlink_to(key, target_is_directory=True)
    if model_files:
        for entry in shared.iterdir():
            if entry.is_dir() and entry.name not in ("kernels", "profiles"):
                (cache / entry.name).symlink_to(entry, target_is_directory=True)
    return cache

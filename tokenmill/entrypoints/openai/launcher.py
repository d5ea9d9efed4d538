"""Runs the app under uvicorn with tokenmill's shutdown: SIGTERM/SIGINT drain (new requests get
503, in-flight ones finish, up to --shutdown-grace seconds), then the process exits 0."""

from __future__ import annotations

import asyncio
import atexit
import errno
import logging
import os
import socket
import sys
import time

from tokenmill.config import EngineConfig, ServerConfig
from tokenmill.errors import ConfigError, ServiceUnavailableError

logger = logging.getLogger("tokenmill.server")


class _Server:
    """uvicorn with tokenmill's shutdown: the first SIGTERM/SIGINT drains (new requests get 503,
    in-flight ones finish for up to `shutdown_grace` seconds), a second one exits at once."""

    def __init__(self, engine_config: EngineConfig, config: ServerConfig, log_level: str = "info", core_client=None):
        import uvicorn

        from tokenmill.entrypoints.openai.api_server import build_app

        self.exit_code = 0
        self.app = build_app(engine_config, config, on_load_failure=self._load_failed, core_client=core_client)
        self.state = self.app.state.server
        self.config = config
        server = self

        class Server(uvicorn.Server):
            def handle_exit(self, sig, frame):  # runs in the main thread, which runs the loop
                server._on_signal(sig)

        uv_config = uvicorn.Config(self.app, host=config.host, port=config.port, log_level=log_level,
                                   access_log=False, log_config=None, timeout_graceful_shutdown=5,
                                   loop="auto", http="auto")
        self.uvicorn = Server(uv_config)
        self.loop: asyncio.AbstractEventLoop | None = None

    def _load_failed(self, error: BaseException) -> None:
        self.exit_code = 1
        self.uvicorn.should_exit = True

    def _on_signal(self, sig) -> None:
        if self.state.draining or self.state.engine is None or self.loop is None:
            self.uvicorn.should_exit = True
            if self.state.draining:
                self.uvicorn.force_exit = True
            return
        self.state.draining = True
        logger.info("signal %s: draining (up to %.0fs) before exit", sig, self.config.shutdown_grace)
        self.loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.config.shutdown_grace
        while self.state.engine.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        left = self.state.engine.num_in_flight
        if left:
            logger.warning("grace period over: %d request(s) still running end with an error", left)
            self.state.engine.fail_all(ServiceUnavailableError("the server shut down before this request finished"))
            deadline = time.monotonic() + 5.0  # let their error events reach the clients
            while self.state.engine.num_in_flight and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        self.uvicorn.should_exit = True

    async def serve(self, sock: socket.socket) -> int:
        self.loop = asyncio.get_running_loop()
        await self.uvicorn.serve(sockets=[sock])
        return self.exit_code


def listen_socket(host: str, port: int) -> socket.socket:
    """Bind the port before anything else starts, so that a port in use is one clear error, not a
    model load cut short."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as e:
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror}", param="host") from None
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        hint = "; another process is listening there (choose one with --port)" if e.errno == errno.EADDRINUSE else ""
        raise ConfigError(f"cannot listen on {host}:{port}: {e.strerror}{hint}", param="port") from None
    return sock


def run_server(engine_config: EngineConfig, config: ServerConfig, log_level: str = "info") -> int:
    parallel = engine_config.parallel
    if parallel.distributed_executor_backend == "ray" and parallel.data_parallel_size > 1:
        from tokenmill.engine.ray_client import init_ray

        # here, not on the loading thread: a local Ray's processes die with the thread that started them
        init_ray()
    sock = listen_socket(config.host, config.port)
    core = start_core_process(engine_config)
    try:
        server = _Server(engine_config, config, log_level, core)  # e.g. refuses --profile of another machine
    except BaseException:
        sock.close()
        if core is not None:
            core.shutdown()
        raise
    try:
        import uvloop

        return uvloop.run(server.serve(sock))
    except ImportError:
        return asyncio.run(server.serve(sock))
    finally:
        if core is not None:
            core.shutdown()  # a no-op once the engine stopped it; here when the server stopped mid-load


def start_core_process(engine_config: EngineConfig):
    """The engine core's process, started before the front end imports FastAPI and the tokenizer
    (~1.5 s here, which the core's own imports and load now overlap). None where the engine starts
    its own cores (in process, or data-parallel replicas), and on a cold start: a GGUF not indexed
    yet is read once, by the front end, before its core starts (as the engine does by itself)."""
    parallel = engine_config.parallel
    if parallel.engine_core_process is False or parallel.data_parallel_size > 1:
        return None
    from tokenmill.model.loader import metadata_cached, resolve_model

    try:
        if not metadata_cached(resolve_model(engine_config.model.model)):
            return None
    except ConfigError:
        return None  # the engine reports it, as without this start
    from tokenmill.engine.mp_client import MPClient

    return MPClient(engine_config, wait=False)


def exit_process(code: int) -> None:
    """Exit once the server has stopped: the exit handlers run (logs flushed, child processes
    joined), the interpreter's teardown does not. Freeing every module and object of the front end
    (torch, FastAPI, the tokenizer) took 0.8 s of CPU after the server had already stopped."""
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)

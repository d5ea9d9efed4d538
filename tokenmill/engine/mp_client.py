"""The engine core in a process of its own, over ZMQ (`tokenmill serve`'s default): requests and
aborts go out as msgspec messages, each step's EngineCoreOutputs come back. `get_output(interrupt)`
also returns early (empty outputs) when the `interrupt` file descriptor turns readable, so its
caller can send new requests without waiting for a step to finish."""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.util
import os
import signal
import tempfile
import threading
import time
from collections.abc import Callable

import msgspec
import zmq

from tokenmill.config import EngineConfig
from tokenmill.core.messages import EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from tokenmill.engine import core_proc as wire
from tokenmill.engine.core_client import EngineCoreClient
from tokenmill.errors import ConfigError, EngineDeadError, EngineStepError

logger = logging.getLogger(__name__)

_START_TIMEOUT_S = 900.0  # loading a large model from a slow disk
_STOP_TIMEOUT_S = 5.0
_POLL_MS = 1000


class MPClient(EngineCoreClient):
    """Starts the core process and owns its two sockets; used from one thread (the engine thread),
    except `shutdown`, which may come from any thread once that thread is done."""

    runs_in_process = False

    def __init__(self, config: EngineConfig, replica: int = 0, wait: bool = True):
        """wait=False: return once the process is started; call wait_ready() before use (so that
        several replicas load at once)."""
        self._ctx = zmq.Context()
        self._in = self._ctx.socket(zmq.PUSH)
        self._out = self._ctx.socket(zmq.PULL)
        self._in.setsockopt(zmq.LINGER, 0)
        self._out.setsockopt(zmq.LINGER, 0)
        input_addr, output_addr = self._bind()
        self.replica = replica
        self.proc = self._start(config, input_addr, output_addr, replica)
        # multiprocessing's Finalize, not weakref's: at interpreter exit it runs (exitpriority) before
        # multiprocessing joins its non-daemonic children, so an undropped client cannot hang the exit
        self._ready = threading.Event()  # set once the core reported ready: from then on it reads STOP
        self._finalizer = multiprocessing.util.Finalize(self, _stop_process, (self.proc, self._ctx, self._in,
                                                                              self._ipc_dir, self._ready),
                                                        exitpriority=10)
        self._poller = zmq.Poller()
        self._poller.register(self._out, zmq.POLLIN)
        if self.proc.sentinel is not None:
            self._poller.register(self.proc.sentinel, zmq.POLLIN)
        self._send_poller = zmq.Poller()
        self._send_poller.register(self._in, zmq.POLLOUT)
        if self.proc.sentinel is not None:
            self._send_poller.register(self.proc.sentinel, zmq.POLLIN)
        self._encoder = msgspec.msgpack.Encoder()
        self._decode_outputs = msgspec.msgpack.Decoder(EngineCoreOutputs).decode
        self._decode_failure = msgspec.msgpack.Decoder(wire.CoreFailure).decode
        self._decode_result = msgspec.msgpack.Decoder(wire.CoreResult).decode
        self._stats = SchedulerStats(0, 0, 0.0, 0, 0, 0, 0, 0)
        self._calls: dict[int, Callable] = {}
        self._next_call = 0
        self.dead_error: EngineDeadError | None = None
        if wait:
            self.wait_ready()

    def _bind(self) -> tuple[str, str]:
        self._ipc_dir = tempfile.mkdtemp(prefix="tokenmill-core-")
        input_addr, output_addr = f"ipc://{self._ipc_dir}/in", f"ipc://{self._ipc_dir}/out"
        self._in.bind(input_addr)
        self._out.bind(output_addr)
        return input_addr, output_addr

    def _start(self, config: EngineConfig, input_addr: str, output_addr: str, replica: int):
        proc = multiprocessing.get_context("spawn").Process(
            target=wire.run_engine_core, args=(config, input_addr, output_addr, replica),
            # not daemonic: a daemonic process cannot start children, and the core starts its worker
            # ranks (tensor/pipeline parallelism); _stop_process stops it on every path, and it exits
            # by itself when this process dies (it watches its parent)
            name=f"tokenmill-core{replica}", daemon=False)
        proc.start()
        return proc

    def check_dead(self) -> bool:
        """Whether the core is gone (for handles a poll cannot watch; processes have a sentinel)."""
        return False

    def wait_ready(self) -> None:
        try:
            ready = self._wait_ready()
        except BaseException:
            self.shutdown()
            raise
        self._ready.set()
        self.max_model_len, self.num_blocks = ready.max_model_len, ready.num_blocks
        self._stats.kv_blocks_total = ready.num_blocks

    @property
    def poll_items(self) -> tuple:
        """What to poll for this core's messages and death: its output socket, its sentinel."""
        return (self._out,) if self.proc.sentinel is None else (self._out, self.proc.sentinel)

    def _wait_ready(self) -> wire.CoreReady:
        deadline = time.monotonic() + _START_TIMEOUT_S
        events = {}
        while time.monotonic() < deadline and not events and not self.check_dead():
            events = dict(self._poller.poll(1000))
        if self._out not in events:
            raise self._dead("engine core did not start", startup=True)
        kind, payload = self._out.recv_multipart()
        if kind == wire.FATAL:
            f = self._decode_failure(payload)
            self.proc.join(_STOP_TIMEOUT_S)
            raise ConfigError(f"engine core failed to start: {f.error_type}: {f.message}")
        return msgspec.msgpack.decode(payload, type=wire.CoreReady)

    def _dead(self, what: str, startup: bool = False) -> EngineDeadError:
        if self.dead_error is None:
            self.dead_error = EngineDeadError(f"{what}: {self._death_cause()}")
        return self.dead_error

    def _death_cause(self) -> str:
        self.proc.join(0.5)
        code = self.proc.exitcode
        if code is None:
            cause = "it is not responding"
        elif code < 0:
            cause = f"it was killed by {signal.Signals(-code).name}"
        else:
            cause = f"it exited with code {code}"
        return f"the engine core process (pid {self.proc.pid}) died; {cause}"

    def _send(self, kind: bytes, obj) -> None:
        """Never blocks on a dead core: a PUSH socket whose one peer has gone blocks a send forever
        (it has nowhere to queue), so wait for room and watch the core's death while waiting."""
        if self.dead_error is not None:
            raise self.dead_error
        frames = [kind, self._encoder.encode(obj)]
        while True:
            try:
                self._in.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                return
            except zmq.Again:
                pass
            events = dict(self._send_poller.poll(_POLL_MS))
            if self._in not in events and (self.proc.sentinel in events or self.check_dead()
                                           or not self.proc.is_alive()):
                raise self.died()

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send(wire.ADD, request)

    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        self._send(wire.ADD_MANY, requests)  # one message: the core reads them all before it steps

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids and self.dead_error is None:
            self._send(wire.ABORT, list(request_ids))

    def call(self, method: str, on_result: Callable) -> None:
        self._next_call += 1
        self._calls[self._next_call] = on_result
        self._send(wire.CALL, wire.CoreCall(self._next_call, method))

    def settle_calls(self, value) -> None:
        """Answer the calls this core will never answer (it died) with `value`."""
        calls, self._calls = self._calls, {}
        for on_result in calls.values():
            on_result(value)

    def stats(self) -> SchedulerStats:
        return self._stats

    def has_unfinished(self) -> bool:
        return False  # the front end's request table is the truth on this side

    def get_output(self, interrupt: int | None = None) -> EngineCoreOutputs:
        if self.dead_error is not None:
            raise self.dead_error
        if interrupt is not None:
            self._poller.register(interrupt, zmq.POLLIN)
        try:
            while True:
                events = dict(self._poller.poll(_POLL_MS))
                if self._out in events:
                    out = self.receive()
                    if out is not None:
                        return out
                    continue
                if self.proc.sentinel in events or self.check_dead():
                    raise self.died()
                if interrupt is None or interrupt in events or not events:
                    return EngineCoreOutputs(scheduler_stats=self._stats)
        finally:
            if interrupt is not None:
                self._poller.unregister(interrupt)

    def died(self) -> EngineDeadError:
        """The error for requests in flight when this core's sentinel turned readable."""
        return self._dead("request failed")

    def receive(self) -> EngineCoreOutputs | None:
        """One message from the core (call when its socket is readable): outputs, or None for a
        call's result (its callback has run). Raises EngineStepError / EngineDeadError."""
        kind, payload = self._out.recv_multipart(copy=False)
        kind = kind.bytes
        if kind == wire.OUTPUTS:
            out = self._decode_outputs(payload.buffer)
            if out.scheduler_stats is not None:
                self._stats = out.scheduler_stats
            return out
        if kind == wire.RESULT:
            result = self._decode_result(payload.buffer)
            on_result = self._calls.pop(result.call_id, None)
            if on_result is not None:
                on_result(result.value)
            return None
        failure = self._decode_failure(payload.buffer)
        if kind == wire.STEP_FAILED:
            raise EngineStepError(failure.message, failure.request_ids)
        self.proc.join(_STOP_TIMEOUT_S)
        self.dead_error = EngineDeadError(f"the engine core process died: {failure.error_type}: {failure.message}")
        raise self.dead_error

    def shutdown(self) -> None:
        self._finalizer()


def _stop_process(proc, ctx, input_socket, ipc_dir: str | None, ready: threading.Event) -> None:
    """Ask the core process to stop (shutdown, or this client dropped: e.g. an `LLM` at exit),
    join it, kill it if it does not stop, free the sockets. A core still starting reads no
    messages (and ignores SIGTERM), so it is killed at once: e.g. the front end found a bad flag
    after `serve` had started its core."""
    if proc.is_alive() and not ready.is_set():
        proc.kill()
    elif proc.is_alive():
        try:
            input_socket.send_multipart([wire.STOP, b""], flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass
    proc.join(_STOP_TIMEOUT_S)
    if proc.is_alive():
        logger.warning("engine core process %s did not stop; killing it", proc.pid)
        proc.kill()
        proc.join(_STOP_TIMEOUT_S)
    ctx.destroy(linger=0)
    if ipc_dir is None:
        return
    for name in ("in", "out"):
        try:
            os.unlink(os.path.join(ipc_dir, name))
        except OSError:
            pass
    try:
        os.rmdir(ipc_dir)
    except OSError:
        pass

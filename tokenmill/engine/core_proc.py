"""The engine core's own process: a loop that reads requests from a ZMQ socket, steps the core and
writes each step's EngineCoreOutputs back, all as msgpack-encoded plain data (core/messages.py).

Wire format: multipart messages [kind, payload]; kinds are the one-byte constants below. The front
end binds both sockets (engine/core_client.py); this process connects. It exits when told to, when
its parent dies (the parent's sentinel turns readable: no orphan on any path), or when the core
raises outside a step (it reports the cause first).
"""

from __future__ import annotations

import contextlib
import gc
import logging
import multiprocessing
import os
import signal
import threading
from multiprocessing.connection import wait

import msgspec
import zmq

from tokenmill.config import EngineConfig
from tokenmill.core.messages import EngineCoreOutputs, EngineCoreRequest
from tokenmill.errors import EngineStepError

logger = logging.getLogger(__name__)

# front end -> core
ADD, ADD_MANY, ABORT, CALL, STOP = b"A", b"M", b"X", b"C", b"Q"
# core -> front end
OUTPUTS, STEP_FAILED, RESULT, READY, FATAL = b"O", b"E", b"R", b"Y", b"F"

_IDLE_POLL_MS = 1000  # an idle core wakes this often (the parent's death wakes it at once)
_CALLABLE = {"kv_block_states", "stats"}  # what the front end may call by name


class CoreReady(msgspec.Struct):
    max_model_len: int
    num_blocks: int


class CoreFailure(msgspec.Struct):
    """Why the core stopped (or why one step failed: then the failed request ids)."""

    error_type: str
    message: str
    request_ids: list[str] = []


class CoreCall(msgspec.Struct, array_like=True):
    call_id: int
    method: str


class CoreResult(msgspec.Struct, array_like=True):
    call_id: int
    value: object


def run_engine_core(config: EngineConfig, input_addr: str, output_addr: str, replica: int = 0,
                    watch_parent: bool = True) -> None:
    """The process target (spawned: nothing of the parent's state is inherited). watch_parent=False
    in a Ray actor, whose life Ray ties to the driver's."""
    if watch_parent:
        # Ctrl-C reaches the whole process group and SIGTERM may too: the front end drains first,
        # then stops this process itself, so it must not die on them.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s core{replica} %(name)s: %(message)s")
    started = threading.Event()
    if watch_parent:
        threading.Thread(target=_exit_with_parent, args=(started, input_addr, output_addr),
                         name="tokenmill-parent-watch", daemon=True).start()
    ctx = zmq.Context()
    inp = ctx.socket(zmq.PULL)
    out = ctx.socket(zmq.PUSH)
    for s in (inp, out):
        s.setsockopt(zmq.LINGER, 2000)
    inp.connect(input_addr)
    out.connect(output_addr)
    encoder = msgspec.msgpack.Encoder()
    try:
        from tokenmill.engine.engine_core import EngineCore
        from tokenmill.model.loader import load_model_config, resolve_model

        EngineCore.prefetch(config)  # a cold start's kernel build runs while the model loads
        source = resolve_model(config.model.model)
        core = EngineCore(config, source, load_model_config(source), progress=False)
    except BaseException as e:  # noqa: BLE001 - reported to the front end, which fails its start
        out.send_multipart([FATAL, encoder.encode(CoreFailure(type(e).__name__, str(e)))])
        inp.close(linger=0)
        out.close()
        ctx.term()  # waits (up to the output's linger) for the report to leave; needs both closed
        return
    _freeze_start_up_objects()
    started.set()  # from here the busy loop watches the parent
    out.send_multipart([READY, encoder.encode(CoreReady(core.max_model_len, core.kv.num_blocks))])
    try:
        if _busy_loop(core, inp, out, encoder, watch_parent):  # the front end is gone
            _remove_front_end_sockets(input_addr, output_addr)
    except BaseException as e:  # noqa: BLE001
        logger.exception("engine core died")
        out.send_multipart([FATAL, encoder.encode(CoreFailure(type(e).__name__, str(e)))])
    finally:
        core.shutdown()  # the worker ranks (with tensor/pipeline parallelism), on every way out
        inp.close(linger=0)
        out.close()
        ctx.term()


def _freeze_start_up_objects() -> None:
    """Move what start-up made (the model's modules and tensors, the tokenizer, imported modules:
    ~240k objects with Qwen2.5-Coder-1.5B and its draft) out of the cyclic garbage collector's reach,
    as vLLM does. This process holds one engine for its life, so they never become garbage, but each
    full collection traversed them all: a 120-130 ms stall of every stream, about once in 50 s at 64
    streams. Objects made later are collected as before."""
    gc.collect()
    gc.freeze()
    logger.info("froze %d start-up objects out of the garbage collector", gc.get_freeze_count())


def _remove_front_end_sockets(*addrs: str) -> None:
    """The front end binds its ipc:// sockets in a folder of its own and removes them when it stops.
    A front end that was killed cannot: the core it leaves behind does, or each kill would leave a
    folder in /tmp."""
    for addr in addrs:
        if addr.startswith("ipc://"):
            path = addr.removeprefix("ipc://")
            with contextlib.suppress(OSError):
                os.unlink(path)
            if os.path.basename(os.path.dirname(path)).startswith("tokenmill-core-"):
                with contextlib.suppress(OSError):
                    os.rmdir(os.path.dirname(path))


def _exit_with_parent(started: threading.Event, input_addr: str, output_addr: str) -> None:
    """During start-up (a kernel build takes ~20 s, loading the weights seconds) nothing else
    watches the parent: if it dies then, this process exits rather than finish loading for no one."""
    parent = multiprocessing.parent_process()
    while not started.is_set():
        if wait([parent.sentinel], timeout=0.2) and not started.is_set():
            logger.error("the front end is gone during start-up; engine core exits")
            _remove_front_end_sockets(input_addr, output_addr)
            os._exit(1)


def _busy_loop(core, inp: zmq.Socket, out: zmq.Socket, encoder: msgspec.msgpack.Encoder,
               watch_parent: bool) -> bool:
    """Steps until told to stop (returns False) or the front end is gone (returns True)."""
    parent = multiprocessing.parent_process() if watch_parent else None
    poller = zmq.Poller()
    poller.register(inp, zmq.POLLIN)
    if parent is not None:
        poller.register(parent.sentinel, zmq.POLLIN)
    ppid = os.getppid()
    decode_request = msgspec.msgpack.Decoder(EngineCoreRequest).decode
    decode_requests = msgspec.msgpack.Decoder(list[EngineCoreRequest]).decode
    decode_ids = msgspec.msgpack.Decoder(list[str]).decode
    decode_call = msgspec.msgpack.Decoder(CoreCall).decode
    while True:
        busy = core.has_unfinished()
        events = dict(poller.poll(0 if busy else _IDLE_POLL_MS))
        if parent is not None and (parent.sentinel in events or os.getppid() != ppid):
            logger.error("the front end is gone; engine core exits")
            return True
        changed = False
        while inp in events or (changed and inp.poll(0)):
            events = {}
            kind, payload = inp.recv_multipart(copy=False)
            kind = kind.bytes
            changed = True
            if kind == ADD:
                core.add_request(decode_request(payload.buffer))
            elif kind == ADD_MANY:
                for request in decode_requests(payload.buffer):
                    core.add_request(request)
            elif kind == ABORT:
                core.abort_requests(decode_ids(payload.buffer))
            elif kind == CALL:
                call = decode_call(payload.buffer)
                value = getattr(core, call.method)() if call.method in _CALLABLE else None
                out.send_multipart([RESULT, encoder.encode(CoreResult(call.call_id, value))])
            elif kind == STOP:
                return False
        if core.has_unfinished():
            try:
                outputs = core.step()
            except EngineStepError as e:  # the batch's requests failed; the core goes on
                out.send_multipart([STEP_FAILED, encoder.encode(CoreFailure(type(e).__name__, e.message,
                                                                            list(e.request_ids)))])
                continue
            out.send_multipart([OUTPUTS, encoder.encode(outputs)], copy=False)
        elif changed:  # e.g. an abort while idle: the front end's statistics must see it
            out.send_multipart([OUTPUTS, encoder.encode(EngineCoreOutputs(scheduler_stats=core.stats()))])

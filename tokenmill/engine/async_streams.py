"""The pieces AsyncLLMEngine hands across threads: a wakeable event a zmq poll can wait on, and
the async iterator over one request's outputs."""

from __future__ import annotations

import asyncio
import os
import select
from typing import TYPE_CHECKING

from tokenmill.outputs import RequestOutput

if TYPE_CHECKING:
    from tokenmill.engine.async_engine import AsyncLLMEngine


class Waker:
    """A threading.Event that a zmq poll can also wait on (a pipe: set() makes it readable)."""

    def __init__(self):
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)

    def fileno(self) -> int:
        return self._r

    def set(self) -> None:
        try:
            os.write(self._w, b"x")
        except (BlockingIOError, OSError):  # already set (pipe full), or closed at shutdown
            pass

    def clear(self) -> None:
        try:
            while os.read(self._r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def wait(self, timeout: float) -> None:
        select.select([self._r], [], [], timeout)

    def __del__(self):
        for fd in (self._r, self._w):
            try:
                os.close(fd)
            except OSError:
                pass


def resolve(future: asyncio.Future, value) -> None:
    if not future.done():
        future.set_result(value)


class RequestStream:
    """Async iterator over one request's outputs. Closing it early (aclose, or dropping it) aborts
    the request in the engine."""

    def __init__(self, engine: AsyncLLMEngine, request_id: str):
        self.engine = engine
        self.request_id = request_id
        self.queue: asyncio.Queue = asyncio.Queue()
        self.done = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.done:
            raise StopAsyncIteration
        try:
            item = await self.queue.get()
        except BaseException:  # cancelled while waiting: the consumer is gone
            self._close(abort=True)
            raise
        if isinstance(item, BaseException):
            self._close(abort=False)  # the engine already dropped it
            raise item
        if item.finished:
            self._close(abort=False)
        return item

    async def aclose(self) -> None:
        self.close()

    def close(self) -> None:
        """Stop consuming: aborts the request if it has not finished."""
        self._close(abort=True)

    def _close(self, abort: bool) -> None:
        if not self.done:
            self.done = True
            self.engine.release_request(self.request_id, abort)

    def __del__(self):
        if not self.done:  # dropped without being closed: do not leave the request running
            self.engine.release_request(self.request_id, abort=True)

"""A loopback HTTP/1.1 server with the two habits of llama.cpp's llama-server that tripped
`tokenmill bench serve`:

- it closes a keep-alive connection after `max_requests_per_connection` requests: the next request
  written to that connection is never read (the socket is closed under it, unanswered);
- its `POST /tokenize` takes `{"content": ...}` and answers vLLM's `{"prompt": ...}` form with an
  empty token list.

Its tokenizer is one token per whitespace-separated word. A completion streams `max_tokens` chunks
of one word each (SSE, chunked transfer encoding, usage at the end); `tokenize=False` drops the
endpoint. Two prompts misbehave on
purpose: one containing HANGUP_UNANSWERED is read and then left unanswered (the connection closed),
one containing HANGUP_MIDSTREAM gets two chunks and then a closed connection.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time


class LlamaLikeServer:
    def __init__(self, max_requests_per_connection: int = 5, token_delay: float = 0.002, tokenize: bool = True):
        self.max_requests_per_connection = max_requests_per_connection
        self.tokenize = tokenize
        self.token_delay = token_delay
        self.completions_received = 0  # completion requests read in full (each was processed once)
        self.closed_unread = 0  # requests written to a connection the server had finished with
        self.connections = 0
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="llama-like-server", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> LlamaLikeServer:
        self._thread.start()
        self._ready.wait(10)
        return self

    def stop(self) -> None:
        async def cancel_connections_then_stop():
            # connection handlers end (and abort their transports) while the loop still runs
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._loop.stop()

        asyncio.run_coroutine_threadsafe(cancel_connections_then_stop(), self._loop)
        self._thread.join(10)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(self._connection, "127.0.0.1", 0))
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        self._loop.run_forever()
        server.close()
        self._loop.close()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            for _ in range(self.max_requests_per_connection):
                request = await _read_request(reader)
                if request is None:
                    return
                if not await self._handle(*request, writer):
                    return
            # done with this connection, as llama-server's keep-alive limit is: a request that
            # arrives on it now is dropped unread
            if await reader.read(1):
                self.closed_unread += 1
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.transport.abort()

    async def _handle(self, method: str, path: str, body: bytes, writer: asyncio.StreamWriter) -> bool:
        """Answer one request; False when the connection was hung up on purpose."""
        if method == "GET" and path == "/v1/models":
            _respond(writer, 200, {"object": "list", "data": [{"id": "llama-like", "object": "model"}]})
        elif method == "POST" and path == "/tokenize" and self.tokenize:
            data = json.loads(body)
            tokens = [hash(w) % 30000 for w in data["content"].split()] if "content" in data else []
            _respond(writer, 200, {"tokens": tokens})
        elif method == "POST" and path == "/v1/completions":
            self.completions_received += 1
            return await self._stream(json.loads(body), writer)
        else:
            _respond(writer, 404, {"error": {"code": 404, "message": "File Not Found", "type": "not_found_error"}})
        await writer.drain()
        return True

    async def _stream(self, req: dict, writer: asyncio.StreamWriter) -> bool:
        prompt = req["prompt"]
        if "HANGUP_UNANSWERED" in prompt:
            return False
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n"
                     b"Keep-Alive: timeout=5, max=5\r\n\r\n")
        n = int(req.get("max_tokens", 16))
        for i in range(n):
            if i == 2 and "HANGUP_MIDSTREAM" in prompt:
                await writer.drain()
                return False
            await asyncio.sleep(self.token_delay)
            _chunk(writer, {"choices": [{"index": 0, "text": f" w{i}", "finish_reason": None}]})
            await writer.drain()
        _chunk(writer, {"choices": [{"index": 0, "text": "", "finish_reason": "length"}],
                        "usage": {"prompt_tokens": len(prompt.split()), "completion_tokens": n,
                                  "total_tokens": len(prompt.split()) + n}, "created": int(time.time())})
        payload = b"data: [DONE]\n\n"
        writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(payload), payload))
        await writer.drain()
        return True


async def _read_request(reader: asyncio.StreamReader) -> tuple[str, str, bytes] | None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None  # the client closed the connection
    lines = head.decode("latin-1").split("\r\n")
    method, path, _ = lines[0].split(" ", 2)
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
    body = await reader.readexactly(int(headers.get("content-length", 0)))
    return method, path, body


def _respond(writer: asyncio.StreamWriter, status: int, obj: dict) -> None:
    body = json.dumps(obj).encode()
    writer.write(b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n"
                 b"Keep-Alive: timeout=5, max=5\r\n\r\n%s" % (status, b"OK" if status == 200 else b"Error",
                                                               len(body), body))


def _chunk(writer: asyncio.StreamWriter, obj: dict) -> None:
    payload = b"data: " + json.dumps(obj).encode() + b"\n\n"
    writer.write(b"%x\r\n%s\r\n" % (len(payload), payload))

"""The ASGI layer around the app: the API key, a bound on request bodies, and a last line of
defence that answers any exception with a 500 in OpenAI's shape instead of letting it reach
uvicorn (which would log "Exception in ASGI application" and drop the keep-alive connection).

Plain ASGI, not Starlette's BaseHTTPMiddleware: that one wraps streaming responses in extra tasks
and re-raises handler errors after answering."""

from __future__ import annotations

import hmac
import logging

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenmill.entrypoints.openai.http_errors import error_response, http_error_response
from tokenmill.errors import AuthenticationError

logger = logging.getLogger("tokenmill.server")
OPEN_PATHS = frozenset({"/health", "/ready", "/metrics", "/version", "/docs", "/openapi.json"})


class ServerGuard:
    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int,
                 open_paths: set[str] | frozenset[str] = OPEN_PATHS):
        self.app = app
        self.open_paths = open_paths  # reachable without the key; the server's live set (the dashboard adds its own)
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            if self.expected is not None and scope["path"] not in self.open_paths and not self._authorized(scope):
                err = AuthenticationError("invalid or missing API key (Authorization: Bearer ...)")
                await error_response(err, {"WWW-Authenticate": "Bearer"})(scope, receive, send_tracked)
                return
            body = await self._read_body(scope, receive)
            if body is None:
                msg = f"request body larger than --max-request-body-bytes ({self.max_body_bytes} bytes)"
                await http_error_response(413, msg, {"Connection": "close"})(scope, receive, send_tracked)
                return
            await self.app(scope, _replay(body, receive), send_tracked)
        except Exception:  # noqa: BLE001 - the last line of defence
            logger.exception("unhandled error on %s %s", scope.get("method"), scope.get("path"))
            if not started:
                response = http_error_response(500, "internal error: the server hit a bug; it is logged")
                await response(scope, receive, send)
            else:  # mid-stream: end the body cleanly (an SSE client sees no [DONE])
                try:
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                except Exception:  # noqa: BLE001 - the client is gone or the response already ended
                    pass

    def _authorized(self, scope: Scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                return hmac.compare_digest(value, self.expected)
        return False

    async def _read_body(self, scope: Scope, receive: Receive) -> bytes | None:
        """The whole body, or None when it exceeds the limit (checked against Content-Length
        first, so an oversized upload is refused before it is read)."""
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    if int(value) > self.max_body_bytes:
                        return None
                except ValueError:
                    pass
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return b"".join(chunks)  # disconnected: the app will see it on its next receive
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                return None
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A receive that hands out the buffered body once, then the client's later messages
    (http.disconnect)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay

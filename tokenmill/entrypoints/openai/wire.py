"""JSON on the wire: strict parsing of request bodies, and rendering that cannot fail.

Python's `json` accepts what is not JSON (NaN, Infinity) and lone UTF-16 surrogates ("\\ud800"),
which no tokenizer and no UTF-8 encoder can take; it also recurses until RecursionError. Bodies
are parsed with pydantic-core's parser instead: RFC 8259 JSON only, well-formed Unicode only, a
bounded depth. Responses go through `dumps`, which never raises: a value that cannot be encoded
(a lone surrogate, a non-finite float) is replaced, never allowed to turn an answer into a crash.
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any

import pydantic_core
from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import JSONResponse

logger = logging.getLogger("tokenmill.server")


def parse_json(body: bytes) -> Any:
    """Parse a request body; raises json.JSONDecodeError with a readable message."""
    try:
        return pydantic_core.from_json(body, allow_inf_nan=False)
    except ValueError as e:
        msg = str(e)
        if "surrogate" in msg or "hex escape" in msg:
            msg = f"a \\u escape is a lone UTF-16 surrogate, not a character ({msg})"
        elif msg.startswith("recursion limit"):
            msg = f"nested too deeply ({msg})"
        raise json.JSONDecodeError(msg, "", 0) from None


class _StrictRequest(Request):
    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            self._json = parse_json(await self.body())
        return self._json


class StrictJSONRoute(APIRoute):
    """A route whose JSON body is parsed by `parse_json`."""

    def get_route_handler(self):
        handler = super().get_route_handler()

        async def strict_handler(request: Request):
            return await handler(_StrictRequest(request.scope, request.receive))

        return strict_handler


def _clean(value: Any) -> Any:
    """A copy of `value` that JSON can carry: lone surrogates escaped, non-finite floats bounded."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
            return value
        except UnicodeEncodeError:
            return value.encode("utf-8", "backslashreplace").decode("utf-8")
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else math.copysign(9999.0, value)  # vLLM's bound for -inf logprobs
    if isinstance(value, dict):
        return {_clean(k) if isinstance(k, str) else k: _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def dumps(content: Any) -> bytes:
    """Compact UTF-8 JSON. Never raises for what a handler may put in a response."""
    try:
        return json.dumps(content, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode("utf-8")
    except (ValueError, TypeError, UnicodeEncodeError):
        logger.warning("response held a value JSON cannot carry; it was replaced")
        return json.dumps(_clean(content), ensure_ascii=False, allow_nan=False, default=str,
                          separators=(",", ":")).encode("utf-8")


def sse(payload: Any) -> bytes:
    """One server-sent event carrying `payload` as JSON."""
    return b"data: " + dumps(payload) + b"\n\n"


class SafeJSONResponse(JSONResponse):
    def render(self, content: Any) -> bytes:
        return dumps(content)

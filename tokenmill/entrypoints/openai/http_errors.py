"""Every failure becomes OpenAI's error JSON, `{"error": {"message", "type", "param", "code"}}`,
with the right status: typed tokenmill errors, body validation errors, and Starlette's own HTTP
errors (unknown path 404, wrong method 405). Error text may quote what the client sent, so it is
clipped and rendered with `wire.dumps`: an error body can always be written."""

from __future__ import annotations

import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenmill.entrypoints.openai.wire import SafeJSONResponse
from tokenmill.errors import InvalidRequestError, QueueFullError, ServiceUnavailableError, TokenmillError

logger = logging.getLogger("tokenmill.server")
MAX_MESSAGE_CHARS = 2000
_HTTP_TYPES = {401: "authentication_error", 404: "not_found_error", 413: "invalid_request_error",
               429: "rate_limit_error", 503: "service_unavailable"}


# pydantic names the union member an error is about in its location: prompt.constrained-str
_UNION_TAG = re.compile(r"^(constrained-|function-\w+\[)?(str|int|float|bool|list|dict|none|nullable)\b")


def clip(text: str, limit: int = 200) -> str:
    """User input quoted in an error message: at most `limit` characters."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def error_body(message: str, err_type: str, code: int | str | None, param: str | None = None) -> dict:
    return {"error": {"message": clip(str(message), MAX_MESSAGE_CHARS), "type": err_type,
                      "param": None if param is None else clip(str(param)), "code": code}}


def tokenmill_error_body(e: TokenmillError) -> dict:
    # OpenAI's string code where the error has one (context_length_exceeded, model_not_found: what
    # clients test for), else the HTTP status, as vLLM sends
    return error_body(e.message, e.error_type, e.code if e.code is not None else e.status_code, e.param)


def error_response(e: TokenmillError, headers: dict | None = None) -> SafeJSONResponse:
    if isinstance(e, QueueFullError):
        headers = {**(headers or {}), "Retry-After": str(e.retry_after)}
    return SafeJSONResponse(tokenmill_error_body(e), status_code=e.status_code, headers=headers)


def http_error_response(status: int, message: str, headers: dict | None = None) -> SafeJSONResponse:
    err_type = _HTTP_TYPES.get(status, "invalid_request_error" if status < 500 else "internal_error")
    return SafeJSONResponse(error_body(message, err_type, status), status_code=status, headers=headers)


def validation_message(e: RequestValidationError) -> InvalidRequestError:
    errors = e.errors()
    # a union (prompt: text, texts, token ids, lists of ids) fails once per member; the member the input
    # matched in shape got deepest, and an error about a value beats one about a type (prompt [-1]:
    # "must be >= 0", not "must be a string")
    err = max(errors, key=lambda x: (len(x.get("loc", ())), not str(x.get("type", "")).endswith("_type")),
              default={})
    loc = [str(x) for x in err.get("loc", ()) if x != "body" and not _UNION_TAG.match(str(x))]
    if err.get("type") == "json_invalid":
        return InvalidRequestError(f"malformed JSON body: {err.get('ctx', {}).get('error', err.get('msg'))}")
    where = ".".join(loc)
    return InvalidRequestError(f"{where or 'body'}: {err.get('msg', 'invalid value')}", param=where or None)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(TokenmillError)
    async def tokenmill_error(request: Request, e: TokenmillError):
        if e.status_code >= 500 and not isinstance(e, ServiceUnavailableError):
            logger.error("%s %s failed: %s", request.method, request.url.path, e)
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError):
        return error_response(validation_message(e))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        if e.status_code == 404:
            message = f"no such endpoint: {request.method} {request.url.path}"
        elif e.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        else:
            message = str(e.detail)
        return http_error_response(e.status_code, message, headers=getattr(e, "headers", None))

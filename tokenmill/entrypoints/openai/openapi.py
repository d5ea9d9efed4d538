"""What /openapi.json promises, kept true: every error status an endpoint can answer (OpenAI's
error shape), the content types of /health, /ready and /metrics, and the limits that depend on
the loaded model (its name, vocabulary size, context length, max logprobs) filled in once it is
loaded. Clients are generated from this schema, and the fuzz tests hold the server to it."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

# markers the request models put on fields whose bounds are only known once the model is loaded
TOKEN_ID, TOKEN_LIST, TOKEN_KEY, OUTPUT_TOKENS, LOGPROBS, SERVED_MODEL, PROMPT_CHARS, PRIORITY, FIM_SUFFIX = (
    "x-token-id", "x-token-list", "x-token-key", "x-output-tokens", "x-logprobs", "x-served-model",
    "x-prompt-chars", "x-priority", "x-fim-suffix")


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class StatusResponse(BaseModel):
    status: Literal["ok"]


class VersionResponse(BaseModel):
    version: str


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


_ERRORS = {
    400: "Invalid request: a parameter out of range, malformed JSON, or a prompt that does not fit.",
    401: "Missing or wrong API key (only when the server runs with --api-key).",
    404: "The model named in the request is not the one this server serves.",
    408: "The request ran past --request-timeout and was aborted.",
    413: "The request body is larger than --max-request-body-bytes.",
    429: "--max-queue-len requests are already waiting; retry after Retry-After seconds.",
    500: "An engine fault while running this request; the server keeps serving.",
    503: "The model is still loading, the server is draining for shutdown, or the engine stopped.",
}
_RETRY_AFTER = {"Retry-After": {"description": "Seconds to wait before retrying.", "schema": {"type": "integer"}}}
GENERATION_ERRORS = (400, 401, 404, 408, 413, 429, 500, 503)
TOKENIZER_ERRORS = (400, 401, 404, 413, 500, 503)


def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """The `responses=` of a route answering these error statuses."""
    out: dict[int | str, dict[str, Any]] = {}
    for code in codes:
        out[code] = {"model": ErrorResponse, "description": _ERRORS[code]}
        if code == 429:
            out[code]["headers"] = _RETRY_AFTER
    return out


# with OpenAPI 3.1 the schema of an event-stream describes one event
_SSE_EVENT = {"type": "object", "required": ["data"], "properties": {"data": {
    "type": "string", "description": "A JSON chunk (or an error object); the last event is [DONE]."}}}


def text_stream(description: str) -> dict[int | str, dict[str, Any]]:
    """A 200 that is JSON, or server-sent events when the body asks for `stream: true`."""
    return {200: {"description": description, "content": {"text/event-stream": {"schema": _SSE_EVENT}}}}


def install(app: FastAPI, runtime_limits) -> None:
    """Serve the schema with the loaded model's limits. `runtime_limits()` returns None while the
    model loads (the schema then has only the static bounds and is not cached)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes,
                             description=app.description)
        _standard_bounds(schema)
        limits = runtime_limits()
        if limits is None:
            return schema
        _fill_limits(schema, limits)
        app.openapi_schema = schema
        return schema

    app.openapi = openapi


def decimal_at_most(maximum: int) -> str:
    """A regex for the decimal strings (leading zeros allowed) of the integers 0..maximum."""
    s, parts = str(maximum), []
    if len(s) > 1:
        parts.append(f"[0-9]{{1,{len(s) - 1}}}")
    for i, digit in enumerate(map(int, s)):
        low = 1 if i == 0 and len(s) > 1 else 0
        if digit - 1 >= low:
            parts.append(f"{s[:i]}[{low}-{digit - 1}][0-9]{{{len(s) - i - 1}}}")
    parts.append(s)
    return f"^0*({'|'.join(parts)})$"


_BOUNDS = {"ge": "minimum", "le": "maximum", "gt": "exclusiveMinimum", "lt": "exclusiveMaximum"}


def _standard_bounds(node: Any) -> None:
    """pydantic writes the bounds of a type with a validator (`Int`) under their Python names."""
    if isinstance(node, list):
        for item in node:
            _standard_bounds(item)
    elif isinstance(node, dict):
        if node.get("type") in ("integer", "number"):
            for py, js in _BOUNDS.items():
                if py in node:
                    node[js] = node.pop(py)
        for value in node.values():
            _standard_bounds(value)


def _fill_limits(node: Any, limits: dict[str, Any]) -> None:
    if isinstance(node, list):
        for item in node:
            _fill_limits(item, limits)
        return
    if not isinstance(node, dict):
        return
    if node.pop(TOKEN_ID, False):
        node["maximum"] = limits["vocab_size"] - 1
    if node.pop(TOKEN_LIST, False):  # all of it: an echo with max_tokens 0 may fill the context
        node["maxItems"] = limits["max_model_len"]
    if node.pop(OUTPUT_TOKENS, False):
        node["maximum"] = limits["max_model_len"] - 1
    if node.pop(LOGPROBS, False):
        node["maximum"] = limits["max_logprobs"]
    if node.pop(TOKEN_KEY, False):
        node["propertyNames"] = {"pattern": decimal_at_most(limits["vocab_size"] - 1)}
    if node.pop(PROMPT_CHARS, False):
        node["maxLength"] = limits["max_prompt_chars"]
    if node.pop(PRIORITY, False) and not limits["priority_scheduling"]:
        node["enum"] = [0]  # under fcfs any other priority is a 400
    if node.pop(FIM_SUFFIX, False) and not limits["fill_in_the_middle"]:
        node["maxLength"] = 0  # a model without FIM tokens takes no suffix (an empty one is none)
    if node.pop(SERVED_MODEL, False):
        node["enum"] = [limits["model"], None]
    for value in node.values():
        _fill_limits(value, limits)


def security(app: FastAPI, api_key: str | None) -> None:
    """Document the bearer key on the routes that check it."""
    if not api_key:
        return
    inner = app.openapi

    def openapi() -> dict[str, Any]:
        schema = inner()
        schema.setdefault("components", {})["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        for ops in schema.get("paths", {}).values():
            for op in ops.values():
                if 401 in op.get("responses", {}) or "401" in op.get("responses", {}):
                    op["security"] = [{"bearer": []}]
        return schema

    app.openapi = openapi

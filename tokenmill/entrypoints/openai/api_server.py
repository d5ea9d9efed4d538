"""The OpenAI-compatible HTTP server (FastAPI + uvicorn).

The port is bound at once and the model loads in the background: /health answers 503 until the
engine runs. The event loop never runs the model (the engine has its own thread). The process
around the app (uvicorn, signals, draining) is in launcher.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, Counter, generate_latest

from tokenmill import __version__
from tokenmill.config import EngineConfig, ServerConfig
from tokenmill.engine.async_engine import AsyncLLMEngine
from tokenmill.engine.stats import LoggingStatLogger
from tokenmill.entrypoints.openai.compat_routes import register_compat_routes
from tokenmill.entrypoints.openai.metrics import PrometheusStatLogger
from tokenmill.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    error_body,
)
from tokenmill.entrypoints.openai.serving_chat import ChatServing
from tokenmill.entrypoints.openai.serving_completion import CompletionServing
from tokenmill.errors import (
    AuthenticationError,
    InvalidRequestError,
    QueueFullError,
    ServiceUnavailableError,
    TokenmillError,
)

logger = logging.getLogger("tokenmill.server")
_OPEN_PATHS = {"/health", "/ready", "/metrics", "/version", "/docs", "/openapi.json"}


class ServerState:
    def __init__(self, engine_config: EngineConfig, config: ServerConfig):
        self.engine_config = engine_config
        self.config = config
        self.engine: AsyncLLMEngine | None = None
        self.load_error: BaseException | None = None
        self.draining = False
        self.metrics: PrometheusStatLogger | None = None
        self.completions: CompletionServing | None = None
        self.chat: ChatServing | None = None
        self.model_name = engine_config.model.served_model_name
        self.open_paths = set(_OPEN_PATHS)  # reachable without the API key
        self.extra_stat_loggers: list = []  # attached to the engine before it starts (e.g. the dashboard's)
        self.slo_gate = None  # --slo: SLOGate, the `admit` check of every generation request

    def ready(self) -> AsyncLLMEngine:
        if self.engine is None:
            raise ServiceUnavailableError("the model is still loading")
        return self.engine

    async def load(self) -> None:
        """Build the engine off the event loop, then start its thread."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()

        def build():
            try:
                engine = AsyncLLMEngine.from_config(self.engine_config)
                if self.config.slo is not None:
                    from tokenmill.entrypoints.openai.slo_admission import SLOGate
                    from tokenmill.planning.admission import parse_admission_slo

                    self.slo_gate = SLOGate(engine, self.engine_config, parse_admission_slo(self.config.slo),
                                            self.config.profile)
                loop.call_soon_threadsafe(done.set_result, engine)
            except BaseException as e:  # noqa: BLE001 - reported on the loop
                loop.call_soon_threadsafe(done.set_exception, e)

        threading.Thread(target=build, name="tokenmill-load", daemon=True).start()
        aengine: AsyncLLMEngine = await done
        self.model_name = aengine.served_model_name
        self.metrics = PrometheusStatLogger(self.model_name, aengine.scheduler_stats,
                                            replica_stats=aengine.replica_stats)
        if self.slo_gate is not None:
            self.slo_gate.rejections = Counter(
                "tokenmill:slo_admission_rejected", "Requests rejected with 429 by --slo admission.",
                ["model_name"], registry=self.metrics.registry).labels(model_name=self.model_name)
        for stat_logger in (self.metrics, LoggingStatLogger(), *self.extra_stat_loggers):
            aengine.add_stat_logger(stat_logger)
        aengine.start()
        self.completions = CompletionServing(aengine, self.model_name, self.config, self)
        self.chat = ChatServing(aengine, self.model_name, self.config, self)
        self.engine = aengine
        logger.info("serving %s on http://%s:%d", self.model_name, self.config.host, self.config.port)


def _error_response(e: TokenmillError) -> JSONResponse:
    headers = {"Retry-After": str(e.retry_after)} if isinstance(e, QueueFullError) else None
    return JSONResponse(error_body(e.message, e.error_type, e.status_code, e.param), status_code=e.status_code,
                        headers=headers)


def build_app(engine_config: EngineConfig, config: ServerConfig, on_load_failure=None) -> FastAPI:
    state = ServerState(engine_config, config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        async def load():
            try:
                await state.load()
            except BaseException as e:  # noqa: BLE001
                state.load_error = e
                logger.error("failed to load the model: %s", e)
                if on_load_failure is not None:
                    on_load_failure(e)

        task = asyncio.create_task(load())
        yield
        task.cancel()
        if state.engine is not None:
            state.engine.shutdown()

    app = FastAPI(title="tokenmill", version=__version__, lifespan=lifespan)
    app.state.server = state

    @app.middleware("http")
    async def auth(request: Request, call_next):
        key = config.api_key
        if key and request.url.path not in state.open_paths:
            header = request.headers.get("authorization", "")
            if header != f"Bearer {key}":
                return _error_response(AuthenticationError("invalid or missing API key (Authorization: Bearer ...)"))
        return await call_next(request)

    @app.exception_handler(TokenmillError)
    async def tokenmill_error(request: Request, e: TokenmillError):
        if e.status_code >= 500 and not isinstance(e, ServiceUnavailableError):
            logger.error("%s %s failed: %s", request.method, request.url.path, e)
        return _error_response(e)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, e: RequestValidationError):
        err = e.errors()[0] if e.errors() else {}
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        if err.get("type") == "json_invalid":
            msg, param = f"malformed JSON body: {err.get('ctx', {}).get('error', err.get('msg'))}", None
        else:
            msg, param = f"{'.'.join(loc) or 'body'}: {err.get('msg', 'invalid value')}", ".".join(loc) or None
        return _error_response(InvalidRequestError(msg, param=param))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return JSONResponse(error_body(f"internal error: {type(e).__name__}", "internal_error", 500), status_code=500)

    @app.get("/health")
    async def health():
        engine = state.engine
        if engine is None or not engine.is_running:
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/ready")
    async def ready():
        ok = state.engine is not None and state.engine.is_running and not state.draining
        return Response(status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics():
        if state.metrics is None:
            return Response(status_code=503)
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/v1/models")
    async def models():
        engine = state.ready()
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "tokenmill", "root": state.model_name,
                                            "max_model_len": engine.max_model_len}]}

    async def respond(result):
        if isinstance(result, Response):  # the client went away first
            return result
        if isinstance(result, dict):
            return JSONResponse(result)
        return StreamingResponse(result, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        state.ready()
        return await respond(await _cancel_on_disconnect(request, state.completions.create(body, time.monotonic())))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        state.ready()
        return await respond(await _cancel_on_disconnect(request, state.chat.create(body, time.monotonic())))

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        engine = state.ready()
        if (body.prompt is None) == (body.messages is None):
            raise InvalidRequestError("give exactly one of prompt or messages", param="prompt")
        if body.messages is not None:
            text = engine.render_chat([m.model_dump(exclude_none=True) for m in body.messages],
                                      body.add_generation_prompt)
            tokens = engine.tokenize(text, add_special_tokens=False)
        else:
            tokens = engine.tokenize(body.prompt, add_special_tokens=body.add_special_tokens)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": engine.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        return {"prompt": state.ready().detokenize(body.tokens)}

    register_compat_routes(app, state)
    if not config.disable_dashboard:
        from tokenmill.entrypoints.openai.dashboard import register_dashboard

        register_dashboard(app, state)
    return app


async def _cancel_on_disconnect(request: Request, coro):
    """Run a handler, cancelling it if the client disconnects first (a non-streaming request whose
    client went away must not keep generating)."""
    task = asyncio.ensure_future(coro)

    async def watch():
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(watch())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        return Response(status_code=499)
    finally:
        watcher.cancel()

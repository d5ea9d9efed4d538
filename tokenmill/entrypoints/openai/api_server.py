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
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, Counter, generate_latest

from tokenmill import __version__
from tokenmill.config import EngineConfig, ServerConfig
from tokenmill.engine.async_engine import AsyncLLMEngine
from tokenmill.engine.stats import LoggingStatLogger
from tokenmill.entrypoints.openai import openapi
from tokenmill.entrypoints.openai.compat_routes import register_compat_routes
from tokenmill.entrypoints.openai.http_errors import install_error_handlers
from tokenmill.entrypoints.openai.metrics import PrometheusStatLogger
from tokenmill.entrypoints.openai.middleware import OPEN_PATHS, ServerGuard
from tokenmill.entrypoints.openai.openapi import (
    DetokenizeResponse,
    ModelList,
    StatusResponse,
    TokenizeResponse,
    VersionResponse,
)
from tokenmill.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from tokenmill.entrypoints.openai.serving_chat import ChatServing
from tokenmill.entrypoints.openai.serving_completion import CompletionServing
from tokenmill.entrypoints.openai.tools import parse_tools
from tokenmill.entrypoints.openai.wire import SafeJSONResponse, StrictJSONRoute
from tokenmill.errors import InvalidRequestError, ServiceUnavailableError, describe_error

logger = logging.getLogger("tokenmill.server")


class ServerState:
    def __init__(self, engine_config: EngineConfig, config: ServerConfig, core_client=None):
        self.engine_config = engine_config
        self.config = config
        self.core_client = core_client  # the core process, when the launcher started it before this module loaded
        self.engine: AsyncLLMEngine | None = None
        self.load_error: BaseException | None = None
        self.draining = False
        self.metrics: PrometheusStatLogger | None = None
        self.completions: CompletionServing | None = None
        self.chat: ChatServing | None = None
        self.model_name = engine_config.model.served_model_name
        self.open_paths = set(OPEN_PATHS)  # reachable without the API key
        self.extra_stat_loggers: list = []  # attached to the engine before it starts (e.g. the dashboard's)
        self.slo_gate = None  # --slo: SLOGate, the `admit` check of every generation request
        self.slo_cost = None  # --slo: its cost model, chosen (and a wrong profile refused) before the load
        if config.slo is not None:
            from tokenmill.entrypoints.openai.slo_admission import slo_cost_model

            self.slo_cost = slo_cost_model(engine_config, config.profile)

    def limits(self) -> dict | None:
        """The loaded model's limits for the OpenAPI schema (None while loading)."""
        if self.engine is None:
            return None
        e = self.engine
        return {"model": self.model_name, "vocab_size": e.vocab_size, "max_model_len": e.max_model_len,
                "max_logprobs": e.max_logprobs, "max_prompt_chars": e.max_prompt_chars,
                "priority_scheduling": self.engine_config.scheduler.scheduling_policy == "priority",
                "fill_in_the_middle": self.completions.fill_in_the_middle}

    def ready(self) -> AsyncLLMEngine:
        if self.engine is None:
            raise ServiceUnavailableError("the model is still loading")
        return self.engine

    async def load(self) -> None:
        """Build the engine off the event loop, then start its thread."""
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()

        def report(fn, value) -> bool:
            try:
                loop.call_soon_threadsafe(fn, value)
                return True
            except RuntimeError:  # the loop is closed: the server stopped while the model loaded
                return False

        def build():
            engine = None
            try:
                engine = AsyncLLMEngine.from_config(self.engine_config, core_client=self.core_client)
                if self.config.slo is not None:
                    from tokenmill.entrypoints.openai.slo_admission import SLOGate
                    from tokenmill.planning.admission import parse_admission_slo

                    self.slo_gate = SLOGate(engine, self.engine_config, parse_admission_slo(self.config.slo),
                                            self.slo_cost)
            except BaseException as e:  # noqa: BLE001 - reported on the loop
                if engine is not None:
                    engine.shutdown()
                report(done.set_exception, e)
                return
            if not report(done.set_result, engine):
                engine.shutdown()

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


def build_app(engine_config: EngineConfig, config: ServerConfig, on_load_failure=None, core_client=None) -> FastAPI:
    state = ServerState(engine_config, config, core_client)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        async def load():
            try:
                await state.load()
            except asyncio.CancelledError:  # shut down before the model was loaded
                raise
            except BaseException as e:  # noqa: BLE001
                state.load_error = e
                logger.error("failed to load the model: %s", describe_error(e))
                if on_load_failure is not None:
                    on_load_failure(e)

        task = asyncio.create_task(load())
        yield
        task.cancel()
        if state.engine is not None:
            state.engine.shutdown()

    app = FastAPI(title="tokenmill", version=__version__, lifespan=lifespan, default_response_class=SafeJSONResponse)
    app.router.route_class = StrictJSONRoute
    app.state.server = state
    app.add_middleware(ServerGuard, api_key=config.api_key, max_body_bytes=config.max_request_body_bytes,
                       open_paths=state.open_paths)
    install_error_handlers(app)
    openapi.install(app, state.limits)
    openapi.security(app, config.api_key)

    @app.get("/health", response_model=StatusResponse, responses=openapi.errors(503))
    async def health():
        """200 while the engine loop runs; 503 while loading or after it died."""
        engine = state.engine
        if engine is None or not engine.is_running:
            raise ServiceUnavailableError("the model is still loading" if engine is None else "the engine stopped")
        return {"status": "ok"}

    @app.get("/ready", response_model=StatusResponse, responses=openapi.errors(503))
    async def ready():
        """Like /health, and also 503 while draining for shutdown."""
        await health()
        if state.draining:
            raise ServiceUnavailableError("the server is shutting down")
        return {"status": "ok"}

    @app.get("/metrics", response_class=Response, responses={
        200: {"description": "Prometheus text exposition format.",
              "content": {"text/plain": {"schema": {"type": "string"}}}}, **openapi.errors(503)})
    async def metrics():
        if state.metrics is None:
            raise ServiceUnavailableError("the model is still loading")
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version", response_model=VersionResponse)
    async def version():
        return {"version": __version__}

    @app.get("/v1/models", response_model=ModelList, responses=openapi.errors(401, 500, 503))
    async def models():
        engine = state.ready()
        return {"object": "list", "data": [{"id": state.model_name, "object": "model", "created": int(time.time()),
                                            "owned_by": "tokenmill", "root": state.model_name,
                                            "max_model_len": engine.max_model_len}]}

    async def respond(result):
        if isinstance(result, Response):  # the client went away first
            return result
        if isinstance(result, dict):
            return SafeJSONResponse(result)
        return StreamingResponse(result, media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    generation_responses = {**openapi.errors(*openapi.GENERATION_ERRORS)}

    @app.post("/v1/completions", responses={**openapi.text_stream("A completion (JSON), or with stream: true "
                                                                  "server-sent events ending in data: [DONE]."),
                                            **generation_responses})
    async def completions(body: CompletionRequest, request: Request):
        state.ready()
        return await respond(await _cancel_on_disconnect(request, state.completions.create(body, time.monotonic())))

    @app.post("/v1/chat/completions", responses={**openapi.text_stream("A chat completion (JSON), or with stream: "
                                                                       "true server-sent events ending in data: "
                                                                       "[DONE]."), **generation_responses})
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        state.ready()
        return await respond(await _cancel_on_disconnect(request, state.chat.create(body, time.monotonic())))

    @app.post("/tokenize", response_model=TokenizeResponse, responses=openapi.errors(*openapi.TOKENIZER_ERRORS))
    async def tokenize(body: TokenizeRequest):
        engine = state.ready()
        serving = state.completions
        serving.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise InvalidRequestError("give exactly one of prompt or messages", param="prompt")
        if body.messages is not None:
            tools = parse_tools(body.tools, None, None)
            text = state.chat.render(body.messages, body.add_generation_prompt, tools, body.chat_template_kwargs,
                                     body.continue_final_message)
            add_special = False
        else:
            text, add_special = body.prompt, body.add_special_tokens
        tokens = await serving.tokenize(text, add_special)
        if tokens is None:
            tokens = engine.tokenize(text, add_special_tokens=add_special)
        return {"tokens": tokens, "count": len(tokens), "max_model_len": engine.max_model_len}

    @app.post("/detokenize", response_model=DetokenizeResponse,
              responses=openapi.errors(*openapi.TOKENIZER_ERRORS))
    async def detokenize(body: DetokenizeRequest):
        state.ready()
        serving = state.completions
        serving.check_model(body.model)
        return {"prompt": await serving.detokenize(body.tokens)}

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
        logger.info("%s %s: the client disconnected, request aborted (499)", request.method, request.url.path)
        return Response(status_code=499)
    finally:
        watcher.cancel()

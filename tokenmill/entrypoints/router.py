"""`tokenmill router --replica URL ...`: one OpenAI-compatible endpoint in front of separately
started `tokenmill serve` instances (on this machine or others), as SGLang's cache-aware router.

Each completion or chat request is tokenized here with the served model's tokenizer (chats through
its chat template) and sent to the replica chosen by engine/router.py: the one whose KV cache most
likely holds the prompt's leading blocks, balanced by outstanding tokens. A replica that refuses
the connection or answers 503 before anything streamed is marked down and the request goes to
another; a replica is probed back up by /health every few seconds. Responses, streamed or not,
pass through unchanged.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest

from tokenmill.engine.router import PrefixAffinityRouter
from tokenmill.entrypoints.openai.http_errors import error_body

logger = logging.getLogger("tokenmill.router")
_PROBE_S = 2.0


class ReplicaSet:
    def __init__(self, urls: list[str], tokenizer, block_size: int, policy: str):
        self.urls = [u.rstrip("/").removesuffix("/v1") for u in urls]
        self.tokenizer = tokenizer
        self.router = PrefixAffinityRouter(len(urls), block_size, policy)
        self.client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0),
                                        limits=httpx.Limits(max_connections=1024))
        self.registry = CollectorRegistry()
        self.routed = Counter("tokenmill_router:requests", "Requests sent to each replica.", ["replica"],
                              registry=self.registry)
        self.retried = Counter("tokenmill_router:retries", "Requests re-sent after a replica refused them.",
                               registry=self.registry)
        up = Gauge("tokenmill_router:replica_up", "Whether the replica answers /health.", ["replica"],
                   registry=self.registry)
        for i in range(len(urls)):
            up.labels(replica=str(i)).set_function(lambda i=i: float(self.router.alive[i]))

    def prompt_ids(self, path: str, body: dict) -> list[int]:
        """The token ids the replica will see, near enough for routing."""
        try:
            if path.endswith("chat/completions"):
                text = self.tokenizer.apply_chat_template(body.get("messages") or [], tokenize=False,
                                                          add_generation_prompt=True)
                return self.tokenizer.encode(text, add_special_tokens=False)
            prompt = body.get("prompt", "")
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
                return prompt
            return self.tokenizer.encode(prompt if isinstance(prompt, str) else str(prompt))
        except Exception:  # noqa: BLE001 - a body the replica will reject: route it anywhere
            return []

    async def probe(self) -> None:
        while True:
            for i, url in enumerate(self.urls):
                try:
                    ok = (await self.client.get(url + "/health", timeout=2.0)).status_code == 200
                except httpx.HTTPError:
                    ok = False
                if ok != self.router.alive[i]:
                    logger.warning("replica %d (%s) is %s", i, url, "up" if ok else "down")
                    self.router.set_alive(i, ok)
            await asyncio.sleep(_PROBE_S)

    async def forward(self, request: Request, path: str) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except ValueError:
            body = {}
        ids = self.prompt_ids(path, body if isinstance(body, dict) else {})
        cost = len(ids) + int(body.get("max_tokens") or body.get("max_completion_tokens") or 256
                              if isinstance(body, dict) else 0)
        headers = {k: v for k, v in request.headers.items() if k.lower() in ("authorization", "content-type")}
        tried = set()
        while True:
            try:
                replica = self.router.route(ids, cost)
            except RuntimeError:
                return JSONResponse(error_body("no replica is available", "service_unavailable", 503), 503)
            if replica in tried:  # every live one refused it
                self.router.finish(replica, cost)
                return JSONResponse(error_body("every replica refused the request", "service_unavailable", 503),
                                    503)
            tried.add(replica)
            self.routed.labels(replica=str(replica)).inc()
            req = self.client.build_request("POST", self.urls[replica] + path, content=raw, headers=headers)
            try:
                upstream = await self.client.send(req, stream=True)
            except httpx.TransportError as e:
                logger.warning("replica %d refused a request (%s); marking it down", replica, type(e).__name__)
                self.router.finish(replica, cost)
                self.router.set_alive(replica, False)
                self.retried.inc()
                continue
            if upstream.status_code == 503:  # loading or draining: nothing was generated
                await upstream.aclose()
                self.router.finish(replica, cost)
                self.retried.inc()
                continue
            return StreamingResponse(self._relay(upstream, replica, cost), status_code=upstream.status_code,
                                     media_type=upstream.headers.get("content-type"))

    async def _relay(self, upstream: httpx.Response, replica: int, cost: int):
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        except httpx.HTTPError as e:  # the replica died mid-response: say so in the stream's own terms
            logger.error("replica %d failed mid-response: %s", replica, e)
            msg = f"replica {replica} failed mid-response: {type(e).__name__}"
            yield f"data: {json.dumps({'error': error_body(msg, 'internal_error', 500)['error']})}\n\n".encode()
        finally:
            await upstream.aclose()
            self.router.finish(replica, cost)


def build_router_app(urls: list[str], tokenizer, block_size: int = 16, policy: str = "affinity") -> FastAPI:
    replicas = ReplicaSet(urls, tokenizer, block_size, policy)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        task = asyncio.create_task(replicas.probe())
        yield
        task.cancel()
        await replicas.client.aclose()

    app = FastAPI(title="tokenmill router", lifespan=lifespan)
    app.state.replicas = replicas

    @app.get("/health")
    async def health():
        return Response(status_code=200 if any(replicas.router.alive) else 503)

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(replicas.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        for i, url in enumerate(replicas.urls):
            if replicas.router.alive[i]:
                with contextlib.suppress(httpx.HTTPError):
                    r = await replicas.client.get(url + "/v1/models", timeout=5.0)
                    return Response(r.content, r.status_code, media_type="application/json")
        return JSONResponse(error_body("no replica is available", "service_unavailable", 503), 503)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await replicas.forward(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await replicas.forward(request, "/v1/chat/completions")

    return app


def run_router(urls: list[str], model: str | None, host: str, port: int, policy: str, block_size: int) -> int:
    import uvicorn

    from tokenmill.model.loader import load_tokenizer, resolve_model

    t0 = time.monotonic()
    tokenizer = load_tokenizer(resolve_model(model))
    app = build_router_app(urls, tokenizer, block_size, policy)
    logger.info("routing to %d replica(s) (%s) on http://%s:%d, ready in %.1fs", len(urls), policy, host, port,
                time.monotonic() - t0)
    uvicorn.run(app, host=host, port=port, log_level="info", access_log=False)
    return 0

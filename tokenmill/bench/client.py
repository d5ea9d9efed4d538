"""The benchmark's HTTP client: one streamed request at a time per call, its timeline recorded
(send, first content chunk, every chunk, end, usage, errors). Its own work is timed too, so the
report can state the client's overhead per request.

Keep-alive: a server may close an idle or much-used connection at any time (llama.cpp's server does
after a few requests or seconds), and a request written to it just then fails before the server has
read it. Such a request, sent on a reused connection and ended without one byte of response, is sent
again on a fresh connection (as browsers do, RFC 9112 9.3.1); a server that answered nothing never
processed it. A failure on a fresh connection, or after any response byte, counts as failed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time

import aiohttp

from tokenmill.bench.datasets import BenchRequest
from tokenmill.bench.serve_metrics import RequestRecord
from tokenmill.core.messages import SPEC_COUNTS


class _Attempt:
    """What one try of a request saw of its connection (filled by the session's trace hooks)."""

    reused = False
    responded = False


def connection_reuse_trace() -> aiohttp.TraceConfig:
    """Marks an attempt whose request went out on a pooled (reused) keep-alive connection."""
    async def on_reuse(session, ctx, params) -> None:
        if isinstance(ctx.trace_request_ctx, _Attempt):
            ctx.trace_request_ctx.reused = True

    trace = aiohttp.TraceConfig()
    trace.on_connection_reuseconn.append(on_reuse)
    return trace


class StreamingClient:
    """Sends one streamed request and records its timeline into a RequestRecord. `session` must carry
    `connection_reuse_trace()`; `fresh_session` (never reusing a connection) sends the retries."""

    max_retries = 3  # a request that keeps meeting closing connections is a failure after all

    def __init__(self, session: aiohttp.ClientSession, root: str, endpoint: str, model: str | None,
                 api_key: str | None, ignore_eos: bool, temperature: float,
                 fresh_session: aiohttp.ClientSession | None = None):
        self.session = session
        self.fresh_session = fresh_session
        self.chat = endpoint == "chat"
        self.url = root + ("/v1/chat/completions" if self.chat else "/v1/completions")
        self.headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.fields: dict = {"stream": True, "stream_options": {"include_usage": True}, "temperature": temperature}
        if model:
            self.fields["model"] = model
        if ignore_eos:
            self.fields["ignore_eos"] = True  # vLLM's extension; OpenAI itself would reject it

    async def send(self, req: BenchRequest, rec: RequestRecord, t0: float) -> None:
        start, cpu = time.perf_counter(), time.thread_time()
        body = {**self.fields, "max_tokens": req.output_len}
        if self.chat:
            body["messages"] = [{"role": "user", "content": req.prompt}]
        else:
            body["prompt"] = req.prompt
        data = json.dumps(body).encode()
        rec.cpu_s += time.thread_time() - cpu
        rec.sent_at = time.perf_counter() - t0
        rec.overhead_s += rec.sent_at + t0 - start
        session = self.session
        while True:
            attempt = _Attempt()
            try:
                async with session.post(self.url, data=data, headers=self.headers, trace_request_ctx=attempt) as resp:
                    attempt.responded = True
                    rec.status = resp.status
                    if resp.status != 200:
                        rec.error = _error_message(await resp.text(errors="replace")) or resp.reason or "HTTP error"
                        return
                    await self._read_stream(resp, rec, t0)
                return
            except asyncio.CancelledError:
                rec.cancelled = True
                raise
            except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as e:
                if (attempt.reused and not attempt.responded and self.fresh_session is not None
                        and rec.retries < self.max_retries):
                    rec.retries += 1  # the server closed the connection before reading the request
                    session = self.fresh_session
                    continue
                rec.error = f"{type(e).__name__}: {e}".rstrip(": ")
                return
            except (aiohttp.ClientError, TimeoutError) as e:  # connection refused, bad response, timeout
                rec.error = f"{type(e).__name__}: {e}".rstrip(": ")
                return

    async def _read_stream(self, resp: aiohttp.ClientResponse, rec: RequestRecord, t0: float) -> None:
        buf, done, now = b"", False, time.perf_counter()
        async for data in resp.content.iter_any():
            now, cpu = time.perf_counter(), time.thread_time()  # every event in this read arrived now
            buf += data
            if b"\r" in buf:
                buf = buf.replace(b"\r\n", b"\n")
            while not done and (end := buf.find(b"\n\n")) >= 0:
                event, buf = buf[:end], buf[end + 2:]
                for line in event.split(b"\n"):
                    if line.startswith(b"data:") and self._on_data(line[5:].strip(), rec, now - t0):
                        done = True
            rec.overhead_s += time.perf_counter() - now
            rec.cpu_s += time.thread_time() - cpu
            if done:
                break
        if done and not resp.content.at_eof():
            # read the end of the body (normally already there) so the connection goes back to the pool
            with contextlib.suppress(TimeoutError, aiohttp.ClientError):
                await asyncio.wait_for(resp.content.read(), 1.0)
        start, cpu = time.perf_counter(), time.thread_time()
        if rec.end_at is None:  # the stream closed without [DONE]
            rec.end_at = now - t0
        if not rec.usage_reported:
            rec.output_tokens = len(rec.chunk_times)  # servers without usage: count content chunks
        if rec.error is None and rec.first_token_at is None:
            rec.error = "the stream ended without any content"
        rec.overhead_s += time.perf_counter() - start
        rec.cpu_s += time.thread_time() - cpu

    def _on_data(self, payload: bytes, rec: RequestRecord, t: float) -> bool:
        """One SSE data payload; True at [DONE]."""
        if payload == b"[DONE]":
            rec.end_at = t
            return True
        try:
            obj = json.loads(payload)
        except ValueError:
            rec.error = f"malformed SSE data: {payload[:80]!r}"
            return True
        if obj.get("error"):
            err = obj["error"]
            rec.error = str(err.get("message", err) if isinstance(err, dict) else err)
            if isinstance(err, dict) and isinstance(err.get("code"), int):
                rec.status = err["code"]
            return False
        if choices := obj.get("choices"):
            c = choices[0]
            # chat's first chunk only carries the role: it is not a token
            text = (c.get("delta") or {}).get("content") if self.chat else c.get("text")
            if text:
                if rec.first_token_at is None:
                    rec.first_token_at = t
                rec.chunk_times.append(t)
        if usage := obj.get("usage"):
            rec.prompt_tokens = usage.get("prompt_tokens")
            rec.output_tokens = usage.get("completion_tokens")
            rec.usage_reported = True
            if isinstance(spec := usage.get("spec_decode"), dict):  # tokenmill's, with speculation
                rec.spec = tuple(int(spec.get(k) or 0) for k in SPEC_COUNTS)
        return False


def _error_message(body: str) -> str | None:
    try:
        err = json.loads(body).get("error")
        return str(err.get("message", err) if isinstance(err, dict) else err or body[:200])
    except (ValueError, AttributeError):
        return body[:200] or None

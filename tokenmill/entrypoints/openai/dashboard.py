"""The live dashboard: `GET /dashboard` (one static page, no build step, assets served from the
package, uPlot vendored with its licence) polls `GET /dashboard/api/state` about once a second.

The data is plain: a StatLogger fed by the engine after every step (as the Prometheus one is) keeps
the last minute of latencies, token counts and finished requests; the KV block map is asked of the
engine thread between two steps (`AsyncLLMEngine.kv_block_states`). Both can cross a process
boundary unchanged. The page and its assets are open; the data endpoint follows --api-key (the
page asks for the key and sends it as a Bearer token). `--disable-dashboard` removes all of it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections import deque
from pathlib import Path

import numpy as np
from fastapi import FastAPI
from fastapi.responses import FileResponse, JSONResponse, Response

from tokenmill.core.messages import SPEC_COUNTS, SchedulerStats
from tokenmill.engine.stats import IterationStats, StatLogger

STATIC = Path(__file__).resolve().parent / "dashboard_static"
_ASSETS = {"dashboard.js": "text/javascript", "dashboard.css": "text/css", "uPlot.iife.min.js": "text/javascript",
           "uPlot.min.css": "text/css", "uPlot.LICENSE": "text/plain"}
WINDOW_S = 60.0  # latency percentiles and the timeline cover the last minute
RATE_WINDOW_S = 10.0  # throughput is averaged over the last 10 seconds


class DashboardRecorder(StatLogger):
    """Keeps the last minute of what the engine reports after each step (on the engine thread; the
    event loop reads under the same short lock)."""

    def __init__(self, max_requests: int = 64):
        self.lock = threading.Lock()
        self.ttft: deque[tuple[float, float]] = deque()
        self.itl: deque[tuple[float, float]] = deque()
        self.tpot: deque[tuple[float, float]] = deque()
        self.e2e: deque[tuple[float, float]] = deque()
        self.tokens: deque[tuple[float, int, int, int]] = deque()  # (t, prompt, generated, finished)
        self.prefix: deque[tuple[float, int, int]] = deque()  # (t, queries, hits), cumulative, ~1/s
        self.requests: deque[dict] = deque(maxlen=max_requests)
        self.sched: SchedulerStats | None = None
        self.totals = {"prompt_tokens": 0, "generation_tokens": 0, "finished_requests": 0}
        self.engine_seconds = 0.0  # time spent in record(), to state the dashboard's own cost
        self.started = time.monotonic()

    def record(self, sched: SchedulerStats, it: IterationStats) -> None:
        start = time.perf_counter()
        now = time.monotonic()
        with self.lock:
            self.sched = sched
            self.ttft.extend((now, v) for v in it.ttfts)
            self.itl.extend((now, v) for v in it.itls)
            finished = 0
            for f in it.finished:
                finished += len(f.finish_reasons)
                self.e2e.append((now, f.e2e_latency))
                if f.ttft is not None and f.num_generation_tokens > 1:
                    self.tpot.append((now, (f.e2e_latency - f.ttft) / (f.num_generation_tokens - 1)))
                self.requests.append({"end": now, "e2e": f.e2e_latency, "queue": f.queue_time, "ttft": f.ttft,
                                      "prompt_tokens": f.num_prompt_tokens, "cached_tokens": f.num_cached_tokens,
                                      "output_tokens": f.num_generation_tokens, "finish": f.finish_reasons,
                                      "spec": f.spec})
            if it.num_prompt_tokens or it.num_generation_tokens or finished:
                self.tokens.append((now, it.num_prompt_tokens, it.num_generation_tokens, finished))
            self.totals["prompt_tokens"] += it.num_prompt_tokens
            self.totals["generation_tokens"] += it.num_generation_tokens
            self.totals["finished_requests"] += finished
            if not self.prefix or now - self.prefix[-1][0] >= 1.0:
                self.prefix.append((now, sched.prefix_queries, sched.prefix_hits))
            horizon = now - WINDOW_S
            for q in (self.ttft, self.itl, self.tpot, self.e2e, self.tokens, self.prefix):
                while q and q[0][0] < horizon:
                    q.popleft()
        self.engine_seconds += time.perf_counter() - start

    def snapshot(self, now: float) -> dict:
        with self.lock:
            lat = {name: [v for _, v in q] for name, q in
                   (("ttft", self.ttft), ("tpot", self.tpot), ("itl", self.itl), ("e2e", self.e2e))}
            tokens = [t for t in self.tokens if t[0] >= now - RATE_WINDOW_S]
            prefix = list(self.prefix)
            requests = list(self.requests)
            sched, totals = self.sched, dict(self.totals)
        span = min(RATE_WINDOW_S, max(now - self.started, 1e-3))
        q1m = prefix[-1][1] - prefix[0][1] if len(prefix) > 1 else 0
        h1m = prefix[-1][2] - prefix[0][2] if len(prefix) > 1 else 0
        return {
            "running": sched.num_running if sched else 0, "waiting": sched.num_waiting if sched else 0,
            "throughput": {"generation_tokens_per_s": sum(t[2] for t in tokens) / span,
                           "prompt_tokens_per_s": sum(t[1] for t in tokens) / span,
                           "requests_per_s": sum(t[3] for t in tokens) / span},
            "latency_ms": {name: _percentiles(values) for name, values in lat.items()},
            "prefix_cache": {"queries_total": sched.prefix_queries if sched else 0,
                             "hits_total": sched.prefix_hits if sched else 0,
                             "hit_rate_1m": h1m / q1m if q1m else None},
            "preemptions_total": sched.num_preemptions if sched else 0,
            "totals": totals,
            "recent_requests": [_timeline_entry(r, now) for r in requests if now - r["end"] <= WINDOW_S],
        }


def _percentiles(values: list[float]) -> dict:
    if not values:
        return {"p50": None, "p99": None, "count": 0}
    p50, p99 = np.percentile(np.asarray(values), [50, 99]) * 1000
    return {"p50": float(p50), "p99": float(p99), "count": len(values)}


def _timeline_entry(r: dict, now: float) -> dict:
    """Seconds before now: arrival, end of queueing, first token, end."""
    arrival = now - r["end"] + r["e2e"]
    first = arrival - (r["ttft"] if r["ttft"] is not None else r["e2e"])
    return {"arrival_ago": arrival, "scheduled_ago": arrival - (r["queue"] or 0.0), "first_token_ago": first,
            "end_ago": now - r["end"], "prompt_tokens": r["prompt_tokens"], "cached_tokens": r["cached_tokens"],
            "output_tokens": r["output_tokens"], "finish": r["finish"],
            # speculative decoding: verifications with drafts, draft tokens, accepted ones
            "spec_decode": dict(zip(SPEC_COUNTS, r["spec"]))}


def register_dashboard(app: FastAPI, state) -> DashboardRecorder:
    """Add the dashboard's routes and its stat logger to a server (api_server.build_app)."""
    recorder = DashboardRecorder()
    state.extra_stat_loggers.append(recorder)
    state.open_paths.update({"/dashboard", *(f"/dashboard/static/{name}" for name in _ASSETS)})
    server_settings = {k: v for k, v in dataclasses.asdict(state.config).items() if k != "api_key"}
    server_settings["api_key"] = "set" if state.config.api_key else None

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard_page():
        return FileResponse(STATIC / "index.html", media_type="text/html", headers={"Cache-Control": "no-cache"})

    @app.get("/dashboard/static/{name}", include_in_schema=False)
    async def dashboard_asset(name: str):
        if name not in _ASSETS:
            return Response(status_code=404)
        return FileResponse(STATIC / name, media_type=_ASSETS[name])

    @app.get("/dashboard/api/state", include_in_schema=False)
    async def dashboard_state():
        engine = state.engine
        if engine is None or not engine.is_running:
            return JSONResponse({"ready": False, "model": state.model_name}, status_code=503)
        try:
            blocks = await asyncio.wait_for(engine.kv_block_states(), timeout=5.0)
        except TimeoutError:
            blocks = None
        now = time.monotonic()
        snap = recorder.snapshot(now)
        sched = recorder.sched
        snap.update({
            "ready": True, "model": state.model_name, "time": time.time(), "uptime_s": now - recorder.started,
            "kv": {"usage": sched.kv_cache_usage if sched else 0.0, "blocks_total": len(blocks or ""),
                   "blocks_used": (blocks or "").count("1"), "blocks_cached": (blocks or "").count("2"),
                   "block_size": state.engine_config.cache.block_size, "states": blocks},
            "config": {"engine": dataclasses.asdict(state.engine_config), "server": server_settings,
                       "max_model_len": engine.max_model_len},
        })
        snap["dashboard_cost"] = {"recorder_engine_thread_s_total": recorder.engine_seconds}
        return JSONResponse(snap, headers={"Cache-Control": "no-store"})

    return recorder

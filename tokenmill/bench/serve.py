"""`tokenmill bench serve`: load any OpenAI-compatible server with streamed requests and measure
what users feel (TTFT, TPOT, ITL, E2E, throughput, goodput). See serve_metrics for the definitions.

The client must not be the bottleneck: one asyncio process, one aiohttp session whose connection
pool is at least the concurrency, hand-rolled SSE parsing, and the client's own work per request
(request encoding, parsing, bookkeeping) timed and reported as client_overhead_ms_per_request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import signal
import sys
import time
from dataclasses import dataclass

import aiohttp

from tokenmill.bench.client import StreamingClient, connection_reuse_trace
from tokenmill.bench.datasets import BenchRequest, build_workload, pick_tokenizer, synthetic_text
from tokenmill.bench.serve_metrics import RequestRecord, parse_slo, print_run, print_sweep, summarize
from tokenmill.errors import ConfigError


@dataclass
class LoadPoint:
    mode: str  # "concurrency" (closed loop) or "request_rate" (open loop)
    value: float

    @property
    def label(self) -> str:
        if self.mode == "concurrency":
            return f"concurrency {int(self.value)}"
        return "request rate inf" if math.isinf(self.value) else f"request rate {self.value:g}/s"

    def to_dict(self) -> dict:
        return {"mode": self.mode, "value": "inf" if math.isinf(self.value) else self.value, "label": self.label}


def arrival_times(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Start offsets (s) of n requests: gamma inter-arrivals with mean 1/rate (shape 1 = Poisson)."""
    if math.isinf(rate):
        return [0.0] * n
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.gammavariate(burstiness, 1.0 / (rate * burstiness))
    return out


async def run_load_point(client: StreamingClient, requests: list[BenchRequest], point: LoadPoint,
                         stop: asyncio.Event, burstiness: float = 1.0, seed: int = 0, progress: bool = True):
    """Send every request once under the load shape, until done or `stop` is set (then cancel what
    is in flight). Returns (records, duration in s, event-loop lag samples in s)."""
    from tqdm import tqdm

    records = [RequestRecord(i, r.prompt_len, r.output_len) for i, r in enumerate(requests)]
    bar = tqdm(total=len(requests), desc=point.label, unit="req", disable=None if progress else True, leave=False)
    lags: list[float] = []
    t0 = time.perf_counter()

    async def one(i: int) -> None:
        await client.send(requests[i], records[i], t0)
        bar.update(1)

    if point.mode == "concurrency":
        pending = iter(range(len(requests)))  # shared by the workers: each request is taken once

        async def worker() -> None:
            for i in pending:
                await one(i)

        load = asyncio.gather(*(worker() for _ in range(min(int(point.value), len(requests)))))
    else:
        load = asyncio.ensure_future(_open_loop(one, arrival_times(len(requests), point.value, burstiness, seed), t0))
    watcher, stopper = asyncio.create_task(_watch_lag(lags)), asyncio.create_task(stop.wait())
    try:
        await asyncio.wait({load, stopper}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (load, watcher, stopper):
            task.cancel()
        outcome = (await asyncio.gather(load, watcher, stopper, return_exceptions=True))[0]
        duration = time.perf_counter() - t0
        bar.close()
    if isinstance(outcome, Exception):  # a bug in the client, not a failed request
        raise outcome
    return records, duration, lags


async def _open_loop(one, offsets: list[float], t0: float) -> None:
    tasks: list[asyncio.Task] = []
    try:
        for i, at in enumerate(offsets):
            # asyncio's timer can fire a millisecond early (its clock is not perf_counter): never send early
            while (delay := t0 + at - time.perf_counter()) > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i)))
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _watch_lag(samples: list[float], period: float = 0.01) -> None:
    """How late the event loop wakes up: near 0 unless the client itself is saturated."""
    while True:
        t = time.perf_counter()
        await asyncio.sleep(period)
        samples.append(time.perf_counter() - t - period)


async def run_bench(args, root: str, model: str | None, points: list[LoadPoint], workloads: list[list[BenchRequest]],
                    slo: dict[str, float], console=None, stop: asyncio.Event | None = None,
                    warmup: list[BenchRequest] = ()) -> tuple[list[dict], bool]:
    """The warmup requests (unrecorded), then every load point in turn; returns (one summary per load
    point run, whether it was interrupted)."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()

    def on_sigint() -> None:
        print("\ninterrupted: cancelling the requests in flight (Ctrl-C again to quit at once)", file=sys.stderr)
        stop.set()
        loop.remove_signal_handler(signal.SIGINT)  # a second Ctrl-C raises KeyboardInterrupt

    with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):  # not in the main thread
        loop.add_signal_handler(signal.SIGINT, on_sigint)
    # closed loop: a pool as large as the largest concurrency; open loop: unbounded (0)
    limit = max(int(p.value) for p in points) if points[0].mode == "concurrency" else 0
    runs: list[dict] = []
    try:
        timeout = aiohttp.ClientTimeout(total=args.timeout)
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=limit), timeout=timeout,
                                         trace_configs=[connection_reuse_trace()]) as session, \
                aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0, force_close=True),
                                      timeout=timeout) as fresh_session:
            client = StreamingClient(session, root, args.endpoint, model, args.api_key, args.ignore_eos,
                                     args.temperature, fresh_session)
            if warmup:
                records, _, _ = await run_load_point(client, list(warmup), LoadPoint("concurrency", 1), stop,
                                                     progress=not args.no_progress)
                if console is not None:
                    console.print(f"warmup: {sum(r.ok for r in records)} of {len(records)} requests completed")
            for k, (point, requests) in enumerate(zip(points, workloads)):
                if stop.is_set():
                    break
                records, duration, lags = await run_load_point(client, requests, point, stop, args.burstiness,
                                                               args.workload_seed + k, not args.no_progress)
                run = {"load": point.to_dict(), **summarize(records, duration, slo),
                       "event_loop_lag_ms": {"mean": 1000 * sum(lags) / len(lags) if lags else 0.0,
                                             "max": 1000 * max(lags, default=0.0)},
                       "connection_pool_limit": limit, "requests": [r.to_dict() for r in records]}
                runs.append(run)
                if console is not None:
                    print_run(console, run)
    finally:
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.remove_signal_handler(signal.SIGINT)
    return runs, stop.is_set()


def server_root(base_url: str, local_only: bool = False) -> str:
    """http://host:port[/v1] -> http://host:port; with local_only, refuse anything but loopback."""
    import ipaddress
    import socket
    import urllib.parse

    url = base_url.strip().rstrip("/")
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"--base-url must look like http://HOST:PORT, got {base_url!r}")
    if local_only:
        try:
            addresses = {info[4][0] for info in socket.getaddrinfo(parts.hostname, None)}
        except socket.gaierror as e:
            raise ConfigError(f"--local-only: cannot resolve {parts.hostname!r} ({e.strerror})") from None
        if not all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addresses):
            raise ConfigError(f"--local-only: {parts.hostname} is not a loopback address "
                              f"({', '.join(sorted(addresses))}); refusing to send load there")
    return url[:-3] if url.endswith("/v1") else url


def list_models(root: str, api_key: str | None) -> list[str]:
    """GET /v1/models: checks the server answers (one-line error if not) and names its models."""
    import urllib.error
    import urllib.request

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # direct, like aiohttp
        with opener.open(urllib.request.Request(root + "/v1/models", headers=headers), timeout=30) as r:
            return [m["id"] for m in json.loads(r.read()).get("data", []) if isinstance(m, dict) and "id" in m]
    except urllib.error.HTTPError as e:
        if e.code in (401, 403):
            raise ConfigError(f"{root} refused the API key (HTTP {e.code}); give --api-key") from None
        if e.code == 503:
            raise ConfigError(f"{root} is not ready (HTTP 503: still loading or shutting down)") from None
        return []  # no /v1/models: requests go without a model name unless --model is given
    except (urllib.error.URLError, OSError) as e:
        raise ConfigError(f"cannot reach {root}: {getattr(e, 'reason', e)}") from None
    except ValueError:
        return []


def load_points(args) -> list[LoadPoint]:
    mode = "request_rate" if args.request_rate is not None else "concurrency"
    given = args.request_rate if mode == "request_rate" else args.concurrency
    if given and args.sweep:
        raise ConfigError("give the load points either after --concurrency/--request-rate or with --sweep, not both")
    values = given or args.sweep or [1]
    if mode == "concurrency":
        if any(math.isinf(v) or not float(v).is_integer() for v in values):
            raise ConfigError(f"concurrencies must be whole numbers, got {','.join(f'{v:g}' for v in values)}")
        values = [int(v) for v in values]
    return [LoadPoint(mode, v) for v in values]


def check_args(args) -> None:
    for name, ok in (("num_prompts", args.num_prompts >= 1), ("input_len", args.input_len >= 1),
                     ("output_len", args.output_len >= 1), ("range_ratio", 0 <= args.range_ratio < 1),
                     ("shared_prefix_len", args.shared_prefix_len >= 0), ("burstiness", args.burstiness > 0),
                     ("timeout", args.timeout > 0), ("temperature", args.temperature >= 0),
                     ("warmup", args.warmup >= 0)):
        if not ok:
            value = getattr(args, name)
            raise ConfigError(f"--{name.replace('_', '-')} {value} is out of range")


def main(args) -> int:
    import os

    from rich.console import Console

    check_args(args)
    args.api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    try:
        slo = parse_slo(args.slo)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    points = load_points(args)
    root = server_root(args.base_url, args.local_only)
    models = list_models(root, args.api_key)
    model = args.model or (models[0] if models else None)
    tokenizer, tokenizer_name = pick_tokenizer(args.tokenizer, root, args.api_key)
    console = Console(width=None if sys.stdout.isatty() else 150)  # rich assumes 80 columns when piped
    # fresh prompts per load point, so a prefix cache cannot serve one point from the previous one
    workloads = [build_workload(tokenizer, args, args.workload_seed + k) for k in range(len(points))]
    # warmup prompts are their own too (and short): they must not pre-fill the cache with measured prompts
    warmup = synthetic_text(tokenizer, args.warmup, args.input_len, min(args.output_len, 16),
                            seed=args.workload_seed + 10_000) if args.warmup else []
    console.print(f"{root} model={model} endpoint={args.endpoint}: {len(workloads[0])} prompts per load point x "
                  f"{len(points)} point(s); tokens counted with {tokenizer_name}", markup=False)
    runner = asyncio.run
    with contextlib.suppress(ImportError):
        import uvloop

        runner = uvloop.run
    runs, interrupted = runner(run_bench(args, root, model, points, workloads, slo, console, warmup=warmup))
    if len(runs) > 1:
        print_sweep(console, runs)
    result = {"config": {"base_url": root, "model": model, "endpoint": args.endpoint, "tokenizer": tokenizer_name,
                         **{k: getattr(args, k) for k in ("num_prompts", "input_len", "output_len", "range_ratio",
                                                          "shared_prefix_len", "dataset", "ignore_eos", "temperature",
                                                          "burstiness", "timeout")},
                         "seed": args.workload_seed,
                         "slo_ms": {k: v * 1000 for k, v in slo.items()} or None,
                         "load_points": [p.to_dict() for p in points]},
              "interrupted": interrupted, "runs": runs}
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=1)
        console.print(f"results: {args.output_json}")
    if args.plot and runs:
        from tokenmill.bench.plot import plot_runs

        plot_runs(runs, args.plot, title=f"{model or root} ({args.endpoint})")
        console.print(f"plot: {args.plot}")
    if interrupted:
        return 130
    return 0 if any(r["completed"] for r in runs) else 1

"""Debian's real `prometheus` scrapes a running `tokenmill serve`; its HTTP API then answers the
`tokenmill:` series, a `histogram_quantile` of TTFT, and every query of the Grafana dashboard
(deploy/grafana/tokenmill.json)."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server_utils import ServerProcess, free_port

PROMETHEUS = shutil.which("prometheus")
DASHBOARD = Path(__file__).resolve().parent.parent / "deploy" / "grafana" / "tokenmill.json"
pytestmark = pytest.mark.skipif(PROMETHEUS is None, reason="no prometheus binary (Debian's `prometheus` package; "
                                                           "`make system-deps` installs it as root)")


class Prometheus:
    def __init__(self, target: str, tmp_path: Path):
        self.url = f"http://127.0.0.1:{free_port()}"
        config = tmp_path / "prometheus.yml"
        config.write_text(json.dumps({  # YAML is a superset of JSON
            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "scrape_configs": [{"job_name": "tokenmill", "static_configs": [{"targets": [target]}]}]}))
        self.log = open(tmp_path / "prometheus.log", "w")
        self.proc = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={tmp_path / 'data'}",
             f"--web.listen-address={self.url[len('http://'):]}"], stdout=self.log, stderr=subprocess.STDOUT)

    def api(self, path: str, **params) -> dict:
        r = httpx.get(self.url + "/api/v1/" + path, params=params, timeout=10)
        body = r.json()
        assert r.status_code == 200 and body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        return self.api("query", query=expr)["result"]

    def wait(self, what: str, check, timeout: float = 30.0):
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, Path(self.log.name).read_text()
            try:
                if (value := check()) is not None:
                    return value
            except (httpx.HTTPError, AssertionError, ValueError, KeyError):
                pass
            assert time.monotonic() < deadline, f"prometheus: no {what} after {timeout}s"
            time.sleep(0.25)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
        self.log.close()


def metric_samples(url: str) -> dict:
    """(name, frozenset of labels) -> value, straight from /metrics."""
    text = httpx.get(url + "/metrics", timeout=10).text
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def bucket_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus's histogram_quantile over cumulative (upper bound, count) pairs, +Inf last: linear
    interpolation inside the bucket holding the rank."""
    buckets = sorted(buckets)
    rank = q * buckets[-1][1]
    b = next(i for i, (_, count) in enumerate(buckets) if count >= rank)
    if b == len(buckets) - 1:
        return buckets[-2][0]
    start, count = (buckets[b - 1][0], buckets[b][1] - buckets[b - 1][1]) if b else (0.0, buckets[b][1])
    return start + (buckets[b][0] - start) * (rank - (buckets[b - 1][1] if b else 0.0)) / count


def dashboard_queries() -> list[tuple[str, str]]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    return [(p["title"], t["expr"]) for p in panels for t in p["targets"]]


def test_prometheus_scrapes_tokenmill_and_answers_the_dashboard_queries(tmp_path):
    server = ServerProcess().wait_ready()
    prom = Prometheus(f"127.0.0.1:{server.port}", tmp_path)
    try:
        up = prom.wait("healthy target", lambda: [t for t in prom.api("targets")["activeTargets"]
                                                   if t["health"] == "up"] or None)
        assert up[0]["labels"]["job"] == "tokenmill"
        # the load starts after a first scrape, so rate() over the window sees it arrive
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda i: httpx.post(server.url + "/v1/completions", timeout=120, json={
                "prompt": f"Request {i}: the weather today is", "max_tokens": 8, "ignore_eos": True}
            ).raise_for_status(), range(8)))
        samples = metric_samples(server.url)
        model = {"model_name": "SmolLM2-135M-Instruct"}
        generated = samples[("tokenmill:generation_tokens_total", frozenset(model.items()))]
        assert generated == 64

        def scraped_everything():
            result = prom.query("tokenmill:generation_tokens_total")
            return result if result and float(result[0]["value"][1]) == generated else None

        result = prom.wait("scrape of the finished load", scraped_everything)
        assert result[0]["metric"] == {"__name__": "tokenmill:generation_tokens_total", "job": "tokenmill",
                                       "instance": f"127.0.0.1:{server.port}", **model}

        # a quantile of TTFT over the whole run equals the one computed from /metrics's own buckets
        buckets = [(float(dict(labels)["le"]), value) for (name, labels), value in samples.items()
                   if name == "tokenmill:time_to_first_token_seconds_bucket"]
        assert max(count for _, count in buckets) == 8
        for q in (0.5, 0.99):
            (row,) = prom.query(f"histogram_quantile({q}, sum by(le) (tokenmill:time_to_first_token_seconds_bucket))")
            assert float(row["value"][1]) == pytest.approx(bucket_quantile(q, buckets), rel=1e-9)
        # the dashboard's form: over a rate window that holds the load
        (row,) = prom.query("histogram_quantile(0.99, sum by(le) (rate(tokenmill:time_to_first_token_seconds_bucket"
                            "[1m])))")
        p99 = float(row["value"][1])
        assert 0 < p99 <= min(le for le, count in buckets if count == 8)

        # every query of the Grafana dashboard parses and returns series for this model
        for title, expr in dashboard_queries():
            expr = expr.replace("$__rate_interval", "1m").replace("$model_name", model["model_name"])
            rows = prom.query(expr)
            assert rows, f"{title}: {expr} returned nothing"
            if "generation_tokens" in expr or "time_to_first_token" in expr:
                assert all(math.isfinite(float(r["value"][1])) for r in rows), (title, expr, rows)
    finally:
        prom.stop()
        server.stop()

"""The live dashboard (GET /dashboard): its routes and data without a browser, then the page itself in
Debian's headless chromium (selenium + chromium-driver) while a load runs: the numbers move, and once
the load is over they equal /metrics. With TOKENMILL_DASHBOARD_SCREENSHOT=docs/dashboard.png the browser
test refreshes the README's screenshot."""

from __future__ import annotations

import importlib.util
import os
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.server_utils import ServerProcess

REPO = Path(__file__).resolve().parent.parent
STATIC = REPO / "tokenmill" / "entrypoints" / "openai" / "dashboard_static"
CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
KEY = "sekret"


def load(server: ServerProcess, n: int, max_tokens: int = 48, workers: int = 4,
         until: threading.Event | None = None) -> list[int]:
    """n requests, `workers` at a time; with `until`, each worker goes on sending until it is set."""
    def one(i: int) -> int:
        return httpx.post(server.url + "/v1/completions", timeout=300, headers={"Authorization": f"Bearer {KEY}"},
                          json={"prompt": f"Request {i}: a story about the sea", "max_tokens": max_tokens,
                                "ignore_eos": True, "temperature": 1.0}).status_code

    def worker(w: int) -> list[int]:
        out, i = [], w
        while i < n or (until is not None and not until.is_set()):
            out.append(one(i))
            i += workers
        return out
    with ThreadPoolExecutor(workers) as pool:
        return [code for codes in pool.map(worker, range(workers)) for code in codes]


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--api-key", KEY).wait_ready()
    yield srv
    srv.stop()


def test_dashboard_routes_data_and_api_key(server):
    page = httpx.get(server.url + "/dashboard")  # the page and its assets are open: they hold no data
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    for name in ("dashboard.js", "dashboard.css", "uPlot.iife.min.js", "uPlot.min.css", "uPlot.LICENSE"):
        assert httpx.get(f"{server.url}/dashboard/static/{name}").status_code == 200, name
    auth = {"Authorization": f"Bearer {KEY}"}
    assert httpx.get(server.url + "/dashboard/static/dashboard.py", headers=auth).status_code == 404
    # no CDN: every script and style the page loads is served by tokenmill itself
    for name in ("index.html", "dashboard.js", "dashboard.css"):
        assert "http://" not in (STATIC / name).read_text() and "https://" not in (STATIC / name).read_text()
    assert "MIT License" in (STATIC / "uPlot.LICENSE").read_text()
    # the data follows --api-key
    assert httpx.get(server.url + "/dashboard/api/state").status_code == 401
    statuses = load(server, 4, max_tokens=8)
    assert statuses == [200] * 4
    state = httpx.get(server.url + "/dashboard/api/state", headers=auth).json()
    assert state["ready"] and state["totals"]["finished_requests"] == 4 and state["totals"]["generation_tokens"] == 32
    assert state["latency_ms"]["ttft"]["count"] == 4 and state["latency_ms"]["itl"]["count"] == 4 * 7
    assert len(state["recent_requests"]) == 4
    for r in state["recent_requests"]:
        assert r["arrival_ago"] >= r["scheduled_ago"] >= r["first_token_ago"] >= r["end_ago"] >= 0
    kv = state["kv"]
    assert len(kv["states"]) == kv["blocks_total"] > 0 and set(kv["states"]) <= {"0", "1", "2"}
    assert kv["blocks_used"] == 0  # idle: nothing in use, the prompts' full blocks (if any) cached
    assert state["config"]["server"]["api_key"] == "set" and KEY not in str(state)
    assert state["config"]["engine"]["cache"]["block_size"] == kv["block_size"] == 16


def test_disable_dashboard_removes_it():
    srv = ServerProcess("--disable-dashboard").wait_ready()
    try:
        assert httpx.get(srv.url + "/dashboard").status_code == 404
        assert httpx.get(srv.url + "/dashboard/api/state").status_code == 404
    finally:
        srv.stop()


@pytest.mark.slow
@pytest.mark.skipif(CHROMIUM is None or CHROMEDRIVER is None,
                    reason="no chromium / chromedriver (Debian's chromium and chromium-driver; `make system-deps` "
                           "installs them as root)")
@pytest.mark.skipif(importlib.util.find_spec("selenium") is None, reason="selenium is not installed")
def test_dashboard_in_a_real_browser_under_load(server, tmp_path):
    shot_path = os.environ.get("TOKENMILL_DASHBOARD_SCREENSHOT", str(tmp_path / "dashboard.png"))
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,2000"):
        options.add_argument(arg)
    # chromium's singleton socket folder goes in TMPDIR and outlives driver.quit(): keep it out of /tmp
    service = Service(CHROMEDRIVER, env={**os.environ, "TMPDIR": str(tmp_path)})
    driver = webdriver.Chrome(service=service, options=options)
    text = lambda element_id: driver.find_element(By.ID, element_id).text  # noqa: E731
    number = lambda element_id: float(text(element_id).replace(",", "").replace(" %", ""))  # noqa: E731

    def updates() -> int:
        return int(driver.find_element(By.TAG_NAME, "body").get_attribute("data-updates") or 0)

    def wait_updates(n: int, timeout: float = 30.0) -> None:
        target, deadline = updates() + n, time.monotonic() + timeout
        while updates() < target:
            assert time.monotonic() < deadline, "the page stopped updating"
            time.sleep(0.1)

    try:
        driver.get(server.url + "/dashboard")
        # the data needs the key: the page asks for it, then shows numbers
        deadline = time.monotonic() + 20
        while not driver.find_element(By.ID, "auth").is_displayed():
            assert time.monotonic() < deadline, "the page did not ask for the API key"
            time.sleep(0.1)
        driver.find_element(By.ID, "key").send_keys(KEY)
        driver.find_element(By.CSS_SELECTOR, "#auth button").click()
        wait_updates(1)
        before = number("generated")
        # the load goes on until the page has shown it running for 8 updates: the page polls once a
        # second, less often while the engine has both cores, and a fixed load could end between polls
        enough, deadline = threading.Event(), time.monotonic() + 120
        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(load, server, 24, 64, until=enough)
            seen_running, generated, shot = 0.0, [before], False
            while not running.done():
                wait_updates(1)
                seen_running = max(seen_running, number("running"))
                generated.append(number("generated"))
                if seen_running and len(generated) >= 8 and not shot:
                    shot = driver.save_screenshot(shot_path)
                if shot or time.monotonic() > deadline:
                    enough.set()
            results = running.result()
            assert len(results) >= 24 and set(results) == {200}
            shot = shot or driver.save_screenshot(shot_path)
        # the numbers moved while the load ran
        assert seen_running >= 1 and len(set(generated)) >= 3 and generated == sorted(generated)
        assert number("gen-rate") > 0 and text("model").startswith("SmolLM2-135M-Instruct")
        # once it is over, they equal /metrics
        server.wait_idle()
        wait_updates(2)
        metrics = server.metrics()
        assert number("generated") == metrics["tokenmill:generation_tokens_total"] == before + len(results) * 64
        samples = httpx.get(server.url + "/metrics").text.splitlines()
        finished = sum(float(line.rsplit(" ", 1)[1]) for line in samples
                       if line.startswith("tokenmill:request_success_total{"))
        assert number("finished") == finished
        assert number("preemptions") == metrics["tokenmill:num_preemptions_total"]
        assert number("running") == metrics["tokenmill:num_requests_running"] == 0
        assert number("waiting") == metrics["tokenmill:num_requests_waiting"] == 0
        assert number("kv-usage") == 100 * metrics["tokenmill:kv_cache_usage_perc"] == 0
        ttft_count = driver.find_element(By.CSS_SELECTOR, "#latency tr[data-metric=ttft] .count").text
        assert int(ttft_count) >= 24  # every request of the last minute
        assert driver.execute_script("return document.querySelectorAll('#config tr').length") > 10
        assert Path(shot_path).stat().st_size > 20_000
        # the only errors: the data requests sent before the key was given
        errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE" and "401" not in e["message"]]
        assert not errors, errors
    finally:
        driver.quit()

"""The ecosystem's own clients against `tokenmill serve`: the openai client's whole supported surface
(examples/openai_surface.py) and guidellm (skipped unless `make install-ecosystem` installed it)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.server_utils import ServerProcess

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess().wait_ready()
    yield srv
    srv.stop()


def test_openai_surface_example_runs_against_tokenmill(server):
    proc = subprocess.run([sys.executable, str(REPO / "examples" / "openai_surface.py"), server.url],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    features = [line.split("  ")[0] for line in proc.stdout.splitlines()]
    assert len(features) == 15 and features[-1] == "errors: bad parameter", proc.stdout


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("guidellm") is None,
                    reason="guidellm is not installed (`make install-ecosystem`, or pip install -e '.[ecosystem]')")
def test_guidellm_benchmarks_tokenmill(server, tmp_path):
    from tokenmill.model.loader import gguf_loader, resolve_model

    out = tmp_path / "guidellm.json"
    tokenizer = gguf_loader.tokenizer_dir(resolve_model(None).path)
    cmd = [str(Path(sys.executable).parent / "guidellm"), "run",
           "--backend", f"kind=openai_http,target={server.url},request_format=/v1/completions",
           "--profile", "kind=synchronous", "--data", "kind=synthetic_text,prompt_tokens=32,output_tokens=8",
           "--tokenizer", f"kind=huggingface_auto,model={tokenizer}", "--constraint", "kind=max_requests,count=4",
           "--output", f"kind=json,path={out}", "--disable-console"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "GUIDELLM__MAX_WORKER_PROCESSES": "1",
           "GUIDELLM__LOGGING__LOG_FILE": str(tmp_path / "guidellm.log")}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (bench,) = json.loads(out.read_text())["benchmarks"]
    metrics = bench["metrics"]
    assert metrics["request_totals"]["successful"] == 4 and metrics["request_totals"]["errored"] == 0
    assert metrics["output_token_count"]["successful"]["total_sum"] == 4 * 8  # max_tokens honoured exactly
    assert metrics["prompt_token_count"]["successful"]["total_sum"] == 4 * 32  # the server counts as guidellm does
    ttft, itl = metrics["time_to_first_token_ms"]["successful"], metrics["inter_token_latency_ms"]["successful"]
    assert ttft["count"] == 4 and 0 < ttft["median"] < 60_000 and 0 < itl["median"] < ttft["max"] + 60_000

"""The CPU a served token costs outside the engine core, measured on a real server.

Behind `tokenmill serve` each output token is also detokenized and streamed by the HTTP front end
(its own process), and read by a client, here `bench serve` on the same machine. When the model's
threads use every core, that work takes its CPU from them: a step is slower by about the CPU time the
other processes spent meanwhile. Calibration measures it on a short streaming run against a real
server on loopback (the front end's and the client's CPU seconds per output token), and the cost
model charges it per sampled row (`StepCostModel.stream_overhead`).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tokenmill.utils.net import free_port, wait_healthy

logger = logging.getLogger(__name__)


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure_stream_overhead(config, concurrency: int = 8, num_prompts: int = 24, output_len: int = 64,
                            timeout: float = 300.0) -> dict:
    """Serve `config` on loopback, stream a closed-loop workload from `bench serve`, and return the
    front end's and the client's CPU seconds per output token (with what they were measured on)."""
    import multiprocessing as mp
    import resource

    from tokenmill.config import ServerConfig
    from tokenmill.entrypoints.openai.launcher import run_server

    port = free_port()
    proc = mp.get_context("spawn").Process(target=run_server, args=(config, ServerConfig(port=port), "warning"),
                                           name="tokenmill-calibration-server")
    proc.start()
    try:
        wait_healthy(f"http://127.0.0.1:{port}", lambda: None if proc.exitcode is None else
                     f"the calibration server exited with code {proc.exitcode}", timeout)
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "run.json"

            def bench(n: int, out_len: int) -> tuple[float, float]:
                """The server's and the client's CPU seconds for a bench serve run."""
                cmd = [sys.executable, "-m", "tokenmill.entrypoints.cli.main", "bench", "serve", "--base-url",
                       f"http://127.0.0.1:{port}", "--concurrency", str(min(n, concurrency)), "--num-prompts",
                       str(n), "--input-len", "32", "--output-len", str(out_len), "--ignore-eos", "--temperature",
                       "1.0", "--warmup", "0", "--no-progress", "--output-json", str(out)]
                front0, client0 = _cpu_seconds(proc.pid), resource.getrusage(resource.RUSAGE_CHILDREN)
                subprocess.run(cmd, check=True, capture_output=True, timeout=timeout)
                front1, client1 = _cpu_seconds(proc.pid), resource.getrusage(resource.RUSAGE_CHILDREN)
                return front1 - front0, sum(client1[:2]) - sum(client0[:2])

            # the client's start-up (imports, tokenizer) is not per token: a one-token run measures it
            _, client_start = bench(1, 1)
            front, client = bench(num_prompts, output_len)
            run = json.loads(out.read_text())["runs"][0]
    finally:
        proc.terminate()
        proc.join(60)
        if proc.exitcode is None:
            proc.kill()
            proc.join()
    tokens = run["output_token_throughput"] * run["duration_s"]
    result = {"front_end_s_per_token": front / tokens, "client_s_per_token": max(0.0, client - client_start) / tokens,
              "concurrency": concurrency, "output_tokens": round(tokens)}
    logger.info("streaming: front end %.3f ms, client %.3f ms of CPU per output token",
                1000 * result["front_end_s_per_token"], 1000 * result["client_s_per_token"])
    return result

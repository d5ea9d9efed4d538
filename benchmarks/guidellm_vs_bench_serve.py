"""guidellm's sweep and `tokenmill bench serve` against the same `tokenmill serve`, at the same load
points, to check the two clients measure the same TTFT and ITL (docs/ecosystem.md has a run).

guidellm's sweep runs synchronous (one at a time), throughput (everything at once), then constant
rates between the two; bench serve then runs concurrency 1, request rate inf and the same rates
(`--burstiness 1000`: nearly constant gaps). Both count ITL the same way on average: guidellm's is
(last token - first token) / (tokens - 1) per request, weighted by tokens; bench serve's is every
gap between chunks (one token each here).

    python benchmarks/guidellm_vs_bench_serve.py [--requests 24] [--input-len 128] [--output-len 64]
Needs `make install-ecosystem`. Results go to bench-results/.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from tokenmill.bench.server_process import ServerProcess

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def server_itl_ms(url: str) -> tuple[float, float]:
    """The server's own inter-token latency histogram: (sum in ms, count)."""
    import httpx

    values = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("tokenmill:inter_token_latency_seconds_"):
            name, value = line.rsplit(" ", 1)
            values[name.split("{")[0].rsplit("_", 1)[1]] = float(value)
    return values["sum"] * 1000, values["count"]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--requests", type=int, default=24, help="requests per load point")
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--sweep-size", type=int, default=4)
    p.add_argument("--port", type=int, default=8120)
    args = p.parse_args()
    out = REPO / "bench-results"
    out.mkdir(exist_ok=True)
    url = f"http://127.0.0.1:{args.port}"
    from tokenmill.model.loader import gguf_loader, resolve_model

    tokenizer = gguf_loader.tokenizer_dir(resolve_model(None).path)
    server = ServerProcess(port=args.port, log_path=str(out / "guidellm-serve.log"))
    try:
        server.wait_ready()
        import resource

        gjson = out / "guidellm.json"
        itl0, cpu0 = server_itl_ms(url), resource.getrusage(resource.RUSAGE_CHILDREN)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "GUIDELLM__MAX_WORKER_PROCESSES": "1",
               "GUIDELLM__LOGGING__LOG_FILE": str(out / "guidellm.log")}
        subprocess.run([str(BIN / "guidellm"), "run", "--backend",
                        f"kind=openai_http,target={url},request_format=/v1/completions",
                        "--profile", f"kind=sweep,sweep_size={args.sweep_size}",
                        "--data", f"kind=synthetic_text,prompt_tokens={args.input_len},output_tokens={args.output_len}",
                        "--tokenizer", f"kind=huggingface_auto,model={tokenizer}",
                        "--constraint", f"kind=max_requests,count={args.requests}",
                        "--output", f"kind=json,path={gjson}", "--disable-progress"], env=env, check=True)
        itl1, cpu1 = server_itl_ms(url), resource.getrusage(resource.RUSAGE_CHILDREN)
        rows = []
        for k, b in enumerate(json.loads(gjson.read_text())["benchmarks"]):
            strategy = b["config"]["strategy"]
            if strategy["type_"] == "synchronous":
                load = ["--concurrency", "1"]
            elif strategy["type_"] == "throughput":
                load = ["--request-rate", "inf"]
            else:
                load = ["--request-rate", f"{strategy['rate']:.4f}", "--burstiness", "1000"]
            tjson = out / f"bench-serve-{k}.json"
            subprocess.run([str(BIN / "tokenmill"), "bench", "serve", "--base-url", url, "--local-only",
                            "--num-prompts", str(args.requests), "--input-len", str(args.input_len),
                            "--output-len", str(args.output_len), "--ignore-eos", "--seed", str(100 + k),
                            "--no-progress", "--output-json", str(tjson), *load], check=True,
                           stdout=subprocess.DEVNULL)
            run = json.loads(tjson.read_text())["runs"][0]
            m = b["metrics"]
            g = {key: m[key]["successful"] for key in ("time_to_first_token_ms", "inter_token_latency_ms")}
            rows.append((strategy["type_"] + (f"@{strategy['rate']:.2f}/s" if "rate" in strategy else ""),
                         g["time_to_first_token_ms"]["median"], run["ttft_ms"]["median"],
                         g["time_to_first_token_ms"]["mean"], run["ttft_ms"]["mean"],
                         g["inter_token_latency_ms"]["mean"], run["itl_ms"]["mean"], run["tpot_ms"]["mean"]))
        itl2, cpu2 = server_itl_ms(url), resource.getrusage(resource.RUSAGE_CHILDREN)
    finally:
        server.stop()
    print("| load point | TTFT p50 guidellm | TTFT p50 bench serve | TTFT mean guidellm | TTFT mean bench serve "
          "| ITL mean guidellm | ITL mean bench serve | TPOT mean bench serve |")
    print("|---|---|---|---|---|---|---|---|")
    for name, *values in rows:
        print(f"| {name} | " + " | ".join(f"{v:.1f}" for v in values) + " |")
    for client, (a, b), (c0, c1) in (("guidellm", (itl0, itl1), (cpu0, cpu1)),
                                     ("bench serve", (itl1, itl2), (cpu1, cpu2))):
        cpu = c1.ru_utime + c1.ru_stime - c0.ru_utime - c0.ru_stime
        print(f"during {client}'s runs: the server's own ITL mean {(b[0] - a[0]) / (b[1] - a[1]):.1f} ms; "
              f"the client used {cpu:.1f} s of CPU")


if __name__ == "__main__":
    main()

"""`tokenmill bench throughput|serve`."""

from __future__ import annotations

import argparse

from tokenmill.entrypoints.cli.args import add_engine_args
from tokenmill.entrypoints.cli.workload_args import add_load_args, add_slo_arg, add_workload_args

_SERVE_EPILOG = """\
load shape:
  --concurrency C      closed loop: C requests in flight; each finished request is replaced at once.
  --request-rate R     open loop: requests start at random times, R per second on average, whether or
                       not earlier ones finished (gamma inter-arrivals; --burstiness 1 is Poisson).
  A comma list (--concurrency 1,4,16,64 or --request-rate 1,2,4) runs one load point per value, each
  with --num-prompts fresh prompts, in one run; the knee of the resulting curves is the capacity.
  --sweep 1,4,16,64 is the same list given apart: concurrencies, or rates when --request-rate is given
  without a value (`--request-rate --sweep 1,2,4`).

metrics (as in vLLM's benchmark_serving), per request: TTFT = first content chunk - send;
  E2E = end of the stream - send; TPOT = (E2E - TTFT) / (output tokens - 1); ITL = the gaps between
  content chunks. Output tokens come from the server's usage chunk (else the number of chunks).
  Goodput = completed requests per second that meet every --slo bound.

examples:
  tokenmill bench serve --base-url http://127.0.0.1:8000 --num-prompts 200 --concurrency 1,4,16,64 \\
      --input-len 256 --output-len 128 --ignore-eos --slo ttft=500ms,tpot=100ms --plot capacity.png
  tokenmill bench serve --endpoint chat --request-rate 2 --burstiness 0.5 --shared-prefix-len 512
  tokenmill bench serve --dataset prompts.jsonl --concurrency 8 --output-json result.json

Requests are sent once (no retries); a sweep sends --num-prompts per load point. Ctrl-C stops at once,
cancels what is in flight and reports what finished (exit code 130)."""


def register(sub) -> None:
    p = sub.add_parser("bench", help="Benchmarks: offline throughput, or load against a server.")
    bench_sub = p.add_subparsers(dest="bench_command", required=True)

    t = bench_sub.add_parser("throughput", help="Offline throughput of the engine (no server).")
    t.add_argument("--num-prompts", type=int, default=64)
    t.add_argument("--input-len", type=int, default=128)
    t.add_argument("--output-len", type=int, default=128)
    t.add_argument("--range-ratio", type=float, default=0.0, help="Lengths vary uniformly by +-this fraction.")
    t.add_argument("--dataset", default=None, help="JSONL of {\"prompt\", \"output_len\"} instead of synthetic.")
    t.add_argument("--workload-seed", type=int, default=0)
    t.add_argument("--temperature", type=float, default=1.0, help="Sampling temperature (0: greedy).")
    t.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True)
    t.add_argument("--output-json", default=None)
    add_engine_args(t)
    t.set_defaults(func=_throughput)

    s = bench_sub.add_parser(
        "serve", help="Load an OpenAI-compatible server; measure TTFT, TPOT, ITL, E2E, throughput, goodput.",
        description="Send streamed requests to any OpenAI-compatible server and measure what users feel: "
                    "time to first token (TTFT), time per output token (TPOT), inter-token latency (ITL), "
                    "end-to-end latency (E2E), throughput, and goodput under an SLO.",
        epilog=_SERVE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_serve_args(s)
    s.set_defaults(func=_serve)


def _add_serve_args(s: argparse.ArgumentParser) -> None:
    g = s.add_argument_group("target")
    g.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="Server root, e.g. http://127.0.0.1:8000 (a trailing /v1 is accepted). [default: %(default)s]")
    g.add_argument("--api-key", default=None, help="Bearer token. [default: $OPENAI_API_KEY if set]")
    g.add_argument("--model", default=None, help="Model name to send. [default: the first of GET /v1/models]")
    g.add_argument("--endpoint", choices=["completions", "chat"], default="completions",
                   help="/v1/completions or /v1/chat/completions. [default: %(default)s]")
    g.add_argument("--local-only", action="store_true", help="Refuse targets that are not loopback addresses.")
    g.add_argument("--timeout", type=float, default=600.0,
                   help="Seconds before a request counts as failed. [default: %(default)s]")

    g = s.add_argument_group("load shape (see below)")
    add_load_args(g)
    g.add_argument("--warmup", type=int, default=0, metavar="N",
                   help="Unrecorded requests sent one at a time before measuring (a server's first requests "
                        "may pay one-time costs, e.g. kernel compilation); on top of --num-prompts. [default: 0]")

    g = s.add_argument_group("workload")
    add_workload_args(g)
    g.add_argument("--tokenizer", default=None,
                   help="Count tokens with this local tokenizer (a model name, .gguf, or folder). [default: the "
                        "server's POST /tokenize; without it, tokenmill's default model's tokenizer]")
    g.add_argument("--ignore-eos", action="store_true",
                   help="Send ignore_eos: true (vLLM's extension) so every output is exactly max_tokens long.")

    g = s.add_argument_group("results")
    add_slo_arg(g)
    g.add_argument("--output-json", default=None, help="Write the results, with every request's record.")
    g.add_argument("--plot", default=None, metavar="PNG",
                   help="Draw p50/p99 TTFT and TPOT, throughput and goodput against load.")
    g.add_argument("--no-progress", action="store_true", help="No progress bar.")


def _throughput(args) -> int:
    from tokenmill.bench.throughput import main

    return main(args)


def _serve(args) -> int:
    from tokenmill.bench.serve import main

    return main(args)

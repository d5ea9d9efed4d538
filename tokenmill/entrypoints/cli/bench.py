"""`tokenmill bench throughput|serve`."""

from __future__ import annotations

from tokenmill.entrypoints.cli.args import add_engine_args


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
    t.add_argument("--warmup", action=__import__("argparse").BooleanOptionalAction, default=True)
    t.add_argument("--output-json", default=None)
    add_engine_args(t)
    t.set_defaults(func=_throughput)


def _throughput(args) -> int:
    from tokenmill.bench.throughput import main

    return main(args)

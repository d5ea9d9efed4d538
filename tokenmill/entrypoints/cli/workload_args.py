"""Flags that describe a load and a workload, shared by `bench serve` (real requests) and `estimate` /
`simulate` (predicted ones), so the same command line means the same traffic in all three."""

from __future__ import annotations

import argparse
import math


def positive_list(kind):
    """'1,4,16' -> [1, 4, 16]; 'inf' allowed for rates."""
    def parse(text: str) -> list:
        try:
            values = [kind(v) for v in text.split(",") if v.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number or a comma list of numbers, got {text!r}") from None
        if not values or any(v <= 0 or (isinstance(v, float) and math.isnan(v)) for v in values):
            raise argparse.ArgumentTypeError(f"values must be > 0, got {text!r}")
        return values
    return parse


def add_load_args(g, num_prompts_default: int | None = 100, open_loop: bool = True, seed_flag: str = "--seed",
                  num_prompts_help: str | None = None) -> None:
    """`seed_flag`: commands that also take the engine's flags (whose --seed seeds sampling) name it
    --workload-seed, as `bench throughput` does."""
    g.add_argument("--num-prompts", type=int, default=num_prompts_default,
                   help=num_prompts_help or "Requests per load point. [default: %(default)s]")
    mode = g.add_mutually_exclusive_group() if open_loop else g
    mode.add_argument("--concurrency", type=positive_list(int), nargs="?", const=[], default=None,
                      metavar="C[,C..]", help="Closed loop with C requests in flight" +
                      (" (the default mode, C=1)." if open_loop else "."))
    g.add_argument(seed_flag, type=int, default=0, dest="workload_seed",
                   help="Seed of prompts and arrival times; load point k uses seed+k. The same seed gives the same "
                        "prompts, which a prefix-caching server remembers between runs. [default: %(default)s]")
    if not open_loop:
        return
    mode.add_argument("--request-rate", type=positive_list(float), nargs="?", const=[], default=None,
                      metavar="R[,R..]", help="Open loop: R requests/s on average ('inf': all at once).")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="Gamma shape of inter-arrival times for --request-rate: 1 = Poisson, <1 burstier, "
                        ">1 more regular. [default: %(default)s]")
    g.add_argument("--sweep", type=positive_list(float), default=None, metavar="V,V,..",
                   help="Load points: concurrencies, or rates with a bare --request-rate.")


def add_workload_args(g, dataset_help: str | None = None) -> None:
    g.add_argument("--input-len", type=int, default=128,
                   help="Prompt tokens of synthetic prompts. [default: %(default)s]")
    g.add_argument("--output-len", type=int, default=128, help="max_tokens of each request. [default: %(default)s]")
    g.add_argument("--range-ratio", type=float, default=0.0,
                   help="Input and output lengths vary uniformly by +-this fraction. [default: %(default)s]")
    g.add_argument("--shared-prefix-len", type=int, default=0,
                   help="Every prompt starts with the same text of this many tokens (a shared system prompt: "
                        "exercises prefix caching), before each prompt's own --input-len tokens.")
    g.add_argument("--dataset", default=None, help=dataset_help or (
        "JSONL of {\"prompt\": str, \"output_len\": int (optional)} lines instead of synthetic prompts; the first "
        "--num-prompts lines are used (the same ones at each load point)."))
    g.add_argument("--temperature", type=float, default=0.0, help="Sampling temperature (0: greedy). [default: 0.0]")


def add_slo_arg(g, extra: str = "") -> None:
    g.add_argument("--slo", default=None, metavar="NAME=VALUE,..",
                   help="Bounds for goodput, NAME one of ttft, tpot, itl (every gap), e2e; VALUE in ms or s "
                        "(bare numbers are ms), e.g. ttft=500ms,tpot=100ms." + extra)


def check_workload_args(args) -> None:
    from tokenmill.errors import ConfigError

    checks = [("input_len", args.input_len >= 1), ("output_len", args.output_len >= 1),
              ("range_ratio", 0 <= args.range_ratio < 1), ("shared_prefix_len", args.shared_prefix_len >= 0),
              ("temperature", args.temperature >= 0)]
    if args.num_prompts is not None:
        checks.append(("num_prompts", args.num_prompts >= 1))
    if hasattr(args, "burstiness"):
        checks.append(("burstiness", args.burstiness > 0))
    for name, ok in checks:
        if not ok:
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(args, name)} is out of range")


def parse_slo_arg(text: str | None) -> dict[str, float]:
    from tokenmill.bench.serve_metrics import parse_slo
    from tokenmill.errors import ConfigError

    try:
        return parse_slo(text)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def workload_from_args(args, spec, duration: float | None = None):
    """The planner's Workload for these flags: synthetic, or the --dataset JSONL read with the model's
    tokenizer (text prompts) or its prompt_len fields."""
    from tokenmill.planning.sweep import Workload
    from tokenmill.planning.workload import jsonl_trace

    dataset = None
    if args.dataset:
        tokenizer = None
        with open(args.dataset) as f:  # only text prompts need the tokenizer (slow to load)
            needs_tokenizer = any('"prompt"' in line for line in f)
        if needs_tokenizer:
            from tokenmill.model.loader import load_tokenizer, resolve_model

            tokenizer = load_tokenizer(resolve_model(getattr(args, "model_pos", None) or args.model), args.tokenizer)
        dataset = jsonl_trace(args.dataset, tokenizer, args.output_len, args.num_prompts, spec.config.vocab_size)
    return Workload(args.input_len, args.output_len, args.range_ratio, args.shared_prefix_len, spec.config.vocab_size,
                    args.temperature, getattr(args, "burstiness", 1.0), args.workload_seed, args.num_prompts, duration,
                    dataset)

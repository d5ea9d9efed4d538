"""`tokenmill estimate [MODEL]`: capacity, latency and cost of serving a model on this machine, predicted
without running it."""

from __future__ import annotations

import argparse
import json
import sys

from tokenmill.entrypoints.cli.args import add_engine_args
from tokenmill.entrypoints.cli.planning_args import add_cost_model_args, cost_model_json, planning_inputs
from tokenmill.entrypoints.cli.workload_args import add_load_args, add_slo_arg, add_workload_args, workload_from_args

_EPILOG = """\
How: the model's dimensions give weight and KV bytes (no weights are loaded); the engine flags give
the KV budget and blocks, as the engine would size them. Each concurrency is a closed-loop simulation
of `bench serve --concurrency C` with the same workload: the real scheduler and KV cache manager run
in virtual time, each step timed by the step cost model of this machine (the profile written by
`tokenmill calibrate`, else a roofline from measured bandwidth and FLOP/s; a profile also charges
the CPU the server's front end and a bench client on this machine take per streamed token, as
calibrate measured them on a real server). Outputs are always --output-len long (as with bench
serve --ignore-eos). The SLO holds at a concurrency when 99% of the requests meet every bound; the
break point is found by doubling, then bisection.

examples:
  tokenmill estimate --input-len 512 --output-len 128 --slo ttft=1s,tpot=100ms --price-per-hour 0.40
  tokenmill estimate model.gguf --dtype float32 --memory-budget 8GiB --concurrency 1,8,32 --json"""


def register(sub) -> None:
    p = sub.add_parser("estimate", help="Predict capacity, latency and $/token of serving a model on this machine.",
                       description="Capacity planner: weight and KV memory, blocks and maximum concurrency, "
                                   "predicted TTFT/TPOT p50/p99 and throughput per concurrency, the concurrency "
                                   "where an SLO breaks, and the cost per million output tokens.",
                       epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("load and workload (as in bench serve)")
    add_load_args(g, num_prompts_default=None, open_loop=False, seed_flag="--workload-seed",
                  num_prompts_help="Requests per load point. [default: max(100, 4 x concurrency)]")
    add_workload_args(g)
    add_slo_arg(g, " The report gives the largest concurrency where 99%% of requests meet it.")
    g = p.add_argument_group("planning")
    g.add_argument("--memory-budget", default=None, metavar="SIZE",
                   help="Memory for weights + KV cache (e.g. 8GiB): the KV cache gets what the weights leave. "
                        "[default: the engine's --kv-cache-memory / --memory-utilization rule]")
    g.add_argument("--context", type=int, default=None,
                   help="Context length for the maximum-concurrency figure. [default: the workload's prompt + "
                        "output]")
    g.add_argument("--price-per-hour", type=float, default=None, metavar="USD",
                   help="Machine price per hour, for $ per million output tokens.")
    add_cost_model_args(g)
    add_engine_args(p, positional_model=True)
    p.set_defaults(func=run)


def run(args) -> int:
    from tokenmill.config import parse_size
    from tokenmill.errors import ConfigError
    from tokenmill.planning import estimate as est
    from tokenmill.planning.sweep import slo_break

    if args.price_per_hour is not None and args.price_per_hour < 0:
        raise ConfigError("--price-per-hour must be >= 0")
    if args.context is not None and args.context < 1:
        raise ConfigError("--context must be >= 1")
    config, slo, spec, cost = planning_inputs(args)
    budget = parse_size(args.memory_budget) if args.memory_budget else None
    context = args.context or (args.shared_prefix_len + args.input_len + args.output_len)
    plan = est.plan_memory(config, spec, context, budget)
    settings = est.sim_settings(config, plan)
    kv_max = plan.kv.max_concurrency(plan.context_len)
    levels = args.concurrency or sorted({c for c in (1, 2, 4, 8, 16, 32, 64, 128, 256)
                                        if c <= min(config.scheduler.max_num_seqs, kv_max)} | {1})
    workload = workload_from_args(args, spec)
    points = [est.point(cost, settings, workload, c, slo, args.price_per_hour) for c in levels]
    slo_result = None
    if slo:
        upper = min(4096, 2 * max(config.scheduler.max_num_seqs, kv_max))

        def holds(c: int) -> bool:
            return est.point(cost, settings, workload, c, slo, None)["meets_slo"]

        good, bad = slo_break(holds, upper)
        slo_result = {"slo_ms": {k: v * 1000 for k, v in slo.items()}, "attainment": est.SLO_ATTAINMENT,
                      "max_concurrency": good, "breaks_at": bad, "searched_up_to": upper}
        if good:
            best = est.point(cost, settings, workload, good, slo, args.price_per_hour)
            slo_result["at_max"] = best
    result = {
        "model": spec.fingerprint(),
        "memory": plan.to_dict(),
        "cost_model": cost_model_json(cost),
        "workload": {k: getattr(args, k) for k in ("input_len", "output_len", "range_ratio", "shared_prefix_len",
                                                   "dataset", "temperature", "num_prompts", "workload_seed")},
        "engine": {"max_num_batched_tokens": settings.max_num_batched_tokens, "max_num_seqs": settings.max_num_seqs,
                   "block_size": settings.block_size, "enable_prefix_caching": settings.enable_prefix_caching},
        "price_per_hour": args.price_per_hour,
        "points": points,
        "slo": slo_result,
    }
    if args.json:
        json.dump(result, sys.stdout, indent=1)
        print()
    else:
        _print(result)
    return 0


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def _print(r: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 150)
    m, mem = r["model"], r["memory"]
    console.print(f"[bold]{m['name']}[/] ({m['architecture']}, {m['dtype']}, quantization {m['quantization']}, "
                  f"KV cache {m['kv_cache_dtype']})")
    console.print(f"weights {_gib(mem['weight_bytes'])}; KV {mem['kv_bytes_per_token']:,} bytes/token; "
                  f"KV budget {_gib(mem['kv_budget_bytes'])} = {mem['num_blocks']:,} blocks of {mem['block_size']} "
                  f"tokens ({mem['kv_tokens']:,} tokens); max concurrency at {mem['context_len']:,} tokens of "
                  f"context: {mem['max_concurrency']:,} (at max_model_len {mem['max_model_len']:,}: "
                  f"{mem['kv_tokens'] // mem['max_model_len']:,})", highlight=False)
    console.print(f"step cost model: {r['cost_model']['description']}", markup=False, highlight=False)
    t = Table(title="predicted, closed loop (as bench serve --concurrency C)", title_justify="left")
    cols = ["concurrency", "out tok/s", "req/s", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99", "E2E p50"]
    if r["slo"]:
        cols.append("SLO met")
    if r["price_per_hour"] is not None:
        cols.append("$/1M out tok")
    for c in cols:
        t.add_column(c, justify="right")
    for p in r["points"]:
        row = [str(p["concurrency"]), f"{p['output_tok_per_s']:.1f}", f"{p['request_per_s']:.2f}",
               *(f"{p[k]:.1f}" for k in ("ttft_ms_p50", "ttft_ms_p99", "tpot_ms_p50", "tpot_ms_p99", "e2e_ms_p50"))]
        if r["slo"]:
            row.append(f"{100 * p['slo_attainment']:.0f}%")
        if r["price_per_hour"] is not None:
            usd = p.get("usd_per_1m_output_tokens")
            row.append("-" if usd is None else f"{usd:.3f}")
        t.add_row(*row)
    console.print(t)
    s = r["slo"]
    if s:
        bounds = ", ".join(f"{k}<={v:g}ms" for k, v in s["slo_ms"].items())
        if not s["max_concurrency"]:
            console.print(f"SLO {bounds}: not met even by a single user", markup=False)
        else:
            at = s["at_max"]
            cost = (f", ${at['usd_per_1m_output_tokens']:.3f} per 1M output tokens"
                    if at.get("usd_per_1m_output_tokens") is not None else "")
            where = (f"breaks at {s['breaks_at']}" if s["breaks_at"] else f"holds up to {s['searched_up_to']} "
                     "(searched no further)")
            console.print(f"SLO {bounds} (99% of requests): holds up to concurrency {s['max_concurrency']} "
                          f"({at['output_tok_per_s']:.1f} output tok/s{cost}); {where}", markup=False)

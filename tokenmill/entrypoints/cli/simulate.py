"""`tokenmill simulate [MODEL]`: the engine's real scheduler in virtual time, settings side by side."""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys

from tokenmill.entrypoints.cli.args import add_engine_args, engine_config_from_args
from tokenmill.entrypoints.cli.planning_args import add_cost_model_args, cost_model_json, planning_inputs
from tokenmill.entrypoints.cli.workload_args import (
    add_load_args,
    add_slo_arg,
    add_workload_args,
    positive_list,
    workload_from_args,
)

_COMPARED = ("max_num_batched_tokens", "max_num_seqs", "block_size", "enable_prefix_caching", "kv_cache_memory")

_EPILOG = """\
How: tokenmill's own Scheduler and KVCacheManager build every step (chunked prefill, prefix caching,
preemption, the token budget and sequence cap: exactly the engine's decisions); the step cost model
of this machine (`tokenmill calibrate`, else a roofline) says how long each step takes, and a virtual
clock jumps by that much. No model runs: 10 minutes of traffic take seconds. Outputs are always
--output-len long (as bench serve --ignore-eos). Metrics are computed as bench serve computes them.

Settings side by side: give a comma list to any of --max-num-batched-tokens, --max-num-seqs,
--block-size, --enable-prefix-caching (on,off) and --kv-cache-memory; every combination is simulated.

The goodput knee (with --slo): the highest request rate (open loop) or concurrency (closed loop) at
which --slo-attainment of the requests meet every bound, found by bisection.

examples:
  tokenmill simulate --request-rate 1,2,4,8 --duration 600 --slo ttft=1s,tpot=100ms
  tokenmill simulate --request-rate --sweep 2,4,6 --max-num-batched-tokens 512,2048 --slo ttft=1s,tpot=100ms
  tokenmill simulate --concurrency 16,64 --shared-prefix-len 512 --enable-prefix-caching on,off
  tokenmill simulate --dataset trace.jsonl      # lines with "timestamp" are replayed at their times"""


def _on_off(text: str) -> list[bool]:
    values = []
    for v in text.split(","):
        v = v.strip().lower()
        if v in ("on", "true", "1", "yes"):
            values.append(True)
        elif v in ("off", "false", "0", "no"):
            values.append(False)
        else:
            raise argparse.ArgumentTypeError(f"expected on,off values, got {text!r}")
    return values


def _sizes(text: str) -> list:
    from tokenmill.config import parse_size
    from tokenmill.errors import ConfigError

    try:
        return [parse_size(v) for v in text.split(",") if v.strip()]
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def register(sub) -> None:
    p = sub.add_parser("simulate", help="Simulate the engine's scheduler in virtual time: compare settings, find "
                                        "the goodput knee.",
                       description="Run tokenmill's real scheduler and KV cache manager in virtual time against "
                                   "the step cost model, for a workload trace, and compare engine settings.",
                       epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("load shape (as in bench serve)")
    add_load_args(g, num_prompts_default=None, seed_flag="--workload-seed",
                  num_prompts_help="Requests per load point. [default: 100, or as many as --duration takes]")
    g.add_argument("--duration", type=float, default=None, metavar="SECONDS",
                   help="Simulated seconds of traffic per load point (open loop: arrivals during it; closed loop: "
                        "no new request after it), instead of --num-prompts.")
    g = p.add_argument_group("workload (as in bench serve)")
    add_workload_args(g, dataset_help="JSONL of {\"prompt\": str or \"prompt_len\": int, \"output_len\": int, "
                                      "\"timestamp\": seconds (optional), \"priority\": int (optional)}; with "
                                      "timestamps and no --request-rate/--concurrency, replayed at those times.")
    g = p.add_argument_group("settings compared (comma lists; every combination)")
    g.add_argument("--max-num-batched-tokens", type=positive_list(int), default=None, metavar="N[,N..]")
    g.add_argument("--max-num-seqs", type=positive_list(int), default=None, metavar="N[,N..]")
    g.add_argument("--block-size", type=positive_list(int), default=None, metavar="N[,N..]")
    g.add_argument("--enable-prefix-caching", type=_on_off, default=None, metavar="on|off[,..]")
    g.add_argument("--kv-cache-memory", type=_sizes, default=None, metavar="SIZE[,SIZE..]")
    g = p.add_argument_group("results")
    add_slo_arg(g)
    g.add_argument("--slo-attainment", type=float, default=0.9, metavar="FRACTION",
                   help="Share of requests that must meet the SLO at the knee. [default: %(default)s]")
    g.add_argument("--admission", action="store_true",
                   help="Simulate `serve --slo` admission: arrivals predicted to miss the SLO are rejected (429).")
    g.add_argument("--no-knee", action="store_true", help="Skip the knee search (it runs ~12 more simulations).")
    add_cost_model_args(g)
    add_engine_args(p, positional_model=True, skip=_COMPARED)
    p.set_defaults(func=run)


def settings_grid(args) -> list[dict]:
    from tokenmill.config import EngineConfig

    defaults = EngineConfig()
    lists = {}
    for name in _COMPARED:
        given = getattr(args, name)
        owner = getattr(defaults, EngineConfig.field_owner()[name])
        lists[name] = given if given is not None else [getattr(owner, name)]
    return [dict(zip(lists, combo)) for combo in itertools.product(*lists.values())]


def run(args) -> int:
    from tokenmill.bench.serve import load_points
    from tokenmill.errors import ConfigError
    from tokenmill.planning.admission import SLOAdmission
    from tokenmill.planning.estimate import plan_memory, sim_settings
    from tokenmill.planning.sweep import goodput_knee, run_point

    if args.duration is not None and args.duration <= 0:
        raise ConfigError("--duration must be > 0")
    if not 0 < args.slo_attainment <= 1:
        raise ConfigError("--slo-attainment must be in (0, 1]")
    grid = settings_grid(args)
    _, slo, spec, cost = planning_inputs(args, **grid[0])
    if args.admission and not ({"ttft", "tpot"} & set(slo)):
        raise ConfigError("--admission needs --slo with a ttft and/or tpot bound")
    workload = workload_from_args(args, spec, args.duration)
    replay = workload.replayable() and args.concurrency is None and args.request_rate is None
    points = [("replay", 0.0)] if replay else [(p.mode, p.value) for p in load_points(args)]
    results = []
    for values in grid:
        config = engine_config_from_args(args, **values)
        settings = sim_settings(config, plan_memory(config, spec))
        admission = functools.partial(SLOAdmission, cost.model, slo, settings.max_num_batched_tokens,
                                      settings.max_num_seqs) if args.admission else None
        runs = [run_point(cost.model, settings, workload, mode, v, args.workload_seed + k, slo, admission)
                for k, (mode, v) in enumerate(points)]
        knee = None
        if slo and not args.no_knee and not replay:
            knee = goodput_knee(cost.model, settings, workload, points[0][0], slo, args.slo_attainment,
                                args.workload_seed, admission=admission)
        label = " ".join(f"{k}={_show(v)}" for k, v in values.items() if len({str(g[k]) for g in grid}) > 1)
        results.append({"setting": values, "label": label or "engine flags", "sim_settings": settings.to_dict(),
                        "runs": runs, "knee": knee})
    out = {"model": spec.fingerprint(),
           "cost_model": cost_model_json(cost),
           "slo_ms": {k: v * 1000 for k, v in slo.items()} or None, "slo_attainment": args.slo_attainment,
           "results": results}
    if args.json:
        json.dump(out, sys.stdout, indent=1)
        print()
    else:
        _print(out)
    return 0


def _show(v) -> str:
    if isinstance(v, bool):
        return "on" if v else "off"
    if isinstance(v, int) and v >= 2**20:
        return f"{v / 2**30:g}GiB"
    return str(v)


def _load_label(load: dict) -> str:
    mode, v = load["mode"], load["value"]
    return {"concurrency": f"concurrency {v}", "request_rate": f"rate {v}/s", "replay": "replay"}[mode]


def _print(out: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(width=None if sys.stdout.isatty() else 170)
    console.print(f"step cost model: {out['cost_model']['description']}", markup=False, highlight=False)
    t = Table(title="simulated", title_justify="left")
    cols = ["setting", "load", "done", "rejected", "req/s", "out tok/s", "goodput", "TTFT p50", "TTFT p99", "TPOT p50",
            "TPOT p99", "E2E p99", "preempt", "util"]
    for c in cols:
        t.add_column(c, justify="left" if c in ("setting", "load") else "right")
    for r in out["results"]:
        for run in r["runs"]:
            g = run["goodput"]
            t.add_row(r["label"], _load_label(run["load"]), str(run["completed"]), str(run["failed"]),
                      f"{run['request_throughput']:.2f}",
                      f"{run['output_token_throughput']:.1f}", "-" if g is None else f"{g:.2f}",
                      *(f"{run[m][q]:.1f}" if run[m][q] is not None else "-"
                        for m, q in (("ttft_ms", "median"), ("ttft_ms", "p99"), ("tpot_ms", "median"),
                                     ("tpot_ms", "p99"), ("e2e_ms", "p99"))),
                      str(run["num_preemptions"]), f"{100 * run['utilization']:.0f}%")
    console.print(t)
    for r in out["results"]:
        k = r["knee"]
        if k is None:
            continue
        unit = "req/s" if k["mode"] == "request_rate" else ""
        load = f"{k['load']:.2f} {unit}" if k["mode"] == "request_rate" else f"concurrency {k['load']}"
        console.print(f"goodput knee [{r['label']}]: {load} ({k['goodput']:.2f} req/s of goodput, "
                      f"{k['output_tok_per_s']:.1f} output tok/s, {100 * out['slo_attainment']:.0f}% meeting the SLO)",
                      markup=False, highlight=False)

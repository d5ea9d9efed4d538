"""`tokenmill calibrate [MODEL]`: measure this machine's step costs for a model and save a profile."""

from __future__ import annotations

import argparse
import json
import sys

from tokenmill.entrypoints.cli.args import add_engine_args, engine_config_from_args

_EPILOG = """\
What it does (under two minutes on the embedded model): loads the model with the given engine flags,
runs ~50 engine steps of designed shapes through the engine core's executor on every rank (decodes
at batch sizes 1..max-num-seqs and contexts up to 2048, prefill chunks up to max-num-batched-tokens
with and without cached context, several sequences at once, mixes, greedy and temperature sampling),
fits the step cost model on three quarters of them and reports its error on the rest, then runs a
short real workload through the whole engine to measure the time a step spends outside the model.
Last, it serves the model on loopback and streams a short `bench serve` run through it: the CPU the
HTTP front end and the client take per output token slows the model when its threads hold every
core, and the profile charges it per token (skip with --no-serving-run).

The profile is tied to this machine (CPU, ISA level, cores, memory, threads) and this model (its
dimensions, dtype, quantization): `tokenmill estimate`, `simulate` and `serve --slo` find it by
those, and refuse a profile from elsewhere. Calibrate alone on the machine (other processes on the
same cores slow the steps it measures), with the threads you will serve with.

examples:
  tokenmill calibrate                                   # the embedded model, default dtype
  tokenmill calibrate model.gguf --dtype float32 --output smol-fp32.json
  tokenmill calibrate --tensor-parallel-size 2          # steps timed across both ranks"""


def register(sub) -> None:
    p = sub.add_parser("calibrate", help="Measure this machine's engine step costs for a model (a profile for "
                                         "estimate, simulate and serve --slo).",
                       description="Fit tokenmill's step cost model to real steps on this machine and save it "
                                   "as a JSON profile.",
                       epilog=_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("calibration")
    g.add_argument("--output", default=None, metavar="PATH",
                   help="Where to write the profile. [default: ~/.cache/tokenmill/profiles/, found there by "
                        "estimate, simulate and serve]")
    g.add_argument("--max-seconds", type=float, default=80.0,
                   help="Time budget for the designed steps (shapes left over are skipped). [default: %(default)s]")
    g.add_argument("--reps", type=int, default=3, help="Timed runs per shape (the median counts). [default: 3]")
    g.add_argument("--no-serving-run", action="store_true",
                   help="Skip the streaming run through a real server: the profile then leaves out the CPU the "
                        "HTTP front end and a local client take per token (right when clients are elsewhere and "
                        "the front end has a core of its own).")
    g.add_argument("--json", action="store_true", help="Print the profile as JSON instead of a summary.")
    add_engine_args(p, positional_model=True)
    p.set_defaults(func=run)


def run(args) -> int:
    from pathlib import Path

    from rich.console import Console
    from rich.table import Table

    from tokenmill.errors import ConfigError
    from tokenmill.planning.calibrate import calibrate
    from tokenmill.planning.profile import default_profile_path

    if args.max_seconds <= 0 or args.reps < 1:
        raise ConfigError("--max-seconds must be > 0 and --reps >= 1")
    config = engine_config_from_args(args)
    console = Console(stderr=args.json, width=None if sys.stdout.isatty() else 120)
    with console.status("calibrating...") as status:
        profile = calibrate(config, args.max_seconds, args.reps, progress=lambda what: status.update(
            f"calibrating: {what}"), serving_run=not args.no_serving_run)
    path = Path(args.output) if args.output else default_profile_path(profile.machine, profile.model)
    profile.save(path)
    if args.json:
        json.dump(profile.to_dict(), sys.stdout, indent=1)
        print()
        return 0
    c = profile.calibration
    m = profile.machine
    console.print(f"machine: {m['cpu']} ({m['isa']}, {m['cores']} cores, {m['num_threads']} threads, "
                  f"{m['memory_gib']} GiB)", markup=False)
    console.print(f"model: {profile.model['name']} ({profile.model['dtype']}, quantization "
                  f"{profile.model['quantization']})", markup=False)
    t = Table(title="step cost model: predicted vs measured (runner)")
    for col in ("decodes", "their context", "prefill tokens", "cached before", "sampled", "measured ms",
                "predicted ms", "error", "held out"):
        t.add_column(col, justify="right")
    for p in c["points"]:
        s = p["shape"]
        err = 100 * (p["predicted_ms"] - p["measured_ms"]) / p["measured_ms"]
        t.add_row(str(s["num_decodes"]), str(s["decode_context"]), str(s["prefill_tokens"]),
                  str(s["prefill_context"]), str(s["num_sampled"]) + (" greedy" if s["greedy"] else ""),
                  f"{p['measured_ms']:.1f}", f"{p['predicted_ms']:.1f}", f"{err:+.1f}%", "yes" if p["held_out"] else "")
    console.print(t)
    h, e = c["held_out_error_pct"], c["engine_step_error_pct"]
    console.print(f"held-out shapes: {h['count']}, error median {h['median']:.1f}%, max {h['max']:.1f}% "
                  f"(model fitted on the other {c['shapes'] - c['held_out']})")
    console.print(f"real engine steps: {e['count']}, error median {e['median']:.1f}%, max {e['max']:.1f}%; "
                  f"engine overhead {1000 * profile.cost_model.step_overhead:.2f} ms/step + "
                  f"{1000 * profile.cost_model.seq_overhead:.3f} ms/sequence")
    if c.get("streaming"):
        st = c["streaming"]
        console.print(f"streaming through a real server: front end {1000 * st['front_end_s_per_token']:.3f} ms + "
                      f"client {1000 * st['client_s_per_token']:.3f} ms of CPU per output token; charged per "
                      f"sampled row: {1000 * profile.cost_model.stream_overhead:.3f} ms")
    console.print(f"calibrated in {c['duration_s']:.0f}s; profile: {path}", markup=False)
    return 0

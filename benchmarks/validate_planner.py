"""The planner against reality, in one run on this machine (run it under `cpu-lock bench`):

    python benchmarks/validate_planner.py estimate --concurrency 1,4,16,64   # estimate vs bench serve, closed loop
    python benchmarks/validate_planner.py knee --rates 0.5,1,1.5,2,2.5,3      # simulate's knee vs an open-loop sweep
    python benchmarks/validate_planner.py admission --rate-factors 1,2,4      # serve --slo on vs off

Each first calibrates (unless --profile is given), then starts `tokenmill serve` with the same engine
flags and measures with `tokenmill bench serve`; the predictions come from `tokenmill estimate` /
`simulate` with the same workload flags. Prints markdown tables (date, CPU, load) and writes the raw
results as JSON.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serving_vs_hf import free_port, start  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "tokenmill.entrypoints.cli.main"]


def sh(*args, capture=True) -> str:
    r = subprocess.run([*CLI, *args], cwd=ROOT, capture_output=capture, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{' '.join(args[:2])} failed: {r.stderr[-3000:]}")
    return r.stdout


def machine() -> str:
    from tokenmill.utils.cpu import describe

    return f"{dt.date.today()}, {describe()}, load {os.getloadavg()[0]:.2f}"


def workload_flags(a) -> list[str]:
    return ["--input-len", str(a.input_len), "--output-len", str(a.output_len), "--temperature", "1.0"]


def bench(port: int, a, out: Path, *load: str) -> dict:
    load_before = os.getloadavg()[0]
    sh("bench", "serve", "--base-url", f"http://127.0.0.1:{port}", *load, *workload_flags(a), "--ignore-eos",
       "--slo", a.slo, "--no-progress", "--output-json", str(out), "--warmup", "2")
    runs = json.loads(out.read_text())["runs"]
    for r in runs:
        r["loadavg_before"] = load_before
        r.pop("requests", None)
    return runs


def calibrate(a, tmp: Path) -> str:
    if a.profile:
        return a.profile
    path = tmp / "profile.json"
    sh("calibrate", *a.engine, "--output", str(path))
    return str(path)


def serve(a, tmp: Path, *extra: str):
    port = free_port()
    return port, start([*CLI, "serve", "--port", str(port), *a.engine, *extra], port, tmp / "serve.log")


def pct(pred: float, meas: float) -> str:
    return f"{100 * (pred - meas) / meas:+.1f}%"


def run_estimate(a, tmp: Path) -> dict:
    profile = calibrate(a, tmp)
    levels = [int(c) for c in a.concurrency.split(",")]
    port, proc = serve(a, tmp)
    measured = {}
    try:
        for c in levels:
            n = max(16, a.prompts_per_slot * c)
            measured[c] = bench(port, a, tmp / f"b{c}.json", "--concurrency", str(c), "--num-prompts", str(n),
                                "--seed", str(c))[0]
    finally:
        proc.terminate()
        proc.wait(60)
    predicted = {}
    for c in levels:
        n = max(16, a.prompts_per_slot * c)
        out = json.loads(sh("estimate", *a.engine, "--profile", profile, "--concurrency", str(c), "--num-prompts",
                            str(n), *workload_flags(a), "--json"))
        predicted[c] = out["points"][0]
    print(f"\nestimate vs bench serve ({machine()}); {a.input_len} in / {a.output_len} out, temperature 1")
    print("| concurrency | out tok/s pred | meas | err | TPOT p50 pred | meas | err | TTFT p50 pred | meas | err "
          "| TPOT p99 pred | meas | TTFT p99 pred | meas | load before |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for c in levels:
        p, m = predicted[c], measured[c]
        print(f"| {c} | {p['output_tok_per_s']:.1f} | {m['output_token_throughput']:.1f} | "
              f"{pct(p['output_tok_per_s'], m['output_token_throughput'])} | {p['tpot_ms_p50']:.1f} | "
              f"{m['tpot_ms']['median']:.1f} | {pct(p['tpot_ms_p50'], m['tpot_ms']['median'])} | "
              f"{p['ttft_ms_p50']:.0f} | {m['ttft_ms']['median']:.0f} | "
              f"{pct(p['ttft_ms_p50'], m['ttft_ms']['median'])} | {p['tpot_ms_p99']:.1f} | {m['tpot_ms']['p99']:.1f} | "
              f"{p['ttft_ms_p99']:.0f} | {m['ttft_ms']['p99']:.0f} | {m['loadavg_before']:.2f} |")
    return {"predicted": predicted, "measured": measured, "profile": profile}


def knee_of(rates: list[float], attainments: list[float], target: float) -> float:
    """The highest rate with attainment >= target, interpolated linearly to the first rate below it."""
    best = 0.0
    for i, (r, att) in enumerate(zip(rates, attainments)):
        if att >= target:
            best = r
            continue
        if i and attainments[i - 1] >= target:
            r0, a0 = rates[i - 1], attainments[i - 1]
            best = r0 + (r - r0) * (a0 - target) / (a0 - att)
        break
    return best


def simulated_knee(a, profile: str) -> float:
    sim = json.loads(sh("simulate", *a.engine, "--profile", profile, "--request-rate", "1",
                        "--num-prompts", str(a.num_prompts), "--workload-seed", "1", *workload_flags(a),
                        "--slo", a.slo, "--slo-attainment", str(a.attainment), "--json"))["results"][0]
    return sim["knee"]["load"]


def run_knee(a, tmp: Path) -> dict:
    profile = calibrate(a, tmp)
    if a.rates == "auto":  # around the simulated knee
        k = simulated_knee(a, profile)
        a.rates = ",".join(f"{f * k:.3g}" for f in (0.5, 0.75, 1.0, 1.25, 1.5, 2.0))
    rates = [float(r) for r in a.rates.split(",")]
    port, proc = serve(a, tmp)
    try:
        measured = bench(port, a, tmp / "sweep.json", "--request-rate", a.rates, "--num-prompts", str(a.num_prompts),
                         "--seed", "1")
    finally:
        proc.terminate()
        proc.wait(60)
    sim = json.loads(sh("simulate", *a.engine, "--profile", profile, "--request-rate", a.rates, "--num-prompts",
                        str(a.num_prompts), "--workload-seed", "1", *workload_flags(a), "--slo", a.slo,
                        "--slo-attainment", str(a.attainment), "--json"))["results"][0]
    att_m = [r["goodput"] / r["request_throughput"] if r["request_throughput"] else 0.0 for r in measured]
    att_s = [r["slo_attainment"] or 0.0 for r in sim["runs"]]
    knee_m, knee_s = knee_of(rates, att_m, a.attainment), knee_of(rates, att_s, a.attainment)
    print(f"\nsimulate vs bench serve, open loop ({machine()}); {a.input_len} in / {a.output_len} out, "
          f"{a.num_prompts} requests per rate, SLO {a.slo}")
    print("| rate req/s | goodput sim | meas | SLO met sim | meas | TTFT p50 sim | meas | TPOT p50 sim | meas | "
          "out tok/s sim | meas |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r, s, m, asim, ameas in zip(rates, sim["runs"], measured, att_s, att_m):
        print(f"| {r:g} | {s['goodput']:.2f} | {m['goodput']:.2f} | {100 * asim:.0f}% | {100 * ameas:.0f}% | "
              f"{s['ttft_ms']['median']:.0f} | {m['ttft_ms']['median']:.0f} | {s['tpot_ms']['median']:.1f} | "
              f"{m['tpot_ms']['median']:.1f} | {s['output_token_throughput']:.1f} | "
              f"{m['output_token_throughput']:.1f} |")
    print(f"knee ({100 * a.attainment:.0f}% of requests meet the SLO): simulated {knee_s:.2f} req/s "
          f"(bisection: {sim['knee']['load']:.2f}), measured {knee_m:.2f} req/s ({pct(knee_s, knee_m)})")
    return {"rates": rates, "measured": measured, "simulated": sim, "knee_measured": knee_m,
            "knee_simulated": knee_s}


def run_admission(a, tmp: Path) -> dict:
    """Open-loop load at 1x, 2x, 4x the sustainable rate (the simulated goodput knee, or --base-rate),
    against `serve` without admission and with `--slo`, the same arrivals for both."""
    profile = calibrate(a, tmp)
    base = a.base_rate if a.base_rate is not None else simulated_knee(a, profile)
    rates = [round(f * base, 3) for f in (float(x) for x in a.rate_factors.split(","))]
    admission_slo = ",".join(b for b in a.slo.split(",") if b.split("=")[0] in ("ttft", "tpot"))
    runs = {}
    for mode, extra in (("off", []), ("on", ["--slo", admission_slo, "--profile", profile])):
        port, proc = serve(a, tmp, *extra)
        try:
            runs[mode] = bench(port, a, tmp / f"adm-{mode}.json", "--request-rate", ",".join(map(str, rates)),
                               "--num-prompts", str(a.num_prompts), "--seed", "1")
        finally:
            proc.terminate()
            proc.wait(60)
    print(f"\nSLO admission on vs off, open loop ({machine()}); {a.input_len} in / {a.output_len} out, "
          f"{a.num_prompts} requests per rate, SLO {a.slo}, sustainable rate {base:.2f} req/s")
    print("| rate | admission | admitted | rejected | goodput req/s | SLO met (of all sent) | TTFT p99 admitted | "
          "TPOT p99 admitted | out tok/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for i, r in enumerate(rates):
        for mode in ("off", "on"):
            m = runs[mode][i]
            sent = m["completed"] + m["failed"]
            met = m["goodput"] * m["duration_s"] / sent if sent else 0.0
            print(f"| {r:g} ({r / base:.0f}x) | {mode} | {m['completed']} | {m['failed']} | {m['goodput']:.3f} | "
                  f"{100 * met:.0f}% | {m['ttft_ms']['p99']:.0f} ms | {m['tpot_ms']['p99']:.1f} ms | "
                  f"{m['output_token_throughput']:.1f} |")
    return {"base_rate": base, "rates": rates, "runs": runs, "profile": profile}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", choices=["estimate", "knee", "admission"])
    ap.add_argument("--concurrency", default="1,4,16,64")
    ap.add_argument("--prompts-per-slot", type=int, default=2, help="bench/estimate run max(16, this x C) requests")
    ap.add_argument("--rates", default="auto", help="knee: request rates, or auto (0.5x..2x the simulated knee)")
    ap.add_argument("--num-prompts", type=int, default=60)
    ap.add_argument("--rate-factors", default="1,2,4", help="admission: multiples of the sustainable rate")
    ap.add_argument("--base-rate", type=float, default=None,
                    help="admission: the sustainable rate (default: the simulated goodput knee)")
    ap.add_argument("--attainment", type=float, default=0.9)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--slo", default="ttft=1000ms,tpot=100ms")
    ap.add_argument("--profile", default=None, help="Use this profile instead of calibrating first.")
    ap.add_argument("--engine", nargs=argparse.REMAINDER, default=[], help="Engine flags (last).")
    ap.add_argument("--output-json", default=None)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix=f"validate-{a.what}-"))
    result = {"estimate": run_estimate, "knee": run_knee, "admission": run_admission}[a.what](a, tmp)
    out = Path(a.output_json or f"bench-results/validate_{a.what}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(a), "machine": machine(), **result}, indent=1))


if __name__ == "__main__":
    main()

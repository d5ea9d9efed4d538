"""Where `tokenmill serve` spends its start-up: time from exec to the first 200 on /health, split
at the server's own log lines.

    python benchmarks/startup.py --runs 5            # warm: the kernel and GGUF caches are filled
    python benchmarks/startup.py --cold --runs 1     # cold: an empty cache (kernel build, GGUF index)

Phases: imports (exec -> uvicorn's "Started server process"), weights (-> "loaded ... in"),
engine (-> "engine ready"), serving (-> "serving ... on"), first 200 (-> /health answers 200);
then the stop: SIGTERM to the process's exit.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

from tokenmill.utils.net import free_port, wait_healthy

MARKERS = [("imports", "Started server process"), ("weights", "tokenmill.worker.worker: loaded"),
           ("engine", "engine ready"), ("serving", "tokenmill.server: serving")]


def _stamp(line: str) -> float | None:
    try:
        return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
    except ValueError:
        return None


def one_start(extra: list[str], env: dict) -> dict[str, float]:
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="tokenmill-startup-", suffix=".log", delete=False)
    cmd = [sys.executable, "-m", "tokenmill.entrypoints.cli.main", "serve", "--port", str(port), *extra]
    t0 = time.time()
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        wait_healthy(f"http://127.0.0.1:{port}", lambda: None if proc.poll() is None else Path(log.name).read_text(),
                     timeout=900, poll=0.02)
        first_200 = time.time()
    finally:
        stop = time.time()
        proc.terminate()
        proc.wait(30)
        stop = time.time() - stop
    phases, last = {}, t0
    lines = Path(log.name).read_text().splitlines()
    for name, marker in MARKERS:
        stamp = next((_stamp(line) for line in lines if marker in line), None)
        if stamp is not None:
            phases[name] = stamp - last
            last = stamp
    phases["first 200"] = first_200 - last
    phases["total"] = first_200 - t0
    phases["SIGTERM to exit"] = stop
    os.unlink(log.name)
    return phases


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--cold", action="store_true", help="each run starts from an empty cache directory")
    ap.add_argument("args", nargs="*", help="extra `tokenmill serve` arguments")
    args = ap.parse_args()
    results = []
    for _ in range(args.runs):
        env = dict(os.environ)
        if args.cold:
            env["TOKENMILL_CACHE_DIR"] = tempfile.mkdtemp(prefix="tokenmill-cold-")
        results.append(one_start(args.args, env))
        print("  ".join(f"{k} {v:.2f}s" for k, v in results[-1].items()), flush=True)
    print("median: " + "  ".join(f"{k} {statistics.median(r[k] for r in results):.2f}s" for k in results[0]))
    return 0


if __name__ == "__main__":
    sys.exit(main())

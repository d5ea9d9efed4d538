"""What `tokenmill bench serve` records per request, and what the records add up to.

Definitions follow vLLM's benchmark_serving: TTFT = first content chunk - send; E2E = end of the
stream - send; TPOT = (E2E - TTFT) / (output tokens - 1) for requests with more than one output token;
ITL = the gaps between consecutive content chunks (a chunk may carry several tokens). Goodput = the
completed requests per second that meet every bound of the SLO.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

from tokenmill.core.messages import SpecDecodingStats

SLO_METRICS = ("ttft", "tpot", "itl", "e2e")
PERCENTILES = (("median", 50), ("p90", 90), ("p99", 99))


@dataclass
class RequestRecord:
    index: int
    expected_prompt_len: int  # content tokens the workload built (the server may add a template)
    max_tokens: int
    sent_at: float | None = None  # seconds since the load point started; None: never sent
    first_token_at: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # arrival of each content chunk, first included
    end_at: float | None = None
    prompt_tokens: int | None = None  # from the server's usage chunk
    output_tokens: int | None = None  # from usage, else the number of content chunks
    usage_reported: bool = False
    status: int | None = None
    error: str | None = None
    cancelled: bool = False
    retries: int = 0  # sends again on a fresh connection after the server closed a reused one unread
    # speculative decoding, where the server reports it (tokenmill's usage.spec_decode): verifications
    # with drafts, draft tokens, accepted draft tokens
    spec: tuple[int, int, int] | None = None
    overhead_s: float = 0.0  # wall time in the client's own request building, SSE parsing, bookkeeping
    cpu_s: float = 0.0  # CPU time of the same code (unlike wall time, not inflated when the OS preempts us)

    @property
    def ok(self) -> bool:
        return (self.error is None and not self.cancelled and self.first_token_at is not None
                and self.end_at is not None)

    @property
    def ttft(self) -> float:
        return self.first_token_at - self.sent_at

    @property
    def e2e(self) -> float:
        return self.end_at - self.sent_at

    @property
    def tpot(self) -> float | None:
        n = self.output_tokens or 0
        return (self.e2e - self.ttft) / (n - 1) if n > 1 else None

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]

    def to_dict(self) -> dict:
        ok = self.ok
        ms = (lambda v: None if v is None else round(v * 1000, 3))  # noqa: E731
        return {
            "index": self.index, "ok": ok, "status": self.status, "error": self.error, "cancelled": self.cancelled,
            "sent_at_s": self.sent_at, "first_token_at_s": self.first_token_at, "end_at_s": self.end_at,
            "prompt_tokens": self.prompt_tokens, "output_tokens": self.output_tokens,
            "expected_prompt_len": self.expected_prompt_len, "max_tokens": self.max_tokens,
            "usage_reported": self.usage_reported, "num_chunks": len(self.chunk_times),
            "ttft_ms": ms(self.ttft) if ok else None, "tpot_ms": ms(self.tpot) if ok else None,
            "e2e_ms": ms(self.e2e) if ok else None, "itl_ms": [ms(v) for v in self.itls] if ok else [],
            "retries": self.retries, "client_overhead_ms": round(self.overhead_s * 1000, 4),
            "client_cpu_ms": round(self.cpu_s * 1000, 4), **spec_fields([self]),
        }


def parse_slo(text: str | None, allowed: tuple[str, ...] = SLO_METRICS, example: str = "ttft=500ms,tpot=100ms"
              ) -> dict[str, float]:
    """'ttft=500ms,tpot=100ms,e2e=2s' -> {"ttft": 0.5, "tpot": 0.1, "e2e": 2.0} (seconds); a bare
    number is milliseconds. `allowed`: the bounds the calling command can check (its message lists
    those). Raises ValueError with a readable message."""
    slo: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in (text or "").split(","))):
        name, _, value = part.partition("=")
        name = name.strip().lower()
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(ms|s)?\s*", value)
        if name not in allowed or not match:
            names = " and/or ".join(allowed) if len(allowed) <= 2 else f"one of {', '.join(allowed)}"
            raise ValueError(f"bad SLO bound {part!r}: expected NAME=VALUE[ms|s] with NAME {names} "
                             f"(e.g. {example})")
        slo[name] = float(match.group(1)) / (1 if match.group(2) == "s" else 1000)
    return slo


def meets_slo(rec: RequestRecord, slo: dict[str, float]) -> bool:
    """Every bound holds. TPOT and ITL bounds hold trivially for a single-token output; the ITL bound
    must hold for every gap of the request."""
    if not rec.ok:
        return False
    if "ttft" in slo and rec.ttft > slo["ttft"]:
        return False
    if "e2e" in slo and rec.e2e > slo["e2e"]:
        return False
    if "tpot" in slo and (rec.tpot or 0.0) > slo["tpot"]:
        return False
    return not ("itl" in slo and any(gap > slo["itl"] for gap in rec.itls))


def stats_ms(values_s: list[float]) -> dict[str, float | None]:
    if not values_s:
        return {"mean": None, "median": None, "p90": None, "p99": None, "count": 0}
    a = np.asarray(values_s, dtype=np.float64) * 1000
    out = {"mean": float(a.mean())}
    out.update({name: float(np.percentile(a, q)) for name, q in PERCENTILES})
    out["count"] = len(a)
    return out


def spec_fields(records: list[RequestRecord]) -> dict:
    """Acceptance rate (accepted / draft tokens) and mean acceptance length (1 + accepted / verifications,
    vLLM's definitions) over the records whose server reported speculation; {} when none did."""

    reported = [r.spec for r in records if r.spec is not None]
    if not reported:
        return {}
    return SpecDecodingStats(*(sum(c) for c in zip(*reported))).summary()


def summarize(records: list[RequestRecord], duration_s: float, slo: dict[str, float] | None = None) -> dict:
    """One load point's numbers (latencies in ms, throughputs per second of `duration_s`)."""
    done = [r for r in records if r.ok]
    failed = [r for r in records if r.sent_at is not None and not r.ok and not r.cancelled]
    duration = max(duration_s, 1e-9)
    n_in = sum(r.prompt_tokens or 0 for r in done)
    n_out = sum(r.output_tokens or 0 for r in done)
    errors: dict[str, int] = {}
    for r in failed:
        key = f"{r.status or 'no response'}: {r.error}"
        errors[key] = errors.get(key, 0) + 1
    sent = [r for r in records if r.sent_at is not None]
    chunks = sum(len(r.chunk_times) for r in sent)
    overhead, cpu = sum(r.overhead_s for r in sent), sum(r.cpu_s for r in sent)
    return {
        "completed": len(done), "failed": len(failed),
        "cancelled": sum(r.cancelled for r in records), "not_sent": sum(r.sent_at is None for r in records),
        "duration_s": duration_s,
        "request_throughput": len(done) / duration,
        "input_token_throughput": n_in / duration, "output_token_throughput": n_out / duration,
        "total_token_throughput": (n_in + n_out) / duration,
        "total_input_tokens": n_in, "total_output_tokens": n_out,
        "ttft_ms": stats_ms([r.ttft for r in done]),
        "tpot_ms": stats_ms([r.tpot for r in done if r.tpot is not None]),
        "itl_ms": stats_ms([gap for r in done for gap in r.itls]),
        "e2e_ms": stats_ms([r.e2e for r in done]),
        "slo_ms": {k: v * 1000 for k, v in slo.items()} if slo else None,
        "goodput": sum(meets_slo(r, slo) for r in done) / duration if slo else None,
        "client_overhead_ms_per_request": overhead * 1000 / len(sent) if sent else None,
        "client_overhead_us_per_chunk": overhead * 1e6 / chunks if chunks else None,
        "client_cpu_ms_per_request": cpu * 1000 / len(sent) if sent else None,
        "connection_retries": sum(r.retries for r in sent),
        "errors": errors,
        **spec_fields(done),
    }



_LATENCIES = (("ttft_ms", "TTFT (ms)"), ("tpot_ms", "TPOT (ms)"), ("itl_ms", "ITL (ms)"), ("e2e_ms", "E2E (ms)"))


def _num(v, digits: int = 1) -> str:
    return "-" if v is None else f"{v:,.{digits}f}"


def print_run(console, run: dict) -> None:
    """One load point: latency percentiles, then counts, throughput, goodput and client overhead."""
    from rich.table import Table

    lat = Table(title=f"{run['load']['label']}: latencies", title_justify="left")
    for name in ("metric", "mean", "median", "p90", "p99"):
        lat.add_column(name, justify="left" if name == "metric" else "right")
    for key, name in _LATENCIES:
        s = run[key]
        lat.add_row(name, *(_num(s[k], 2) for k in ("mean", "median", "p90", "p99")))
    summary = Table(show_header=False, title=f"{run['load']['label']}: totals", title_justify="left")
    summary.add_column("metric")
    summary.add_column("value", justify="right")
    slo = run["slo_ms"]
    rows = [
        ("completed / failed", f"{run['completed']} / {run['failed']}"),
        ("duration (s)", _num(run["duration_s"], 2)),
        ("request throughput (req/s)", _num(run["request_throughput"], 2)),
        ("input tokens (tok/s)", f"{run['total_input_tokens']} ({_num(run['input_token_throughput'])}/s)"),
        ("output tokens (tok/s)", f"{run['total_output_tokens']} ({_num(run['output_token_throughput'])}/s)"),
        ("total token throughput (tok/s)", _num(run["total_token_throughput"])),
        ("goodput (req/s)" + (" at " + ", ".join(f"{k}<={v:g}ms" for k, v in slo.items()) if slo else ""),
         _num(run["goodput"], 2) if slo else "- (no --slo)"),
        ("client overhead: wall ms/request (us/chunk), CPU ms/request",
         f"{_num(run['client_overhead_ms_per_request'], 3)} ({_num(run['client_overhead_us_per_chunk'])}), "
         f"{_num(run['client_cpu_ms_per_request'], 3)}"),
        ("event-loop lag (ms, mean / max)",
         f"{_num(run['event_loop_lag_ms']['mean'], 2)} / {_num(run['event_loop_lag_ms']['max'], 2)}"),
    ]
    if run.get("spec_num_drafts") is not None:
        rows.append(("speculative decoding: acceptance rate, mean acceptance length",
                     f"{_num(100 * (run['spec_acceptance_rate'] or 0), 1)}%, "
                     f"{_num(run['spec_mean_acceptance_length'], 2)} ({run['spec_num_draft_tokens']} draft tokens)"))
    if run.get("connection_retries"):
        rows.append(("resent after the server closed a kept-alive connection", str(run["connection_retries"])))
    if run["cancelled"] or run["not_sent"]:
        rows.insert(1, ("interrupted: cancelled / not sent", f"{run['cancelled']} / {run['not_sent']}"))
    for row in rows:
        summary.add_row(*row)
    console.print(lat)
    console.print(summary)
    for error, count in sorted(run["errors"].items(), key=lambda kv: -kv[1])[:5]:
        console.print(f"  {count} failed with {error}", markup=False, highlight=False, style="red")


def print_sweep(console, runs: list[dict]) -> None:
    from rich.table import Table

    table = Table(title="sweep", title_justify="left")
    cols = ("load", "done", "failed", "req/s", "out tok/s", "goodput", "TTFT p50", "TTFT p99", "TPOT p50",
            "TPOT p99", "E2E p50")
    for c in cols:
        table.add_column(c, justify="left" if c == "load" else "right")
    for r in runs:
        table.add_row(r["load"]["label"], str(r["completed"]), str(r["failed"]), _num(r["request_throughput"], 2),
                      _num(r["output_token_throughput"]), _num(r["goodput"], 2),
                      _num(r["ttft_ms"]["median"]), _num(r["ttft_ms"]["p99"]), _num(r["tpot_ms"]["median"]),
                      _num(r["tpot_ms"]["p99"]), _num(r["e2e_ms"]["median"]))
    console.print(table)

"""Request traces for the simulator: synthetic (lengths like `bench serve`'s, Poisson or gamma arrivals,
an optional shared prefix) or a JSONL file, optionally with timestamps.

Prompts are token ids, not text: the simulated scheduler hashes them for the prefix cache, so equal
prefixes hit and random ones do not, as they would in the engine.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

import numpy as np

from tokenmill.bench.serve import arrival_times
from tokenmill.errors import ConfigError


@dataclass
class TraceRequest:
    prompt_token_ids: list[int]
    output_len: int
    arrival: float | None = None  # seconds from the start (open loop); None: whenever a client is free
    priority: int = 0


def _length_bounds(n: int, ratio: float) -> tuple[int, int]:
    return max(1, int(n * (1 - ratio))), max(1, int(n * (1 + ratio)))


def synthetic_trace(num: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                    shared_prefix_len: int = 0, vocab_size: int = 32000, seed: int = 0) -> list[TraceRequest]:
    """Like `bench serve`'s synthetic prompts: lengths uniform in len * (1 +- range_ratio), random tokens
    (which never share a prefix), after an optional prefix common to all. Drawn in bulk: a knee search
    builds traces of ~10^4 requests a dozen times, and token by token that was ~15% of its time."""
    rng = np.random.default_rng(seed)
    prefix = rng.integers(vocab_size, size=shared_prefix_len).tolist()
    lo, hi = _length_bounds(input_len, range_ratio)
    n_in = rng.integers(lo, hi + 1, size=num)
    lo, hi = _length_bounds(output_len, range_ratio)
    n_out = rng.integers(lo, hi + 1, size=num).tolist()
    tokens = rng.integers(vocab_size, size=int(n_in.sum())).tolist()
    ends = np.cumsum(n_in).tolist()
    return [TraceRequest(prefix + tokens[end - n:end], n_out[i]) for i, (n, end) in enumerate(zip(n_in.tolist(), ends))]


def with_arrivals(trace: list[TraceRequest], rate: float, burstiness: float = 1.0, seed: int = 0
                  ) -> list[TraceRequest]:
    """The same requests, arriving at `rate` per second (gamma inter-arrivals, shape `burstiness`)."""
    times = arrival_times(len(trace), rate, burstiness, seed)
    return [TraceRequest(r.prompt_token_ids, r.output_len, t, r.priority) for r, t in zip(trace, times)]


def jsonl_trace(path: str, tokenizer, default_output_len: int, num: int | None = None,
                vocab_size: int = 32000) -> list[TraceRequest]:
    """Lines of {"prompt": text} or {"prompt_len": n} (random tokens), with optional "output_len" (or
    "max_tokens"), "timestamp" (seconds, any origin: arrival times are kept relative to the first)
    and "priority". A `bench serve` dataset works as is."""
    rng = random.Random(0)
    out: list[TraceRequest] = []
    try:
        with open(path) as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                    if "prompt" in row:
                        if tokenizer is None:
                            raise ConfigError(f"{path}:{lineno}: a text prompt needs the model's tokenizer")
                        ids = tokenizer.encode(row["prompt"], add_special_tokens=False)
                    else:
                        ids = [rng.randrange(vocab_size) for _ in range(int(row["prompt_len"]))]
                    n_out = int(row.get("output_len") or row.get("max_tokens") or default_output_len)
                    ts = row.get("timestamp")
                    out.append(TraceRequest(ids, n_out, None if ts is None else float(ts),
                                            int(row.get("priority", 0))))
                except (ValueError, KeyError, TypeError, AttributeError) as e:
                    raise ConfigError(f"{path}:{lineno}: expected {{\"prompt\": \"...\" or \"prompt_len\": N, "
                                      f"\"output_len\": N, \"timestamp\": S}} ({type(e).__name__}: {e})") from None
                if not ids or n_out < 1:
                    raise ConfigError(f"{path}:{lineno}: empty prompt or output_len < 1")
                if num is not None and len(out) >= num:
                    break
    except OSError as e:
        raise ConfigError(f"cannot read {path}: {e.strerror or e}") from None
    if not out:
        raise ConfigError(f"{path} has no requests")
    stamped = [r.arrival is not None for r in out]
    if any(stamped) and not all(stamped):
        raise ConfigError(f"{path}: either every line has a timestamp or none does")
    if all(stamped):
        t0 = min(r.arrival for r in out)
        for r in out:
            r.arrival -= t0
        out.sort(key=lambda r: r.arrival)
    return out

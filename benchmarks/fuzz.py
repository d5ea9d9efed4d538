"""Fuzz a tokenmill server the way a careless or hostile client would.

Two fuzzers, one pass condition:
- schemathesis, driven by the server's own /openapi.json, with every check (documented status
  codes and content types, schema-valid requests accepted, schema-invalid ones rejected, the API
  key enforced), with and without --api-key;
- a mutation fuzzer of valid bodies: wrong types, extreme numbers, huge lists, unicode edge cases,
  out-of-vocabulary token ids, broken JSON, sent concurrently, streaming and not.
Pass: no 5xx, no dropped connection, every error OpenAI-shaped JSON, no traceback in the log, and
the server healthy with an empty KV cache at the end.

    python benchmarks/fuzz.py --cases 10000          # starts its own server
    python benchmarks/fuzz.py --url http://127.0.0.1:8000 --cases 2000 --skip-schemathesis
    python benchmarks/fuzz.py --cases 4000 --server-args "--speculative-config '{\"method\": \"ngram\"}'"

The CI version (about 1000 cases) is tests/test_fuzz.py.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.server_utils import ServerProcess  # noqa: E402

FUZZ_ARGS = ("--max-model-len", "256", "--kv-cache-memory", "64MiB", "--max-num-seqs", "32")
VOCAB = 49152  # the embedded SmolLM2; out-of-vocabulary ids are what matter, not the exact size



def run_schemathesis(url: str, max_examples: int, api_key: str | None = None, seed: int | None = None,
                     max_model_len: int = 256, workers: int = 1) -> tuple[int, str, int]:
    """Run schemathesis with every check; returns (exit code, its report, cases generated).
    One worker: with more, hypothesis parses lambda sources from several threads at once, which
    trips a CPython 3.11 ast bug ("AST constructor recursion depth mismatch")."""
    cmd = [str(Path(sys.executable).with_name("schemathesis")), "run", f"{url}/openapi.json", "--checks", "all",
           "--max-examples", str(max_examples), "--workers", str(workers), "--request-timeout", "120",
           "--max-response-time", "120", "--max-failures", "50", "--no-color",
           "--suppress-health-check", "filter_too_much,too_slow"]
    if seed is not None:
        cmd += ["--seed", str(seed)]
    if api_key:
        cmd += ["-H", f"Authorization: Bearer {api_key}"]
    env = {**os.environ, "SCHEMATHESIS_HOOKS": "benchmarks.fuzz_hooks", "PYTHONPATH": str(ROOT),
           "TOKENMILL_FUZZ_MAX_MODEL_LEN": str(max_model_len), "TOKENMILL_FUZZ_URL": url,
           "TOKENMILL_FUZZ_API_KEY": api_key or ""}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
    report = proc.stdout + proc.stderr
    cases = 0
    for line in report.splitlines():
        if " generated" in line and line.strip()[0].isdigit():
            cases = int(line.split()[0])
    return proc.returncode, report, cases



SEEDS = [
    ("/v1/completions", {"prompt": "The capital of France is", "max_tokens": 4}),
    ("/v1/completions", {"prompt": [504, 3458, 282], "max_tokens": 3, "stream": True,
                         "stream_options": {"include_usage": True}}),
    ("/v1/completions", {"prompt": ["One", "Two"], "max_tokens": 2, "n": 2, "logprobs": 2, "echo": True}),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 5, "temperature": 0.8, "top_p": 0.9, "top_k": 20,
                         "seed": 3, "stop": ["\n"], "logit_bias": {"42": 2.5}, "min_tokens": 1}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4}),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": "Be brief."},
                                           {"role": "user", "content": [{"type": "text", "text": "Why?"}]}],
                              "max_completion_tokens": 4, "stream": True, "logprobs": True, "top_logprobs": 2}),
    ("/tokenize", {"prompt": "Hello world"}),
    ("/tokenize", {"messages": [{"role": "user", "content": "Hi"}]}),
    ("/detokenize", {"tokens": [504, 3458, 282]}),
]
FIELDS = ["prompt", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p",
          "n", "stream", "stream_options", "stop", "seed", "presence_penalty", "frequency_penalty",
          "repetition_penalty", "logit_bias", "logprobs", "top_logprobs", "echo", "best_of", "suffix", "model",
          "min_tokens", "stop_token_ids", "ignore_eos", "tokens", "response_format", "tools",
          "chat_template_kwargs", "add_special_tokens", "user", "\u0000", "\U0001f600"]
UNICODE = ["", "\u0000", "\x7f", "\ufeff", "\ufffd", "\uffff", "\U0010ffff", "\U0001f600" * 50, "e\u0301" * 20,
           "\u202e\u202dRTL", "\u200b\u200c\u200d", "\u0085\u2028\u2029", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢", "日本語のテキスト", "<|im_start|>",
           "</s><s>", "{{ raise_exception('x') }}", "{% for x in range(10**9) %}", "%s%n%x", "\\ud800"]
NUMBERS = [0, -1, 1, 2, -(2**31), 2**31, 2**53 + 1, 2**63, -(2**63) - 1, 2**64, 10**30, 1e308, -1e308, 5e-324,
           0.5, -0.0, 1.0000000001, 3.0, 1e-7, 100, 101, -100, 20, 21, 128, 129, VOCAB - 1, VOCAB]


def nasty_value(rng: random.Random):
    kind = rng.randrange(10)
    if kind == 0:
        return rng.choice([None, True, False, [], {}, "", "0", "1e5", "true", "null"])
    if kind in (1, 2):
        return rng.choice(NUMBERS)
    if kind == 3:
        return rng.choice(UNICODE) * rng.choice([1, 1, 3, 1000])
    if kind == 4:  # token ids, some out of the vocabulary
        return [rng.choice([0, 1, 100, VOCAB - 1, VOCAB, -1, 2**40]) for _ in range(rng.choice([1, 3, 50]))]
    if kind == 5:  # huge lists
        return rng.choice([[5] * 100_000, ["x"] * 10_000, [[1, 2]] * 500, [{"role": "user", "content": "x"}] * 2000])
    if kind == 6:
        return "x" * rng.choice([10_000, 1_000_000])
    if kind == 7:
        return [rng.choice([{"role": rng.choice(["user", "tool", "wizard", "", None]),
                             "content": rng.choice(["hi", None, 5, [{"type": "text", "text": "a"}],
                                                    [{"type": "image_url"}], {"a": 1}])}])]
    if kind == 8:
        return {rng.choice(["include_usage", "type", "42", "-1", "99999999", "a"]): nasty_value(rng)}
    return [nasty_value(rng) for _ in range(rng.randrange(3))]


def render(rng: random.Random, body: dict) -> bytes:
    """The body as JSON text, sometimes broken at the byte level."""
    text = json.dumps(body, ensure_ascii=rng.random() < 0.5)
    kind = rng.randrange(14)
    if kind == 0:
        return text.encode()[: rng.randrange(1, max(2, len(text)))]  # truncated
    if kind == 1:
        return text.replace('"', "'", 1).encode()
    if kind == 2:
        return text[:-1].encode() + b', "temperature": NaN}' if text.endswith("}") else text.encode()
    if kind == 3:
        return b'{"prompt": "\\udc00\\ud800", "max_tokens": 2}'
    if kind == 4:
        return b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    if kind == 5:
        return text.encode() + b"\xff\xfe"
    if kind == 6:
        return text[:-1].encode() + b', "max_tokens": 1, "max_tokens": "x"}' if text.endswith("}") else b"{}"
    return text.encode("utf-8", "surrogatepass")


def mutate(rng: random.Random) -> tuple[str, bytes, bool]:
    path, seed = rng.choice(SEEDS)
    body = json.loads(json.dumps(seed))
    for _ in range(rng.randint(1, 3)):
        key = rng.choice(FIELDS)
        if rng.random() < 0.15 and key in body:
            del body[key]
        else:
            body[key] = nasty_value(rng)
    if rng.random() < 0.1:
        path = rng.choice(["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/v1/nothing"])
    return path, render(rng, body), bool(body.get("stream") is True)


@dataclass
class FuzzResult:
    cases: int = 0
    statuses: Counter = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def summary(self) -> str:
        return (f"{self.cases} cases in {self.seconds:.0f}s, statuses {dict(sorted(self.statuses.items()))}, "
                f"{len(self.failures)} failures")


def _check_response(status: int, headers, content: bytes, streamed: bool) -> str | None:
    """What is wrong with one answer, or None."""
    if status >= 500:
        return f"status {status}: {content[:300]!r}"
    ctype = headers.get("content-type", "")
    if status == 200 and ctype.startswith("text/event-stream"):
        events = [line[6:] for line in content.decode("utf-8").split("\n") if line.startswith("data: ")]
        if not events or events[-1] != "[DONE]":
            return f"stream did not end with [DONE]: {content[-300:]!r}"
        for e in events[:-1]:
            chunk = json.loads(e)
            if "error" in chunk and not (isinstance(code := chunk["error"].get("code"), int) and code < 500):
                return f"stream error event: {e[:300]}"
        return None
    if not ctype.startswith("application/json"):
        return f"status {status} with content-type {ctype!r}"
    payload = json.loads(content)  # strict: the server never writes NaN or lone surrogates
    if status >= 400:
        err = payload.get("error") if isinstance(payload, dict) else None
        # the code: OpenAI's string (context_length_exceeded, model_not_found) or else the status
        code = err.get("code") if isinstance(err, dict) else None
        code_ok = code == status or (isinstance(code, str) and code != "")
        if not isinstance(err, dict) or not err.get("message") or not code_ok:
            return f"status {status} without an OpenAI error body: {content[:300]!r}"
    return None


async def run_mutations(url: str, cases: int, concurrency: int = 8, seed: int = 0,
                        headers: dict | None = None) -> FuzzResult:
    result = FuzzResult()
    rng = random.Random(seed)
    bodies = [mutate(rng) for _ in range(cases)]
    queue: asyncio.Queue = asyncio.Queue()
    for b in bodies:
        queue.put_nowait(b)
    t0 = time.monotonic()

    async def worker():
        limits = httpx.Limits(max_connections=1, max_keepalive_connections=1)
        async with httpx.AsyncClient(timeout=180, limits=limits) as client:
            while not queue.empty():
                path, content, streamed = queue.get_nowait()
                try:
                    r = await client.post(url + path, content=content,
                                          headers={"content-type": "application/json", **(headers or {})})
                    problem = _check_response(r.status_code, r.headers, r.content, streamed)
                    result.statuses[r.status_code] += 1
                except (httpx.HTTPError, ValueError, UnicodeDecodeError) as e:
                    problem = f"{type(e).__name__}: {e}"
                    result.statuses["error"] += 1
                result.cases += 1
                if problem:
                    result.failures.append(f"POST {path} {content[:200]!r} -> {problem}")

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    result.seconds = time.monotonic() - t0
    return result


def server_problems(server: ServerProcess) -> list[str]:
    """The end-of-run conditions: healthy, idle with an empty KV cache, no traceback in the log."""
    problems = []
    if httpx.get(server.url + "/health", timeout=10).status_code != 200:
        problems.append("/health is not 200")
    try:
        server.wait_idle(timeout=60)
    except AssertionError as e:
        problems.append(str(e))
    log = server.log()
    for marker in ("Traceback", "Exception in ASGI application"):
        if marker in log:
            problems.append(f"{marker!r} in the server log:\n{log[log.index(marker) - 200:][:3000]}")
    return problems


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", type=int, default=10_000, help="total cases, about half of them schemathesis'")
    ap.add_argument("--url", help="fuzz a running server instead of starting one (no log checks)")
    ap.add_argument("--seed", type=int, default=None)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--skip-schemathesis", action="store_true")
    ap.add_argument("--server-args", default="", help="more flags for the servers it starts (shell syntax), "
                    "e.g. a --speculative-config or --kv-cache-dtype int8")
    args = ap.parse_args()
    server_args = (*FUZZ_ARGS, *shlex.split(args.server_args))
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    servers = [] if args.url else [ServerProcess(*server_args).wait_ready(),
                                   ServerProcess(*server_args, "--api-key", "fuzz-key").wait_ready()]
    url = args.url or servers[0].url
    failed = False
    try:
        if not args.skip_schemathesis:
            per_op = max(1, args.cases // 2 // 11)  # 11 operations
            for label, target, key in [("schemathesis", url, None),
                                       ("schemathesis --api-key", servers[1].url if servers else None, "fuzz-key")]:
                if target is None:
                    continue
                code, report, n = run_schemathesis(target, per_op if key is None else max(1, per_op // 4), key,
                                                   seed=seed)
                print(f"{label}: {n} cases, exit {code}")
                if code != 0:
                    failed = True
                    print(report[-20_000:])
        mutations = args.cases // 2 if not args.skip_schemathesis else args.cases
        res = asyncio.run(run_mutations(url, mutations, args.concurrency, seed))
        print(f"mutation fuzzer (seed {seed}): {res.summary()}")
        for f in res.failures[:30]:
            print("  ", f)
        failed |= bool(res.failures)
        for srv in servers:
            for p in server_problems(srv):
                failed = True
                print("server:", p)
    finally:
        for srv in servers:
            srv.stop()
    print("FAILED" if failed else "PASSED")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""schemathesis hooks for tokenmill (`SCHEMATHESIS_HOOKS=benchmarks.fuzz_hooks`).

The OpenAPI schema states every rule JSON Schema can express. A few rules relate two fields
(prompt tokens + max_tokens <= max_model_len, min_tokens <= max_tokens, best_of == n,
n x prompts <= 128) and are stated only in descriptions; the server answers 400 when they are
broken. schemathesis' positive phase must not count those 400s as "valid data rejected", so
schema-valid cases that break one are dropped here (negative cases are never dropped). The prompt
length is bounded from above by its UTF-8 bytes (byte-level BPE: a token is at least one byte),
so no dropped case could have fit and no kept case can fail to fit.

Positive cases that ask for structured outputs or tools are dropped as well: whether a regex, a
grammar, a JSON schema or a tool list compiles is the grammar compiler's to say, not JSON
Schema's (tests/test_server_structured.py covers those 400s; negative cases still run).

Positive cases that ask for more than TOKENMILL_FUZZ_TOKEN_BUDGET output tokens (n x prompts x
max_tokens) are dropped too: one n=128 x 255-token request takes minutes on two cores, and tests
throughput, not robustness.
"""

from __future__ import annotations

import os

import schemathesis

MAX_MODEL_LEN = int(os.environ.get("TOKENMILL_FUZZ_MAX_MODEL_LEN", "256"))
MAX_CHOICES = 128
TOKEN_BUDGET = int(os.environ.get("TOKENMILL_FUZZ_TOKEN_BUDGET", "32"))
TEMPLATE_TOKENS = 48  # the chat template's own tokens (and a default system prompt), at most
MESSAGE_TOKENS = 8  # per message: role, separators


def _int(v) -> int | None:
    return int(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _bytes(s) -> int:
    return len(s.encode("utf-8")) if isinstance(s, str) else 0


def completion_fits(body: dict) -> bool:
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], (int, float))):
        prompts = [prompt]
    elif isinstance(prompt, list):
        prompts = prompt
    else:
        return True
    n = _int(body.get("n")) or 1
    if n * len(prompts) > MAX_CHOICES:
        return False
    best_of = _int(body.get("best_of"))
    if best_of is not None and best_of != n:
        return False
    max_tokens = _int(body.get("max_tokens"))
    max_tokens = 16 if max_tokens is None else max(max_tokens, 1)
    if (_int(body.get("min_tokens")) or 0) > max_tokens:
        return False
    for p in prompts:
        tokens = _bytes(p) + 1 if isinstance(p, str) else len(p)  # + a BOS token
        if tokens + max_tokens > MAX_MODEL_LEN:
            return False
    return n * len(prompts) * max_tokens <= TOKEN_BUDGET


def chat_fits(body: dict) -> bool:
    messages = body.get("messages")
    if not isinstance(messages, list):
        return True
    tokens = TEMPLATE_TOKENS
    for m in messages:
        if not isinstance(m, dict):
            return True
        content = m.get("content")
        parts = content if isinstance(content, list) else [{"text": content}]
        tokens += MESSAGE_TOKENS + _bytes(m.get("name")) + sum(_bytes(p.get("text")) for p in parts
                                                                if isinstance(p, dict))
    chosen = body.get("max_completion_tokens")
    max_tokens = _int(chosen if chosen is not None else body.get("max_tokens"))
    if max_tokens is not None and (_int(body.get("min_tokens")) or 0) > max_tokens:
        return False
    n = _int(body.get("n")) or 1
    return tokens + (max_tokens or 1) <= MAX_MODEL_LEN and n * (max_tokens or MAX_MODEL_LEN) <= TOKEN_BUDGET


_COMPILED = ("structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar", "tools",
             "tool_choice")


def compiles_nothing(body: dict) -> bool:
    rf = body.get("response_format")
    json_schema = isinstance(rf, dict) and rf.get("type") == "json_schema"
    return not json_schema and all(body.get(k) is None for k in _COMPILED)


def completion_ok(body: dict) -> bool:
    return compiles_nothing(body) and completion_fits(body)


def chat_ok(body: dict) -> bool:
    return compiles_nothing(body) and chat_fits(body)


_RULES = {"/v1/completions": completion_ok, "/v1/chat/completions": chat_ok}


@schemathesis.hook
def filter_case(context, case) -> bool:
    meta = case.meta
    if meta is None or not meta.generation.mode.is_positive or not isinstance(case.body, dict):
        return True
    rule = _RULES.get(case.operation.path)
    return rule is None or rule(case.body)

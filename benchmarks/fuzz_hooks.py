"""schemathesis hooks for tokenmill (`SCHEMATHESIS_HOOKS=benchmarks.fuzz_hooks`).

The OpenAPI schema states every rule JSON Schema can express. A few rules relate two fields
(prompt tokens + max_tokens <= max_model_len, min_tokens <= max_tokens, best_of == n,
n x prompts <= 128, no ignore_eos or min_tokens with a structured output) and are stated only in
descriptions; the server answers 400 when they are broken. schemathesis' positive phase must not
count those 400s as "valid data rejected", so schema-valid cases that break one are dropped here
(negative cases are never dropped). The prompt length is bounded from above by its UTF-8 bytes
(byte-level BPE: a token is at least one byte), so no dropped case could have fit and no kept
case can fail to fit. A chat prompt's length is asked of the server's /tokenize
(TOKENMILL_FUZZ_URL): what a template renders (tool calls, say) is not bounded by the message text.

Positive cases that ask for structured outputs or tools are dropped as well: whether a regex, a
grammar, a JSON schema or a tool list compiles is the grammar compiler's to say, not JSON
Schema's (tests/test_server_structured.py covers those 400s; negative cases still run).

Positive cases that ask for more than TOKENMILL_FUZZ_TOKEN_BUDGET output tokens (n x prompts x
max_tokens) are dropped too: one n=128 x 255-token request takes minutes on two cores, and tests
throughput, not robustness.
"""

from __future__ import annotations

import json
import os

import httpx
import schemathesis

URL = os.environ.get("TOKENMILL_FUZZ_URL")
API_KEY = os.environ.get("TOKENMILL_FUZZ_API_KEY")
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
    max_tokens = 16 if max_tokens is None else max_tokens  # 0: an echo of the prompt alone, which may fill the context
    if (_int(body.get("min_tokens")) or 0) > max_tokens:
        return False
    for p in prompts:
        tokens = _bytes(p) + 1 if isinstance(p, str) else len(p)  # + a BOS token
        if tokens + max_tokens > MAX_MODEL_LEN:
            return False
    return n * len(prompts) * max(max_tokens, 1) <= TOKEN_BUDGET


def _rendered_tokens(body: dict) -> int | None:
    """The chat prompt's exact length, from the server's own /tokenize (None: not known there)."""
    if not URL:
        return None
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {API_KEY}"} if API_KEY else {})
    payload = {k: body[k] for k in ("messages", "add_generation_prompt", "chat_template_kwargs") if k in body}
    try:  # (ASCII JSON: lone surrogates, which schemathesis sends, cannot be UTF-8 encoded)
        r = httpx.post(f"{URL}/tokenize", content=json.dumps(payload), headers=headers, timeout=30)
    except (httpx.HTTPError, TypeError, ValueError):
        return None
    return r.json().get("count") if r.status_code == 200 else None


def chat_fits(body: dict) -> bool:
    messages = body.get("messages")
    if not isinstance(messages, list):
        return True
    exact = _rendered_tokens(body)
    tokens = TEMPLATE_TOKENS
    for m in messages:
        if not isinstance(m, dict):
            return True
        content = m.get("content")
        parts = content if isinstance(content, list) else [{"text": content}]
        tokens += MESSAGE_TOKENS + _bytes(m.get("name")) + sum(_bytes(p.get("text")) for p in parts
                                                                if isinstance(p, dict))
    if exact is not None:
        tokens = exact
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


def constrains_no_end(body: dict) -> bool:
    """A structured output (json_object included) ends where its grammar does, so the server
    rejects it with ignore_eos or min_tokens (stated in those fields' descriptions)."""
    rf = body.get("response_format")
    structured = isinstance(rf, dict) and rf.get("type") in ("json_object", "json_schema")
    return not structured or (body.get("ignore_eos") is not True and not _int(body.get("min_tokens")))


def completion_ok(body: dict) -> bool:
    return compiles_nothing(body) and constrains_no_end(body) and completion_fits(body)


def chat_ok(body: dict) -> bool:
    return compiles_nothing(body) and constrains_no_end(body) and chat_fits(body)


_RULES = {"/v1/completions": completion_ok, "/v1/chat/completions": chat_ok, "/tokenize": compiles_nothing}


@schemathesis.hook
def filter_case(context, case) -> bool:
    meta = case.meta
    if meta is None or not meta.generation.mode.is_positive or not isinstance(case.body, dict):
        return True
    rule = _RULES.get(case.operation.path)
    return rule is None or rule(case.body)

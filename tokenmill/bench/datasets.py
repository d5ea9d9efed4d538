"""Workloads shared by the benchmarks: synthetic prompts of exact token lengths, or a JSONL file."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass


@dataclass
class BenchRequest:
    prompt: str | list[int]
    prompt_len: int
    output_len: int


def _special_ids(tokenizer) -> set[int]:
    return set(getattr(tokenizer, "all_special_ids", []) or [])


def random_token_prompt(tokenizer, length: int, rng: random.Random, vocab_size: int | None = None) -> list[int]:
    """`length` token ids that decode and re-encode to exactly `length` tokens (so the same prompt
    can be sent as text to any server), avoiding special tokens."""
    vocab = vocab_size or len(tokenizer)
    specials = _special_ids(tokenizer)
    ids = [t for t in (rng.randrange(vocab) for _ in range(length * 2)) if t not in specials][:length]
    for _ in range(8):  # re-tokenization can merge or split pieces; nudge until the length is exact
        text = tokenizer.decode(ids)
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == length:
            return ids
        if len(ids) > length:
            ids = ids[:length]
        else:
            ids += [t for t in (rng.randrange(vocab) for _ in range(length)) if t not in specials][: length - len(ids)]
    return ids


def synthetic(tokenizer, num: int, input_len: int, output_len: int, range_ratio: float = 0.0,
              shared_prefix_len: int = 0, seed: int = 0, as_text: bool = False) -> list[BenchRequest]:
    """`num` requests with input/output lengths uniform in [len*(1-r), len*(1+r)], optionally all
    starting with the same `shared_prefix_len`-token system prompt."""
    rng = random.Random(seed)
    prefix = random_token_prompt(tokenizer, shared_prefix_len, rng) if shared_prefix_len else []
    out = []
    for _ in range(num):
        lo, hi = max(1, int(input_len * (1 - range_ratio))), max(1, int(input_len * (1 + range_ratio)))
        n_in = rng.randint(lo, hi)
        n_out = rng.randint(max(1, int(output_len * (1 - range_ratio))), max(1, int(output_len * (1 + range_ratio))))
        ids = prefix + random_token_prompt(tokenizer, n_in, rng)
        prompt = tokenizer.decode(ids) if as_text else ids
        out.append(BenchRequest(prompt, len(ids), n_out))
    return out


def from_jsonl(path: str, tokenizer, default_output_len: int, num: int | None = None) -> list[BenchRequest]:
    """Lines of {"prompt": "...", "output_len": 128} (output_len optional; also "max_tokens")."""
    out = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            prompt = row["prompt"]
            n_out = int(row.get("output_len") or row.get("max_tokens") or default_output_len)
            out.append(BenchRequest(prompt, len(tokenizer.encode(prompt, add_special_tokens=False)), n_out))
            if num is not None and len(out) >= num:
                break
    return out

"""The speculative-decoding group of the engine configuration: vLLM's `--speculative-config` JSON,
checked key by key (engine.py's EngineConfig holds it with the other groups)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

from tokenmill.config.fields import opt
from tokenmill.errors import ConfigError

SPEC_METHODS = ("ngram", "draft_model")
# "draft_vocab_size": "auto" (the default): the draft's head scores the 32k most frequent tokens of a
# vocabulary of more than 64k (Qwen2.5's 152k: a fifth of its rows), all tokens of a smaller one
DRAFT_VOCAB_SIZE, DRAFT_VOCAB_MIN = 32768, 65536
_SPEC_KEYS = {"method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
              "disable_by_batch_size", "adaptive", "max_spec_factor", "quantization", "draft_p_min",
              "draft_vocab_size", "draft_lookup_min"}


@dataclass
class SpeculativeConfig:
    """Speculative decoding: a proposer drafts tokens, the model verifies them in one pass."""

    speculative_config: dict | str | None = opt(
        "Speculative decoding, as JSON (vLLM's keys): '{\"method\": \"ngram\", \"num_speculative_tokens\": 4, "
        "\"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2}' or '{\"model\": \"qwen2.5-coder-0.5b\", "
        "\"num_speculative_tokens\": 4}'. Optional \"disable_by_batch_size\": no speculation in a step with "
        "more running requests; \"adaptive\" (default true): per step, speculate only where it measured faster; "
        "\"max_spec_factor\" (n-gram, default 1.0): draft at most this many times the match's length in tokens "
        "(up to num_speculative_tokens; null: always num_speculative_tokens); \"quantization\" (draft model): "
        "\"int4\" quantizes the draft's weights to int4 at load (a GGUF draft: its layers stored wider than 5 "
        "bits per weight), a faster draft for slightly worse guesses; \"draft_p_min\" (draft model, default 0.85, "
        "as llama.cpp's --draft-p-min): a draft stops after a token its model gives less than this probability; "
        "\"draft_vocab_size\" (draft model; default \"auto\": 32768 of a vocabulary over 65536 tokens; null: "
        "the whole vocabulary): the draft's LM head scores only this many most frequent tokens (the lowest BPE "
        "ids) and the special tokens, the target still verifies with all of them; \"draft_lookup_min\" (draft "
        "model, default 4; 0: off): where a request's last this many tokens occurred before in its prompt or "
        "output, draft the tokens that followed them (prompt lookup, as the n-gram method) instead of running the "
        "draft model. Default: off.")

    def validate(self) -> None:
        raw = self.speculative_config
        self.method = None
        if raw is None or raw == "" or raw == {}:
            return
        if isinstance(raw, str):
            try:
                raw = json.loads(raw)
            except json.JSONDecodeError as e:
                raise ConfigError(f"speculative_config is not valid JSON: {e}", param="speculative_config") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"speculative_config must be a JSON object, got {raw!r}", param="speculative_config")
        unknown = set(raw) - _SPEC_KEYS
        if unknown:
            raise ConfigError(f"speculative_config: unknown key(s) {', '.join(sorted(unknown))}; known: "
                              f"{', '.join(sorted(_SPEC_KEYS))}", param="speculative_config")
        self.speculative_config = raw
        if not raw.get("method") and raw.get("model") in ("ngram", "[ngram]"):  # vLLM's older spelling of ngram
            raw = {k: v for k, v in raw.items() if k != "model"} | {"method": "ngram"}
        method = raw.get("method") or ("draft_model" if raw.get("model") else None)
        if method not in SPEC_METHODS:
            raise ConfigError(f"speculative_config: unknown method {method!r}; choose ngram (with "
                              f"prompt_lookup_max/min) or draft_model (with \"model\")", param="speculative_config")
        if method == "draft_model" and not raw.get("model"):
            raise ConfigError("speculative_config: method draft_model needs a \"model\"", param="speculative_config")
        k = raw.get("num_speculative_tokens")
        lookup_max = raw.get("prompt_lookup_max", 4)
        lookup_min = raw.get("prompt_lookup_min", 1)
        disable = raw.get("disable_by_batch_size")
        for name, v in (("num_speculative_tokens", k), ("prompt_lookup_max", lookup_max),
                        ("prompt_lookup_min", lookup_min), ("disable_by_batch_size", disable)):
            if v is None and name == "disable_by_batch_size":
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ConfigError(f"speculative_config: {name} must be a positive integer, got {v!r}",
                                  param="speculative_config")
        if lookup_min > lookup_max:
            raise ConfigError(f"speculative_config: prompt_lookup_min ({lookup_min}) > prompt_lookup_max "
                              f"({lookup_max})", param="speculative_config")
        self.method, self.num_speculative_tokens = method, k
        self.prompt_lookup_max, self.prompt_lookup_min = lookup_max, lookup_min
        self.draft_model: str | None = raw.get("model")
        self.adaptive = raw.get("adaptive", True)
        if not isinstance(self.adaptive, bool):
            raise ConfigError(f"speculative_config: adaptive must be true or false, got {self.adaptive!r}",
                              param="speculative_config")
        self.disable_by_batch_size: int | None = disable
        self.draft_quantization = raw.get("quantization")
        if self.draft_quantization not in (None, "int4"):
            raise ConfigError(f"speculative_config: quantization of the draft model is \"int4\" or null, got "
                              f"{self.draft_quantization!r}", param="speculative_config")
        if self.draft_quantization and method != "draft_model":
            raise ConfigError("speculative_config: quantization applies to a draft model only",
                              param="speculative_config")
        self.draft_p_min = raw.get("draft_p_min", 0.85 if method == "draft_model" else None)
        p = self.draft_p_min
        if p is not None and (method != "draft_model" or isinstance(p, bool) or not isinstance(p, int | float)
                              or not 0 <= p < 1):
            raise ConfigError(f"speculative_config: draft_p_min is a probability in [0, 1) for a draft model, got "
                              f"{p!r}", param="speculative_config")
        self.draft_vocab_size = raw.get("draft_vocab_size", "auto" if method == "draft_model" else None)
        n = self.draft_vocab_size
        if n is not None and (method != "draft_model" or n != "auto" and (isinstance(n, bool) or not isinstance(n, int)
                                                                         or n <= 0)):
            raise ConfigError(f"speculative_config: draft_vocab_size is a positive number of tokens, \"auto\" or "
                              f"null (the whole vocabulary) for a draft model, got {n!r}", param="speculative_config")
        self.draft_lookup_min = raw.get("draft_lookup_min", 4 if method == "draft_model" else None)
        n = self.draft_lookup_min
        if n is not None and (method != "draft_model" or isinstance(n, bool) or not isinstance(n, int) or n < 0):
            raise ConfigError(f"speculative_config: draft_lookup_min is a number of tokens >= 0 (0: off) for a draft "
                              f"model, got {n!r}", param="speculative_config")
        self.max_spec_factor = raw.get("max_spec_factor", 1.0)
        f = self.max_spec_factor
        if f is not None and (isinstance(f, bool) or not isinstance(f, int | float) or not 0 < f < math.inf):
            raise ConfigError(f"speculative_config: max_spec_factor must be a positive number or null, got {f!r}",
                              param="speculative_config")

    @property
    def enabled(self) -> bool:
        return getattr(self, "method", None) is not None

    @property
    def num_lookahead_slots(self) -> int:
        """KV slots past the drafts a proposer writes in a step (a draft model's own lookahead)."""
        return self.num_speculative_tokens if self.method == "draft_model" else 0

"""Sampling parameters: names, defaults and semantics follow vLLM / the OpenAI API."""

from __future__ import annotations

import copy
import enum
import math
from dataclasses import dataclass, field

from tokenmill.errors import InvalidRequestError
from tokenmill.structured_output.params import StructuredOutputsParams

GREEDY_EPS = 1e-5
_SEED_RANGE = (-(2**63), 2**63)  # within what torch.Generator.manual_seed takes, with room for n > 1 offsets


class RequestOutputKind(enum.Enum):
    CUMULATIVE = 0  # every output carries the whole text so far
    DELTA = 1  # every output carries only what is new since the last one (streaming)
    FINAL_ONLY = 2  # one output when the request finishes


def _bad(param: str, msg: str) -> InvalidRequestError:
    return InvalidRequestError(f"{param} {msg}", param=param)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: all tokens
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to the model's max length
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs at each sampled position (0: just the sampled token)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None  # JSON schema, regex, choice, grammar
    # set by the engine
    _all_stop_token_ids: set[int] = field(default_factory=set, repr=False)

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.logit_bias:
            try:
                self.logit_bias = {int(k): v for k, v in self.logit_bias.items()}
            except (TypeError, ValueError, AttributeError):
                raise _bad("logit_bias", "must map token ids to biases") from None
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        self._validate()
        if self.temperature < GREEDY_EPS:
            # Greedy: the other sampling knobs have no effect (as in vLLM).
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0
        self._all_stop_token_ids = set(self.stop_token_ids)

    def _validate(self) -> None:
        if not _is_int(self.n) or self.n < 1:
            raise _bad("n", f"must be an integer >= 1, got {self.n!r}")
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            if not _is_num(getattr(self, name)) or not math.isfinite(getattr(self, name)):
                raise _bad(name, f"must be a finite number, got {getattr(self, name)!r}")
        if self.temperature < 0:
            raise _bad("temperature", f"must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise _bad("top_p", f"must be in (0, 1], got {self.top_p}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise _bad("top_k", f"must be an integer >= -1 (0 or -1 disables), got {self.top_k!r}")
        if not 0 <= self.min_p <= 1:
            raise _bad("min_p", f"must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise _bad(name, f"must be in [-2, 2], got {getattr(self, name)}")
        if self.repetition_penalty <= 0:
            raise _bad("repetition_penalty", f"must be > 0, got {self.repetition_penalty}")
        if self.seed is not None and (not _is_int(self.seed) or not _SEED_RANGE[0] <= self.seed <= _SEED_RANGE[1]):
            raise _bad("seed", f"must be an integer in [-2**63, 2**63], got {self.seed!r}")
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise _bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
            raise _bad("min_tokens", f"must be an integer >= 0, got {self.min_tokens!r}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise _bad("min_tokens", f"({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not _is_int(v) or v < 0):
                raise _bad(name, f"must be an integer >= 0, got {v!r}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise _bad("stop", "must be non-empty strings")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise _bad("stop_token_ids", "must be non-negative integers")
        for tok, bias in (self.logit_bias or {}).items():
            if not _is_num(bias) or not -100 <= bias <= 100:  # (NaN fails the comparison)
                raise _bad("logit_bias", f"values must be in [-100, 100], got {bias!r} for token {tok}")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise _bad("output_kind", "must be a RequestOutputKind")
        so = self.structured_outputs
        if so is not None:
            if not isinstance(so, StructuredOutputsParams):
                raise _bad("structured_outputs", "must be a StructuredOutputsParams or a dict")
            # the grammar decides where the output may end
            if self.ignore_eos:
                raise _bad("ignore_eos", "cannot be combined with structured outputs")
            if self.min_tokens:
                raise _bad("min_tokens", "cannot be combined with structured outputs")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    def check_vocab(self, vocab_size: int, max_logprobs: int) -> None:
        """Checks that need the model: token ids in range, logprob counts within the server limit."""
        if self.top_k >= vocab_size:  # all tokens: the same as no top-k, and no huge int reaches a tensor
            self.top_k = 0
        for name, ids in (("logit_bias", list(self.logit_bias or {})), ("stop_token_ids", self.stop_token_ids)):
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise _bad(name, f"has token id(s) {bad[:5]} outside the vocabulary [0, {vocab_size})")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and v > max_logprobs:
                raise _bad(name, f"must be <= {max_logprobs} (the server's max_logprobs), got {v}")

    def for_child(self, index: int) -> SamplingParams:
        """The params of sample `index` of an n > 1 request: its own seed so samples differ but stay
        reproducible."""
        child = copy.copy(self)
        child.n = 1
        if self.seed is not None:
            child.seed = self.seed + index
        return child

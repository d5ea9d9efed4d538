"""What crosses the engine core's boundary: requests in, per-step outputs and statistics out.

Plain msgspec Structs (no torch objects, no live core objects), so the core can run in another
process: `encoder.encode(x)` / `decoder(EngineCoreOutputs).decode(buf)` round-trip every one.
"""

from __future__ import annotations

import dataclasses

import msgspec

from tokenmill.sampling_params import GREEDY_EPS, SamplingParams
from tokenmill.structured_output.params import GrammarSpec

_DEFAULT = {f.name: f.default for f in dataclasses.fields(SamplingParams)}


class CoreSamplingParams(msgspec.Struct, frozen=True, omit_defaults=True):
    """The part of SamplingParams the core acts on (the front end keeps stop strings, n, output
    kind and detokenization options). Names and defaults are SamplingParams's own."""

    temperature: float = _DEFAULT["temperature"]
    top_p: float = _DEFAULT["top_p"]
    top_k: int = _DEFAULT["top_k"]
    min_p: float = _DEFAULT["min_p"]
    presence_penalty: float = _DEFAULT["presence_penalty"]
    frequency_penalty: float = _DEFAULT["frequency_penalty"]
    repetition_penalty: float = _DEFAULT["repetition_penalty"]
    logit_bias: dict[int, float] | None = None
    seed: int | None = _DEFAULT["seed"]
    min_tokens: int = _DEFAULT["min_tokens"]
    stop_token_ids: list[int] = []
    ignore_eos: bool = _DEFAULT["ignore_eos"]
    logprobs: int | None = _DEFAULT["logprobs"]
    prompt_logprobs: int | None = _DEFAULT["prompt_logprobs"]
    grammar: GrammarSpec | None = None  # structured output: the worker's matcher follows it

    @classmethod
    def from_params(cls, p: SamplingParams) -> CoreSamplingParams:
        copied = {name: getattr(p, name) for name in cls.__struct_fields__ if name in _DEFAULT}
        return cls(**{**copied, "logit_bias": p.logit_bias or None, "stop_token_ids": list(p.stop_token_ids),
                      "grammar": p.structured_outputs.spec() if p.structured_outputs is not None else None})

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS


class EngineCoreRequest(msgspec.Struct, omit_defaults=True):
    """One sequence to generate (an n > 1 request is n of these, made by the front end)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: CoreSamplingParams
    eos_token_ids: list[int]
    max_tokens: int  # effective: the front end has resolved None against max_model_len
    arrival_time: float  # time.monotonic() of the front end (same machine: the same clock)
    cache_salt: bytes = b""  # extra key of the first block's hash (isolates tenants' prefix caches)
    priority: int = 0  # lower is served first under --scheduling-policy priority


class TokenLogprobs(msgspec.Struct, array_like=True, gc=False):
    """Logprobs at one position: the chosen (sampled or prompt) token first, then the top-N."""

    token_ids: list[int]
    logprobs: list[float]
    rank: int  # of the chosen token; 1 = the most likely


class PromptLogprobs(msgspec.Struct, array_like=True, gc=False):
    """Prompt logprobs computed in one step: entry j scores prompt token `first_position + j`."""

    first_position: int
    entries: list[TokenLogprobs]


class EngineCoreOutput(msgspec.Struct, omit_defaults=True, gc=False):
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int] = []
    new_logprobs: list[TokenLogprobs] | None = None  # one per new token
    prompt_logprobs: PromptLogprobs | None = None
    finish_reason: str | None = None  # "stop", "length", "abort"
    stop_reason: int | str | None = None  # the stop token id that ended it
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    first_scheduled_time: float | None = None
    num_preemptions: int = 0
    # the request's speculation so far: verifications with drafts, draft tokens, accepted drafts
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


class SchedulerLoad(msgspec.Struct, frozen=True):
    """The work the core holds, in requests and tokens: what SLO admission predicts from."""

    num_running: int = 0
    num_waiting: int = 0
    running_context_tokens: int = 0  # sum of the running requests' computed tokens
    running_prefill_tokens: int = 0  # prompt tokens of running requests not yet computed
    running_decode_tokens_left: int = 0  # output tokens the running requests may still produce
    waiting_prompt_tokens: int = 0  # tokens the waiting requests must (re)compute
    waiting_decode_tokens: int = 0  # output tokens the waiting requests may still produce

SPEC_COUNTS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")  # speculation, as reported


def spec_counts(obj) -> tuple[int, int, int]:
    """The SPEC_COUNTS of anything that carries them (an output, metrics, a stats record)."""
    return tuple(getattr(obj, name) for name in SPEC_COUNTS)


class SpecDecodingStats(msgspec.Struct):
    """Speculative decoding, cumulative (vLLM's spec_decode_* counters)."""

    num_drafts: int = 0  # verification steps of one request with at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = []

    def record(self, num_draft: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        per_pos = self.num_accepted_tokens_per_pos
        if len(per_pos) < num_draft:
            per_pos.extend([0] * (num_draft - len(per_pos)))
        for i in range(num_accepted):
            per_pos[i] += 1

    def snapshot(self) -> SpecDecodingStats:
        return SpecDecodingStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                                 list(self.num_accepted_tokens_per_pos))

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verification step: 1 (the target's own) + accepted drafts."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def summary(self) -> dict:
        """The counts and both figures, as the bench commands report them (spec_*)."""
        out = {f"spec_{name}": getattr(self, name) for name in SPEC_COUNTS}
        return {**out, "spec_acceptance_rate": self.acceptance_rate,
                "spec_mean_acceptance_length": self.mean_acceptance_length}


class SchedulerStats(msgspec.Struct):
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    kv_blocks_used: int
    kv_blocks_total: int
    prefix_queries: int  # cumulative, in tokens
    prefix_hits: int
    num_preemptions: int  # cumulative
    load: SchedulerLoad = SchedulerLoad()
    spec_decoding: SpecDecodingStats | None = None
    num_received: int = 0  # sequences the core has taken in, cumulative (see engine/load_tracker.py)


class EngineCoreOutputs(msgspec.Struct, omit_defaults=True):
    """Everything one core step reports."""

    outputs: list[EngineCoreOutput] = []
    timestamp: float = 0.0  # time.monotonic() when the step finished
    scheduler_stats: SchedulerStats | None = None
    failed: dict[str, str] = {}  # request id -> why: scheduling it raised, and it alone ended

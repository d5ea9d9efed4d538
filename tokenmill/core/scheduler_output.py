"""One step between the scheduler and the model runner, as deltas (vLLM V1's shape).

The runner keeps its own state per request (token ids, block table, sampling params, generator).
The scheduler sends the whole request once (`NewRequestData`) and afterwards only what changed
(`CachedRequestData`); the runner sends back, per request, the k >= 1 tokens a step sampled.
Plain msgspec Structs, so scheduler and runner can live in different processes.
"""

from __future__ import annotations

import msgspec

from tokenmill.core.messages import CoreSamplingParams, PromptLogprobs, TokenLogprobs


class NewRequestData(msgspec.Struct, gc=False):
    """A request the runner has not seen: everything it needs to run and sample it."""

    req_id: str
    prompt_token_ids: list[int]
    sampling_params: CoreSamplingParams
    eos_token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int  # prefix-cache hits: KV already in these blocks


class CachedRequestData(msgspec.Struct, gc=False):
    """A request the runner already holds. Its tokens are the prompt plus what the runner sampled."""

    req_id: str
    # preempted since the runner last ran it: its blocks were freed, `new_block_ids` is the whole
    # new table (else only blocks appended this step)
    resumed_from_preemption: bool
    new_block_ids: list[int]
    num_computed_tokens: int  # the scheduler's count (may move back, e.g. on a rejected draft)


class SchedulerOutput(msgspec.Struct):
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    # request id -> new tokens this step, in scheduling order (running requests, then admitted ones)
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    preempted_req_ids: list[str] = []  # blocks freed: the runner forgets their block tables
    finished_req_ids: list[str] = []  # finished or aborted since the last step: the runner drops them
    # speculative decoding: draft tokens to verify this step, after the request's known tokens
    # (counted in num_scheduled_tokens)
    scheduled_spec_decode_tokens: dict[str, list[int]] = {}
    # request id -> length its block table is cut to (blocks past the accepted tokens were freed)
    num_kept_blocks: dict[str, int] = {}
    # whether the runner drafts for the next step after this one (the speculation policy decides a
    # step ahead, so a step it runs without speculation pays no proposer)
    propose_drafts: bool = True
    # one stream: the most passes a draft model runs for a request (the policy's
    # draft length, known before drafting, so passes it would cut are not spent); None: k
    max_draft_passes: int | None = None

    @property
    def is_empty(self) -> bool:
        return not self.num_scheduled_tokens


class ModelRunnerOutput(msgspec.Struct, omit_defaults=True):
    """Per request that reached its last known token: the tokens this step yields (1 + accepted
    draft tokens with speculative decoding), and their logprobs when asked for; per request the
    proposer's draft tokens for the next step, and the seconds drafting took (part of this step's
    time, but spent for the next one: the speculation policy charges it there), of which a draft
    model spent catching up on a prompt or on tokens decoded without it (a prefill, charged to no
    step)."""

    sampled_token_ids: dict[str, list[int]] = {}
    logprobs: dict[str, list[TokenLogprobs]] = {}
    prompt_logprobs: dict[str, PromptLogprobs] = {}
    spec_token_ids: dict[str, list[int]] = {}
    draft_seconds: float = 0.0
    draft_prefill_seconds: float = 0.0

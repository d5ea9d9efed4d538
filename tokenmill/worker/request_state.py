"""The runner's own state per request, kept up to date from SchedulerOutput deltas.

The runner never sees the core's Request objects: it learns a request once (NewRequestData), then
per step its new blocks and computed-token count (CachedRequestData), and it appends the tokens it
samples itself. A preempted request keeps its state (tokens, generator: a seeded request resumes
its random stream where it left off) but loses its block table; a finished one is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.core.messages import CoreSamplingParams
from tokenmill.core.scheduler_output import NewRequestData, SchedulerOutput


@dataclass(slots=True, eq=False)
class RequestState:
    req_id: str
    token_ids: list[int]  # prompt + sampled
    num_prompt_tokens: int
    params: CoreSamplingParams
    generator: torch.Generator | None  # None: the runner's shared generator
    block_ids: list[int]
    num_computed_tokens: int
    output_token_ids: list[int]
    min_tokens_banned: list[int]  # stop tokens (and EOS unless ignore_eos), banned before min_tokens

    @classmethod
    def new(cls, r: NewRequestData, device: torch.device) -> RequestState:
        p = r.sampling_params
        gen = torch.Generator(device=device).manual_seed(p.seed) if p.seed is not None else None
        banned = set(p.stop_token_ids) | (set() if p.ignore_eos else set(r.eos_token_ids))
        return cls(r.req_id, list(r.prompt_token_ids), len(r.prompt_token_ids), p, gen, list(r.block_ids),
                   r.num_computed_tokens, [], sorted(banned))

    def samples(self, num_new: int) -> bool:
        """Whether a step computing `num_new` tokens reaches the last known token (so samples)."""
        return self.num_computed_tokens + num_new == len(self.token_ids)

    def append(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)


class RequestStates(dict[str, RequestState]):
    def apply(self, sched: SchedulerOutput, device: torch.device) -> list[tuple[RequestState, int]]:
        """Bring the states up to date; returns (state, new tokens) of this step's batch, in
        scheduling order."""
        for rid in sched.finished_req_ids:  # first: a new request may reuse a finished one's id
            self.pop(rid, None)
        for rid in sched.preempted_req_ids:
            state = self.get(rid)
            if state is not None:
                state.block_ids = []
        for r in sched.scheduled_new_reqs:
            self[r.req_id] = RequestState.new(r, device)
        for r in sched.scheduled_cached_reqs:
            state = self[r.req_id]
            if r.resumed_from_preemption:
                state.block_ids = list(r.new_block_ids)
            else:
                state.block_ids.extend(r.new_block_ids)
            state.num_computed_tokens = r.num_computed_tokens
        return [(self[rid], n) for rid, n in sched.num_scheduled_tokens.items()]

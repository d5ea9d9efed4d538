"""The shape of one engine step: what its time depends on.

GEMMs scale with the tokens in the batch, decode attention with the context it reads, prefill
attention with query x key pairs, the LM head and sampler with the rows sampled, and the engine's
Python work with the sequences. The real scheduler's output and a calibration step both reduce to
this, so the cost model sees the same thing in the planner, the simulator and admission control.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class StepShape:
    num_seqs: int = 0
    num_decodes: int = 0  # sequences with one new token
    prefill_tokens: int = 0  # new tokens of the other sequences (prompt chunks, recomputation)
    decode_context: int = 0  # sum over decodes of the context attended (cached + new)
    prefill_pairs: int = 0  # sum over prefill chunks of query x key pairs (causal within the chunk)
    prefill_context: int = 0  # sum over prefill chunks of the tokens cached before the chunk
    num_sampled: int = 0  # rows that reach their last token: LM head + sampler
    greedy: bool = False  # every sampled row is greedy (argmax only)

    @property
    def num_tokens(self) -> int:
        return self.num_decodes + self.prefill_tokens

    @classmethod
    def build(cls, query_lens, context_lens, sampled, greedy: bool = False) -> StepShape:
        """Per sequence: new tokens, context after the step (cached + new), and whether it samples."""
        decodes = dec_ctx = pf_tokens = pairs = pf_ctx = 0
        for q, ctx in zip(query_lens, context_lens):
            if q == 1:
                decodes += 1
                dec_ctx += ctx
            else:
                before = ctx - q
                pf_tokens += q
                pf_ctx += before
                pairs += q * before + q * (q + 1) // 2
        return cls(len(query_lens), decodes, pf_tokens, dec_ctx, pairs, pf_ctx, int(sum(sampled)), bool(greedy))

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> StepShape:
        return cls(**d)


def shape_of(sched, requests) -> StepShape:
    """The shape of a step the real scheduler built: `sched` its SchedulerOutput, `requests` the
    scheduler's requests by id (read before `Scheduler.update` moves them on)."""
    q, ctx, sampled, greedy = [], [], [], True
    for rid, n in sched.num_scheduled_tokens.items():
        req = requests[rid]
        samples = req.num_computed_tokens + n == req.num_tokens
        q.append(n)
        ctx.append(req.num_computed_tokens + n)
        sampled.append(samples)
        if samples and not req.params.greedy:
            greedy = False
    return StepShape.build(q, ctx, sampled, greedy and any(sampled))

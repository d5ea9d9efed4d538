"""Results do not depend on when requests arrive: requests added between engine steps, a few at a
time (as the engine core in its own process receives them over ZMQ while it steps), give the tokens
of the same requests submitted at once, and logprobs within fp32 rounding (test_core_process.py
explains the tolerance)."""

from __future__ import annotations

import copy
import random

import pytest

from tests.test_core_process import ENGINE, _logprobs, _mixed_requests, _summary, assert_logprobs_close
from tokenmill import LLM
from tokenmill.sampling_params import RequestOutputKind


def _run(llm: LLM, prompts, params, tag: str, rng: random.Random | None):
    """All requests at once (rng None), or a random 0..8 of them before each step."""
    engine = llm.engine
    engine.core.kv.pool.reset_prefix_cache()  # each run starts without the previous one's prefixes
    pending = []
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        p = copy.copy(p)
        p.output_kind = RequestOutputKind.FINAL_ONLY
        pending.append(engine.process(f"{tag}{i}", prompt, p))
    done = {}
    while pending or engine.has_unfinished_requests():
        take = len(pending) if rng is None else rng.randint(0, 8)
        for p in pending[:take]:
            engine.add_processed(p)
        del pending[:take]
        if engine.has_unfinished_requests():
            done.update((o.request_id, o) for o in engine.step() if o.finished)
    outs = [done[f"{tag}{i}"] for i in range(len(prompts))]
    for o in outs:
        o.request_id = o.request_id.removeprefix(tag)
    return outs


@pytest.mark.slow
def test_staggered_arrivals_match_all_at_once():
    prompts, params = _mixed_requests(36)
    llm = LLM(**ENGINE)
    base = _run(llm, prompts, params, "all-", None)
    for seed in (1, 2):
        other = _run(llm, prompts, params, f"s{seed}-", random.Random(seed))
        assert _summary(other) == _summary(base)
        assert_logprobs_close(_logprobs(other), _logprobs(base))

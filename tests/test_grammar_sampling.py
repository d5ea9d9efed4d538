"""Sampling under a grammar on the embedded model's real tokenizer, with synthetic logits: rows
checked after sampling (greedy, temperature alone) and rows masked up front (top-p, seeded) must draw
from the masked distribution. Pearson's chi-square at significance 0.001 (test_rejection_sampler)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from tests.test_rejection_sampler import assert_distributed_as
from tokenmill.core.messages import CoreSamplingParams
from tokenmill.core.scheduler_output import NewRequestData
from tokenmill.structured_output import StructuredOutputsParams
from tokenmill.worker.request_state import RequestState
from tokenmill.worker.sampler import Sampler, SamplingBatch

VOCAB = 49152


@pytest.fixture(scope="module")
def compiler(grammar_compiler):
    return grammar_compiler


def _states(compiler, n: int, **params) -> list[RequestState]:
    spec = StructuredOutputsParams(choice=["yes", "no", "maybe", "never"]).spec()

    def one(i: int) -> CoreSamplingParams:  # a seeded row gets its own seed: rows must differ
        seed = {"seed": params["seed"] + i} if "seed" in params else {}
        return CoreSamplingParams(grammar=spec, **{**params, **seed})

    return [RequestState.new(NewRequestData(f"r{i}", [1, 2, 3], one(i), [2], [0], 0), torch.device("cpu"),
                             compiler.submit) for i in range(n)]


def _logits(states: list[RequestState]) -> tuple[torch.Tensor, list[int]]:
    """Logits that favour tokens the grammar refuses (so most first draws are refused), and the
    allowed first tokens with distinct weights."""
    probe = torch.zeros(1, VOCAB)
    Sampler(torch.Generator()).process(probe, SamplingBatch.build(states[:1], VOCAB, torch.device("cpu")))
    allowed = (probe[0] > float("-inf")).nonzero().flatten().tolist()
    assert 2 <= len(allowed) < 20, allowed
    row = torch.full((VOCAB,), -5.0)
    row[20000:20010] = 3.0  # refused: most of the mass
    row[20000] = 3.5
    assert not set(range(20000, 20010)) & set(allowed)
    for j, t in enumerate(allowed):
        row[t] = 1.0 - 0.15 * j
    return row.expand(len(states), VOCAB).clone(), allowed


def _masked(row: torch.Tensor, allowed: list[int], temperature: float = 1.0) -> torch.Tensor:
    p = torch.zeros(VOCAB, dtype=torch.float64)
    p[allowed] = torch.softmax(row[allowed].double() / temperature, dim=0)
    return p


@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=0.7, seed=5), dict(top_p=0.9)],
                         ids=["temperature", "seeded", "top-p"])
def test_grammar_rows_draw_from_the_masked_distribution(compiler, params):
    states = _states(compiler, 200, **params)
    logits, allowed = _logits(states)
    sampler, counts = Sampler(torch.Generator().manual_seed(0)), Counter()
    batch = SamplingBatch.build(states, VOCAB, torch.device("cpu"))
    for _ in range(20):
        sampler.prepare(states)
        counts.update(sampler(logits.clone(), batch).token_ids)
    p = _masked(logits[0], allowed, params.get("temperature", 1.0))
    if "top_p" in params:  # the nucleus of the masked distribution
        order = p.argsort(descending=True)
        keep = (p[order].cumsum(0) - p[order]) < params["top_p"]
        p[order[~keep]] = 0
        p /= p.sum()
    assert_distributed_as(counts, p)
    sampler.close()


def test_greedy_grammar_rows_take_the_masked_argmax_and_keep_logprobs_raw(compiler):
    states = _states(compiler, 3, temperature=0.0, logprobs=1)
    logits, allowed = _logits(states)
    sampler = Sampler(torch.Generator())
    out = sampler(logits.clone(), SamplingBatch.build(states, VOCAB, torch.device("cpu")))
    assert out.token_ids == [allowed[0]] * 3
    raw = torch.log_softmax(logits[0], dim=-1)
    assert out.logprobs[0].logprobs[0] == pytest.approx(float(raw[allowed[0]]), abs=1e-5)
    assert out.logprobs[0].token_ids[1] == 20000  # the raw distribution's top token, refused by the grammar
    assert all(s.grammar.num_accepted == 0 for s in states)  # checking a token does not move the matcher
    sampler.close()

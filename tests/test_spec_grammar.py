"""Structured outputs with speculation: a grammar request's drafts are cut to what its grammar takes,
and each verified position keeps only what the grammar allows there. So its tokens are those of
decoding without speculation, greedy and seeded alike (a seeded row draws once a token from the
masked distribution either way), for both proposers; and it does draft.
"""

from __future__ import annotations

import json
import re
from concurrent.futures import Future

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.core.messages import CoreSamplingParams
from tokenmill.core.scheduler_output import NewRequestData
from tokenmill.structured_output import StructuredOutputsParams
from tokenmill.structured_output.matcher import GrammarState, unpack_banned
from tokenmill.worker.logits_processors import _deferrable
from tokenmill.worker.request_state import RequestState

ROW = '{"name": "tokenmill", "version": 3, "tags": ["fast", "small"]}'
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "version": {"type": "integer"},
                                           "tags": {"type": "array", "items": {"type": "string"}}},
          "required": ["name", "version", "tags"]}
DEFS = "def one():\n    return 1\n"
DEFS_RE = r"(def [a-z]+\(\):\n    return [0-9]+\n){3}"
NUMBERS_RE = r"[0-9]+( [0-9]+){5}"
CASES = [  # prompt, structured output, what the output must match; the n-gram proposer drafts from the prompt
    ("Copy each row exactly.\n" + (ROW + "\n") * 4, {"json": SCHEMA}, None),
    ("Write three functions.\n" + DEFS * 5, {"regex": DEFS_RE}, DEFS_RE),
    # the prompt's words are drafted, and the grammar refuses them: drafts cut to nothing
    ("hello world hello world hello world hello world. Numbers: 1 2 3 hello world", {"regex": NUMBERS_RE},
     NUMBERS_RE),
    ("Is the sky blue? yes yes yes", {"choice": ["yes indeed", "no way"]}, None),
]
BASE = dict(dtype="float32", quantization="none", kv_cache_memory="128MiB", max_model_len=512, progress=False)


def _params(temperature: float) -> list[SamplingParams]:
    return [SamplingParams(temperature=temperature, seed=11 + i if temperature else None, max_tokens=48,
                           structured_outputs=StructuredOutputsParams(**so)) for i, (_, so, _) in enumerate(CASES)]


def _run(llm: LLM, temperature: float):
    prompts = [p for p, _, _ in CASES] + ["def f(x):\n    return x + 1\n" * 4]  # and one unconstrained
    params = _params(temperature) + [SamplingParams(temperature=temperature, seed=5, max_tokens=24)]
    return llm.generate(prompts, params, use_tqdm=False)


@pytest.fixture(scope="module")
def reference():
    llm = LLM(**BASE)
    outs = {t: _run(llm, t) for t in (0.0, 1.0)}
    del llm
    return outs


def _check_valid(outs) -> None:
    for (_, so, pattern), o in zip(CASES, outs):
        text = o.outputs[0].text
        if "json" in so:
            assert set(json.loads(text)) == {"name", "version", "tags"}, text
        elif pattern is not None:
            assert re.fullmatch(pattern, text), text
        else:
            assert text in so["choice"], text


@pytest.mark.slow
@pytest.mark.parametrize("proposer", ["ngram", "draft"])
def test_grammar_requests_speculate_and_keep_the_tokens_of_no_speculation(reference, proposer, smol_path):
    spec = {"method": "ngram", "num_speculative_tokens": 6, "prompt_lookup_max": 4, "prompt_lookup_min": 2} \
        if proposer == "ngram" else {"model": str(smol_path), "num_speculative_tokens": 4, "draft_lookup_min": 0}
    llm = LLM(speculative_config=json.dumps({**spec, "adaptive": False}), **BASE)
    for temperature in (0.0, 1.0):
        outs = _run(llm, temperature)
        assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in reference[temperature]]
        _check_valid(outs)
        # the JSON and function rows repeat their prompts: they draft, and keep drafts
        for o in outs[:2]:
            assert o.metrics.num_drafts > 0 and o.metrics.num_accepted_tokens > 0, o.metrics
    _check_valid(reference[1.0])
    core = llm.engine.core
    assert core.kv.pool.num_free_blocks == core.kv.num_blocks and not core.worker.runner.requests


@pytest.fixture(scope="module")
def numbers_grammar(grammar_compiler):
    from tokenmill.model.loader import load_tokenizer, resolve_model

    spec = StructuredOutputsParams(regex=NUMBERS_RE).spec()
    return load_tokenizer(resolve_model(None)), grammar_compiler.get(spec)


def test_drafts_are_cut_where_the_grammar_refuses_and_masked_as_after_each(numbers_grammar):
    tokenizer, compiled = numbers_grammar
    ids = tokenizer.encode("12 7 hello 3", add_special_tokens=False)
    state = GrammarState(compiled, stop_token_ids=[2])
    n = state.valid_prefix(ids)
    taken = tokenizer.decode(ids[:n])
    assert taken == "12 7 " or taken == "12 7", taken  # the digits and spaces, not "hello"
    assert state.num_accepted == 0 and state.valid_prefix(ids[:n]) == n  # the matcher did not move
    masks = state.draft_masks(ids)
    assert masks.shape == (len(ids), 49152)
    for j in range(n):  # row j: what the grammar allows after ids[:j + 1], as a matcher that took them
        other = GrammarState(compiled, ids[:j + 1], stop_token_ids=[2])
        words = torch.zeros(1, (49152 + 31) // 32, dtype=torch.int32)
        other.matcher.fill_next_token_bitmask(words)
        assert torch.equal(masks[j], unpack_banned(words, 49152)[0])
        if j + 1 < n:
            assert not masks[j, ids[j + 1]]  # the next draft is allowed there
    assert masks[n - 1, ids[n]]  # the refused draft is banned where it was drafted
    assert not masks[n:].any()  # past it: never sampled from
    assert state.num_accepted == 0 and not state.failed


def test_a_seeded_grammar_row_is_masked_before_its_draw(numbers_grammar):
    """Not drawn from the whole distribution and drawn again if refused (two uniforms where its
    verification spends one): its tokens would then depend on whether a step speculated."""
    _, compiled = numbers_grammar
    spec = StructuredOutputsParams(regex=NUMBERS_RE).spec()

    def state(seed):
        p = CoreSamplingParams(grammar=spec, temperature=1.0, seed=seed)
        done = Future()
        done.set_result(compiled)
        return RequestState.new(NewRequestData("r", [1, 2, 3], p, [2], [0], 0), torch.device("cpu"),
                                lambda _: done)

    assert not _deferrable(state(1)) and _deferrable(state(None))


def test_a_draft_that_ends_the_grammar_ends_its_verification(numbers_grammar):
    """A draft model drafts the stop token where the grammar can end: verification goes no further
    (the matcher has terminated there; the scheduler drops what follows a stop token)."""
    tokenizer, compiled = numbers_grammar
    ids = tokenizer.encode("1 2 3 4 5 6", add_special_tokens=False)
    state = GrammarState(compiled, ids[:1], stop_token_ids=[2])
    drafts = ids[1:] + [2, 5]
    assert state.valid_prefix(drafts) == len(ids)  # up to and with the stop token
    drafts = drafts[:len(ids)]
    masks = state.draft_masks(drafts)
    assert not masks[-1].any()  # after the stop token: never sampled from
    assert not masks[-2, 2] and masks[-2].sum() > 40000  # after the sixth number: its end, or more digits
    never = lambda j, banned: pytest.fail("no refused argmax here")  # noqa: E731
    assert state.greedy_tokens(drafts + [7], drafts, never) == drafts + [7]
    assert state.num_accepted == 1 and state.live

"""The runner's own per-request state, driven by SchedulerOutput deltas on a real model: a
preempted request keeps its tokens and random stream but loses its blocks, resumes in other
blocks, and continues exactly as if never interrupted; a finished one is dropped."""

from __future__ import annotations

import gc

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.core.messages import CoreSamplingParams
from tokenmill.core.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput

PROMPT = list(range(100, 120))  # 20 tokens: two blocks of 16


def _out(n, new=(), cached=(), preempted=(), finished=()):
    return SchedulerOutput(list(new), list(cached), n, sum(n.values()), list(preempted), list(finished))


def _decode(rid, computed, new_blocks=(), resumed=False):
    return CachedRequestData(rid, resumed, list(new_blocks), computed)


@pytest.fixture(scope="module")
def tiny_llm(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), dtype="float32", kv_cache_memory="64MiB", progress=False)
    yield llm
    del llm
    gc.collect()


@pytest.mark.parametrize("params", [CoreSamplingParams(temperature=0.0, repetition_penalty=1.3),
                                    CoreSamplingParams(temperature=1.0, seed=7, presence_penalty=0.5)],
                         ids=["greedy-penalized", "seeded"])
def test_preempted_request_resumes_where_it_left_off(tiny_llm, params):
    runner = tiny_llm.engine.core.worker.runner

    def sample(sched, rid):
        return runner.execute(sched).sampled_token_ids[rid][0]

    # reference: six tokens without interruption
    ref = [sample(_out({"ref": 20}, new=[NewRequestData("ref", PROMPT, params, [], [0, 1], 0)]), "ref")]
    for k in range(5):
        ref.append(sample(_out({"ref": 1}, cached=[_decode("ref", 20 + k)]), "ref"))
    runner.execute(_out({}, finished=["ref"]))
    assert "ref" not in runner.requests

    # A: three tokens, then preempted; B takes its blocks (overwriting A's KV)
    toks = [sample(_out({"a": 20}, new=[NewRequestData("a", PROMPT, params, [], [2, 3], 0)]), "a")]
    for k in range(2):
        toks.append(sample(_out({"a": 1}, cached=[_decode("a", 20 + k)]), "a"))
    other = CoreSamplingParams(temperature=1.0)
    runner.execute(_out({"b": 28}, new=[NewRequestData("b", list(range(300, 328)), other, [], [2, 3], 0)],
                        preempted=["a"]))
    state = runner.requests["a"]
    assert state.block_ids == [] and state.token_ids == PROMPT + toks and state.output_token_ids == toks

    # resumed in other blocks: recomputes its 23 tokens, then decodes next to B
    toks.append(sample(_out({"b": 1, "a": 23}, cached=[_decode("b", 28), _decode("a", 0, [4, 5], True)]), "a"))
    assert runner.requests["a"].block_ids == [4, 5]
    for k in range(2):
        toks.append(sample(_out({"b": 1, "a": 1}, cached=[_decode("b", 29 + k), _decode("a", 23 + k)]), "a"))
    assert toks == ref
    runner.execute(_out({}, finished=["a", "b"]))
    assert not runner.requests


@pytest.mark.slow
def test_sampling_across_preemption_matches_running_alone():
    """Seeded and penalized requests under constant preemption (fp32, dense weights): the same tokens
    as alone."""
    llm = LLM(dtype="float32", quantization="none", kv_cache_memory=24 * 16 * 46080, max_model_len=256, progress=False)
    tok = llm.get_tokenizer()
    prompts = [tok.encode(f"Story {i}: once upon a time in a land far away, there lived a {w}")
               for i, w in enumerate(["dragon", "king", "cat", "robot", "wizard", "child", "ship", "tree"])]
    kinds = [dict(temperature=1.0, seed=1), dict(temperature=0.8, top_p=0.9, seed=2),
             dict(temperature=0, repetition_penalty=1.3), dict(temperature=1.2, top_k=20, presence_penalty=1.0, seed=3),
             dict(temperature=0, min_tokens=40, logit_bias={28: -5.0}, frequency_penalty=0.5)]
    params = [SamplingParams(max_tokens=48, ignore_eos=True, **kinds[i % len(kinds)]) for i in range(len(prompts))]
    alone = [llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids for p, sp in zip(prompts, params)]
    core = llm.engine.core
    assert core.scheduler.num_preemptions == 0
    together = llm.generate(prompts, params, use_tqdm=False)
    assert core.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in together] == alone
    assert not core.worker.runner.requests and core.kv.pool.num_free_blocks == core.kv.num_blocks
    del llm
    gc.collect()


def test_token_array_follows_appends_and_rollbacks():
    from tokenmill.worker.request_state import RequestState

    state = RequestState("r", [1, 2, 3], 3, CoreSamplingParams(), None, [], 0, [], [])
    state.append(4)
    assert state.token_array().tolist() == [1, 2, 3, 4]  # built from the tokens at first use
    for tok in (5, 6, 7):
        state.append(tok)
    state.rollback(2)
    state.append(9)  # a rolled-back position taken by another token
    assert state.token_array().tolist() == state.token_ids == [1, 2, 3, 4, 5, 9]
    view = state.with_drafts([8])
    assert view.token_array().tolist() == [1, 2, 3, 4, 5, 9, 8] and state.token_array().tolist()[-1] == 9

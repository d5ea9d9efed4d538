"""Speculative decoding never changes a greedy result.

64 concurrent requests (the mixed prompts of test_engine_consistency, many of them repetitive so
that the n-gram proposer drafts a lot) run with speculation under chunked prefill, prefix caching
and a pool small enough to preempt, with two structured-output requests (their drafts cut to what
their grammar takes: test_spec_grammar.py) in the batch; every greedy request's tokens equal the
run without speculation. In fp32, and in bf16 with batch_invariant. (The scheduler's bookkeeping on
rejection: test_spec_scheduler.py.)
"""

from __future__ import annotations

import gc
import json

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.messages import CoreSamplingParams
from tokenmill.core.request import Request
from tokenmill.core.scheduler import Scheduler
from tokenmill.core.scheduler_output import ModelRunnerOutput
from tokenmill.errors import ConfigError
from tokenmill.structured_output.params import StructuredOutputsParams

from .test_engine_consistency import CONFIGS, _prompts

NGRAM = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
GREEDY = SamplingParams(temperature=0, max_tokens=32)
CHOICE = SamplingParams(temperature=0, max_tokens=8,
                        structured_outputs=StructuredOutputsParams(choice=["yes indeed", "no way"]))
BASE = dict(kv_cache_memory="128MiB", max_model_len=512, max_num_seqs=64)


def _run(llm, prompts):
    params = [CHOICE if i in (3, 40) else GREEDY for i in range(len(prompts))]
    return [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]


def _check_clean(llm):
    core = llm.engine.core
    assert core.kv.pool.num_free_blocks == core.kv.num_blocks  # nothing leaked
    assert not core.worker.runner.requests
    core.kv.pool.check_invariants()


@pytest.fixture(scope="module")
def reference_fp32():
    llm = LLM(dtype="float32", quantization="none", enable_prefix_caching=False, progress=False, **BASE)
    prompts = _prompts(llm.get_tokenizer())
    outs = _run(llm, prompts)
    del llm
    gc.collect()
    return prompts, outs


@pytest.mark.slow
@pytest.mark.parametrize("name", ["prefix-cache-on", "chunk-16", "tiny-pool"])
def test_ngram_greedy_identical_to_no_speculation(reference_fp32, name):
    # adaptive off: every step drafts, also beside prefill chunks (which the policy never drafts
    # next to), and the policy's timing cannot leave a run with no rejected draft
    prompts, ref = reference_fp32
    ngram = json.dumps({**json.loads(NGRAM), "adaptive": False})
    llm = LLM(dtype="float32", quantization="none", speculative_config=ngram, progress=False,
              **{**BASE, **CONFIGS[name]})
    outs = _run(llm, prompts)
    for i, (out, r) in enumerate(zip(outs, ref)):
        assert out.token_ids == r.token_ids, f"request {i} ({len(prompts[i])} prompt tokens)"
        assert out.finish_reason == r.finish_reason
    core = llm.engine.core
    spec = core.stats().spec_decoding
    assert spec is not None and spec.num_accepted_tokens > 0 and spec.num_draft_tokens > spec.num_accepted_tokens
    if name == "tiny-pool":
        assert core.scheduler.num_preemptions > 0
    if name == "prefix-cache-on":
        assert core.kv.prefix_hits > 0
    _check_clean(llm)
    del llm
    gc.collect()


@pytest.mark.slow
@pytest.mark.parametrize("proposer", ["ngram", "draft-int4"])
def test_greedy_identical_in_bf16_batch_invariant(proposer, smol_path):
    """Packed weights in bf16; the draft is SmolLM2 itself requantized to int4 at load (its Q8_0
    embedding and tied head to Q4_1: 576 columns are no multiple of 128)."""
    args = dict(dtype="bfloat16", batch_invariant=True, progress=False, **BASE, **CONFIGS["chunk-16"])
    llm = LLM(**args)
    prompts = _prompts(llm.get_tokenizer())[:24]
    ref = _run(llm, prompts)
    del llm
    spec = NGRAM if proposer == "ngram" else json.dumps(
        {"model": str(smol_path), "num_speculative_tokens": 3, "quantization": "int4", "draft_lookup_min": 0,
         "adaptive": False})
    llm = LLM(speculative_config=spec, **args)
    outs = _run(llm, prompts)
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref]
    stats = llm.engine.core.stats().spec_decoding
    # SmolLM2 drafting for itself agrees on nearly every token (401 of 408 measured; a draft whose int4
    # layers were left in the wrong layout: 0 of 554). The draft model drafts every step, not a lookup.
    assert stats.num_accepted_tokens > 0 and (proposer == "ngram" or stats.acceptance_rate > 0.5), stats
    _check_clean(llm)
    del llm
    gc.collect()


def test_abort_during_speculation_frees_everything(reference_fp32):
    prompts, ref = reference_fp32
    llm = LLM(dtype="float32", quantization="none", speculative_config=NGRAM, progress=False, **BASE)
    engine = llm.engine
    for i in range(8):
        engine.add_request(str(i), prompts[i], GREEDY)
    done = {}
    for step in range(200):
        if step == 6:
            engine.abort_request(["1", "4", "6"])
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0]
        if not engine.has_unfinished_requests():
            break
    assert set(done) - {"1", "4", "6"} == {"0", "2", "3", "5", "7"}
    for rid in ("0", "2", "5", "7"):
        assert done[rid].token_ids == ref[int(rid)].token_ids
    _check_clean(llm)


@pytest.mark.parametrize("bad, match", [
    ('{"method": "medusa", "num_speculative_tokens": 2}', "unknown method"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "positive"),
    ('{"method": "ngram"}', "num_speculative_tokens"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 3}',
     "prompt_lookup"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "foo": 1}', "unknown key"),
    ('{"method": "draft_model", "num_speculative_tokens": 2}', "needs a"),
    ('not json', "JSON"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "max_spec_factor": 0}', "max_spec_factor"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "max_spec_factor": "x"}', "max_spec_factor"),
    ('{"model": "x", "num_speculative_tokens": 2, "draft_p_min": 1.5}', "draft_p_min"),
    ('{"model": "x", "num_speculative_tokens": 2, "draft_vocab_size": 0}', "draft_vocab_size"),
    ('{"model": "x", "num_speculative_tokens": 2, "draft_vocab_size": "big"}', "draft_vocab_size"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "draft_vocab_size": 1024}', "draft_vocab_size"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "draft_p_min": 0.5}', "draft_p_min"),
    ('{"model": "x", "num_speculative_tokens": 2, "draft_lookup_min": -1}', "draft_lookup_min"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "draft_lookup_min": 4}', "draft_lookup_min"),
])
def test_bad_speculative_config_is_a_clear_error(bad, match):
    from tokenmill.config import EngineConfig

    with pytest.raises(ConfigError, match=match):
        EngineConfig.from_kwargs(speculative_config=bad)


@pytest.mark.parametrize("model", ["[ngram]", "ngram"])
def test_vllms_older_ngram_spelling_is_the_ngram_method(model):
    from tokenmill.config import EngineConfig

    spec = EngineConfig.from_kwargs(speculative_config={"model": model, "num_speculative_tokens": 3}).speculative
    assert (spec.method, spec.draft_model, spec.num_speculative_tokens) == ("ngram", None, 3)


@pytest.mark.slow
def test_draft_model_greedy_identical_to_no_speculation(reference_fp32, smol_path, tiny_llama_dir):
    """SmolLM2 drafting for itself (drafts mostly kept) and a random tiny Llama with the same
    vocabulary (drafts mostly rejected), with a pool small enough to preempt."""
    prompts, ref = reference_fp32
    for draft, kv_bytes, kept in ((str(smol_path), 46080, 0.5), (str(tiny_llama_dir), 3072, 0.0)):
        # the random model's guesses are all unlikely: draft_p_min 0 keeps them, to exercise rejection
        p_min = ', "draft_p_min": 0' if draft == str(tiny_llama_dir) else ""
        # adaptive off: at 32 requests the policy would not try a draft model (its tries are costly)
        spec = f'{{"model": "{draft}", "num_speculative_tokens": 3, "adaptive": false{p_min}}}'
        # 32 blocks: the smallest pool that holds max_model_len (once lookups drafted a looping output
        # far ahead, 45 blocks no longer preempted)
        args = {**BASE, **CONFIGS["tiny-pool"], "kv_cache_memory": 32 * 16 * (46080 + kv_bytes)}
        llm = LLM(dtype="float32", quantization="none", speculative_config=spec, progress=False, **args)
        outs = _run(llm, prompts[:32])
        assert [o.token_ids for o in outs] == [r.token_ids for r in ref[:32]], draft
        stats = llm.engine.core.stats().spec_decoding
        assert stats.num_draft_tokens > 0 and stats.acceptance_rate >= kept
        assert llm.engine.core.scheduler.num_preemptions > 0
        _check_clean(llm)
        del llm
        gc.collect()


@pytest.mark.slow
def test_draft_stops_after_its_first_unlikely_token(reference_fp32, tiny_llama_dir):
    """A random draft gives every token well under p_min 0.99: each proposal is the first pass's
    guess alone (proposed, then no more passes), and the output stays the target's."""
    prompts, ref = reference_fp32
    spec = (f'{{"model": "{tiny_llama_dir}", "num_speculative_tokens": 3, "draft_p_min": 0.99, "adaptive": false, '
            f'"draft_lookup_min": 0}}')
    llm = LLM(dtype="float32", quantization="none", speculative_config=spec, progress=False, **BASE)
    outs = _run(llm, prompts[:8])
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref[:8]]
    stats = llm.engine.core.stats().spec_decoding
    assert stats.num_drafts > 0 and stats.num_draft_tokens == stats.num_drafts
    _check_clean(llm)


@pytest.mark.slow
def test_a_draft_model_drafts_by_prompt_lookup_where_the_text_repeats(reference_fp32, tiny_llama_dir):
    """A random draft is almost never right; with lookup first, the repetitive prompts' matches draft
    instead, several tokens at a time, and are kept; the output stays the target's either way."""
    prompts, ref = reference_fp32
    kept = {}
    for lookup in (0, 4):
        spec = (f'{{"model": "{tiny_llama_dir}", "num_speculative_tokens": 3, "draft_p_min": 0.99, '
                f'"adaptive": false, "draft_lookup_min": {lookup}}}')
        llm = LLM(dtype="float32", quantization="none", speculative_config=spec, progress=False, **BASE)
        outs = _run(llm, prompts[:8])
        assert [o.token_ids for o in outs] == [r.token_ids for r in ref[:8]], lookup
        stats = llm.engine.core.stats().spec_decoding
        kept[lookup] = stats.num_accepted_tokens
        if lookup:  # lookup drafts run longer than the model's single guesses (p_min 0.99), up to 16
            assert stats.num_draft_tokens > stats.num_drafts
        _check_clean(llm)
        del llm
        gc.collect()
    assert kept[4] > 2 * kept[0] + 8, kept


def test_draft_with_another_vocabulary_is_refused():
    from tokenmill.model.loader import resolve_model

    try:
        resolve_model("qwen2.5-coder-0.5b")
    except ConfigError:
        pytest.skip("qwen2.5-coder-0.5b not installed (make install-qwen)")
    with pytest.raises(ConfigError, match="vocabulary"):
        LLM(speculative_config='{"model": "qwen2.5-coder-0.5b", "num_speculative_tokens": 2}', progress=False,
            kv_cache_memory="64MiB", max_model_len=256)


def test_draft_with_no_end_of_text_in_common_is_refused(tiny_llama_dir, tmp_path):
    """Same vocabulary size, but none of SmolLM2's end-of-text tokens: another tokenizer."""
    for f in tiny_llama_dir.iterdir():
        if f.name not in ("config.json", "generation_config.json"):
            (tmp_path / f.name).symlink_to(f)
    cfg = json.loads((tiny_llama_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "eos_token_id": 99}))
    spec = json.dumps({"model": str(tmp_path), "num_speculative_tokens": 2})
    with pytest.raises(ConfigError, match="vocabulary"):
        LLM(speculative_config=spec, progress=False, kv_cache_memory="64MiB", max_model_len=256)


def test_one_stream_hands_the_policys_draft_length_to_the_proposer_ahead():
    """With a draft model (lookahead slots) the policy's length is known before drafting: a request
    alone gets it as the proposer's most passes; with two running, drafts are not cut (None)."""
    from tokenmill.core.spec_policy import SpecPolicy

    policy = SpecPolicy()
    for _ in range(60):  # only the first draft is ever kept: a short length pays best
        n = policy.draft_length(1, 4)
        policy.observe(1, n > 0, (6 + 3 * n) / 1e3, 1 + min(n, 1), 1 + n, n)
    best = policy.draft_length(1, 4)
    assert best < 4
    kv = KVCacheManager(16, 4, enable_caching=False)
    sched = Scheduler(kv, max_num_batched_tokens=64, max_num_seqs=4, max_model_len=64, num_lookahead_slots=4,
                      spec_policy=policy)
    sched.add_request(Request("a", [1, 2, 3], CoreSamplingParams(temperature=0), [0], max_tokens=20, arrival_time=0))
    sched.update(sched.schedule(), ModelRunnerOutput({"a": [4]}))
    out = sched.schedule()  # "a" decodes alone
    assert out.propose_drafts and out.max_draft_passes == best
    sched.add_request(Request("b", [5, 6, 7], CoreSamplingParams(temperature=0), [0], max_tokens=20, arrival_time=1))
    sched.update(out, ModelRunnerOutput({"a": [8]}))
    sched.update(sched.schedule(), ModelRunnerOutput({"a": [9], "b": [10]}))  # b's prompt: nobody drafts
    out = sched.schedule()
    assert out.max_draft_passes is None


@pytest.mark.timeout(180)
def test_a_draft_model_runs_requests_to_max_model_len_in_a_pool_of_just_that(smol_path):
    """4 blocks of 16 tokens and max_model_len 64: requests that grow to max_model_len finish (they
    waited forever for the draft's lookahead slots past it), with the tokens of a run without speculation."""
    prompts = [list(range(1000, 1000 + n)) for n in (30, 63)]
    params = [SamplingParams(temperature=0, max_tokens=64 - len(p)) for p in prompts]
    args = dict(dtype="float32", quantization="none", max_model_len=64, enable_prefix_caching=False, progress=False)
    ref = LLM(**args)
    expected = [o.outputs[0].token_ids for o in ref.generate(prompts, params, use_tqdm=False)]
    del ref
    gc.collect()
    spec = f'{{"model": "{smol_path}", "num_speculative_tokens": 3, "adaptive": false}}'
    llm = LLM(speculative_config=spec, kv_cache_memory=4 * 16 * 2 * 46080, **args)
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outs == expected and [len(t) for t in outs] == [34, 1]
    assert llm.engine.core.stats().spec_decoding.num_accepted_tokens > 0
    _check_clean(llm)

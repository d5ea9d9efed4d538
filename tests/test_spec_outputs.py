"""What a speculating request hands out equals what it would without speculation, beyond greedy
tokens: seeded samples (verification draws as the plain sampler does), the output of a request
whose stop string is met inside a step's accepted tokens, and greedy requests whose logits
processors read the output so far (penalties, min_tokens) or that ask for logprobs."""

from __future__ import annotations

import gc

import pytest

from tokenmill import LLM, SamplingParams

from .test_spec_decode import NGRAM, _check_clean


def test_seeded_sampling_draws_the_tokens_of_no_speculation_in_any_batch(smol_path):
    """Verification draws one uniform per output token, as the plain sampler (rejection_sampler.py):
    a seeded request's tokens are those decoded without speculation, alone, in a batch, and when a
    short pool drops its drafts or preempts it. batch_invariant: the same logits either way."""
    prompt = "one two three one two three one two three one two"
    seeded = SamplingParams(temperature=0.8, top_p=0.95, seed=7, max_tokens=60)
    args = dict(batch_invariant=True, max_model_len=128, progress=False)
    plain = LLM(**args)
    want = plain.generate([prompt], seeded, use_tqdm=False)[0].outputs[0].token_ids
    per_token = plain.engine.core.worker.kv_bytes_per_token  # fp32 or bf16, as this CPU runs
    del plain
    gc.collect()
    # 8 blocks of 16 tokens for three requests of up to 75 tokens: drafts dropped, requests preempted
    llm = LLM(speculative_config=NGRAM, kv_cache_memory=per_token * 16 * 8, max_num_batched_tokens=64, **args)
    assert llm.generate([prompt], seeded, use_tqdm=False)[0].outputs[0].token_ids == want
    greedy = SamplingParams(temperature=0, max_tokens=60)
    batch = llm.generate([prompt, "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,", "a b a b a b a b"], [seeded, greedy, greedy],
                         use_tqdm=False)
    assert batch[0].outputs[0].token_ids == want
    assert llm.engine.core.scheduler.num_preemptions > 0
    assert llm.engine.core.stats().spec_decoding.num_accepted_tokens > 0
    _check_clean(llm)


def test_a_stop_string_completed_mid_step_drops_the_steps_later_tokens():
    """n-gram accepts several tokens a step; a stop string completed by one of them ends the output
    there: token ids, logprobs and usage as without speculation."""
    prompt = "The quick brown fox jumps over the lazy dog. " * 2 + "The quick brown fox"
    args = dict(batch_invariant=True, max_model_len=256, progress=False)
    params = [SamplingParams(temperature=0, max_tokens=60, stop=[s], logprobs=0) for s in (" brown", "uick")]
    plain = LLM(**args)
    want = [o.outputs[0] for o in plain.generate([prompt] * 2, params, use_tqdm=False)]
    del plain
    gc.collect()
    # drafting at every step (no policy): the text repeats, so most steps accept several tokens
    spec = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1, ' \
           '"adaptive": false}'
    llm = LLM(speculative_config=spec, **args)
    got = [o.outputs[0] for o in llm.generate([prompt] * 2, params, use_tqdm=False)]
    assert llm.engine.core.stats().spec_decoding.num_accepted_tokens > 0
    for g, w in zip(got, want):
        assert (g.text, g.finish_reason, g.stop_reason) == (w.text, "stop", w.stop_reason)
        assert g.token_ids == w.token_ids and len(g.logprobs) == len(w.token_ids)
        assert [lp[t].logprob for lp, t in zip(g.logprobs, g.token_ids)] == \
            [lp[t].logprob for lp, t in zip(w.logprobs, w.token_ids)]
    _check_clean(llm)


def _feature_requests(tok) -> tuple[list[str], list[SamplingParams]]:
    """Greedy requests on repetitive prompts (so that drafts are taken), each with something a
    verification applies per position: penalties over the output up to it, min_tokens counting it
    (its stop ids banned until then), a bias, stop ids ending the output mid-step, and logprobs of
    prompt and output."""
    ids = tok.encode(" two three fox", add_special_tokens=False)
    kinds = [dict(repetition_penalty=1.3), dict(presence_penalty=1.0), dict(frequency_penalty=0.7),
             dict(frequency_penalty=-0.5, presence_penalty=0.5, repetition_penalty=0.9),
             dict(logit_bias={ids[0]: -100.0, ids[1]: 4.0}), dict(min_tokens=12, stop_token_ids=[ids[0]]),
             dict(stop_token_ids=[ids[1]]), dict(logprobs=3, prompt_logprobs=2), dict(n=2, logprobs=0),
             dict(min_tokens=30, repetition_penalty=1.2, logprobs=1)]
    texts = ["one two three one two three one two three one", "The quick brown fox jumps over the lazy dog. " * 3,
             "def add(a, b):\n    return a + b\n\n" * 3, "1, 2, 3, 1, 2, 3, 1, 2, 3, 1, 2,"]
    prompts, params = [], []
    for i, kind in enumerate(kinds * 2):
        prompts.append(texts[i % len(texts)])
        params.append(SamplingParams(temperature=0, max_tokens=40, **kind))
    return prompts, params


def _outputs(llm, prompts, params) -> list:
    return [(o.prompt_logprobs, [(c.token_ids, c.text, c.finish_reason, c.logprobs) for c in o.outputs])
            for o in llm.generate(prompts, params, use_tqdm=False)]


def _same_logprobs(got, want) -> bool:
    if got is None or want is None:
        return got is want
    return len(got) == len(want) and all(
        (g is None and w is None) or (g.keys() == w.keys() and all(abs(g[t].logprob - w[t].logprob) < 1e-4 for t in g))
        for g, w in zip(got, want))


@pytest.mark.slow
def test_penalties_bias_min_tokens_and_logprobs_are_those_of_no_speculation():
    """Every drafted position is verified with the logits processors' view of the output up to it
    (penalties, min_tokens, bias): with n-gram and with a draft model, under chunked prefill, prefix
    caching and a pool that preempts, each request's tokens, text, finish reason and logprobs (of
    its output and its prompt) equal the run without speculation. fp32: the same logits either way."""
    args = dict(dtype="float32", quantization="none", max_model_len=256, max_num_seqs=32, progress=False)
    plain = LLM(**args)
    prompts, params = _feature_requests(plain.get_tokenizer())
    want = _outputs(plain, prompts, params)
    per_token = plain.engine.core.worker.kv_bytes_per_token
    del plain
    gc.collect()
    ngram = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "adaptive": false}'
    draft = '{"model": "smollm2-135m", "num_speculative_tokens": 3, "adaptive": false, "draft_p_min": 0}'
    for spec, blocks in ((ngram, 20), (draft, 40)):  # a draft model's cache is in the same budget
        llm = LLM(speculative_config=spec, kv_cache_memory=per_token * 16 * blocks, max_num_batched_tokens=48,
                  enable_prefix_caching=True, **args)
        got = _outputs(llm, prompts, params)
        for i, ((got_prompt, got_choices), (want_prompt, want_choices)) in enumerate(zip(got, want)):
            assert _same_logprobs(got_prompt, want_prompt), f"request {i} ({params[i]}): prompt logprobs"
            assert len(got_choices) == len(want_choices)
            for (gt, gx, gf, gl), (wt, wx, wf, wl) in zip(got_choices, want_choices):
                assert (gt, gx, gf) == (wt, wx, wf), f"request {i} ({params[i]})"
                assert _same_logprobs(gl, wl), f"request {i} ({params[i]}): logprobs"
        core = llm.engine.core
        assert core.stats().spec_decoding.num_accepted_tokens > 0
        assert core.scheduler.num_preemptions > 0
        _check_clean(llm)
        del llm
        gc.collect()

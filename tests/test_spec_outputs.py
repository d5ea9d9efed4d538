"""What a speculating request hands out equals what it would without speculation, beyond greedy
tokens: seeded samples (verification draws as the plain sampler does) and the output of a request
whose stop string is met inside a step's accepted tokens."""

from __future__ import annotations

import gc

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

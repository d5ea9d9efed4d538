"""Every sampling parameter has its documented effect on the real model, and bad values fail
with an error naming the parameter."""

from __future__ import annotations

import math

import pytest

from tokenmill import SamplingParams
from tokenmill.errors import InvalidRequestError

STORY = "Once upon a time, there was a little girl named"
CHAT = ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nHello! who are you?<|im_end|>\n<|im_start|>assistant\n")


def gen(llm, prompt, **kw):
    outs = llm.generate([prompt], SamplingParams(**kw), use_tqdm=False)
    return outs[0]


def texts(llm, prompt, n_seeds=6, **kw):
    return [gen(llm, prompt, seed=s, **kw).outputs[0].text for s in range(n_seeds)]


def test_greedy_is_deterministic_and_ignores_other_knobs(smol_bf16):
    a = gen(smol_bf16, STORY, temperature=0, max_tokens=24).outputs[0]
    b = gen(smol_bf16, STORY, temperature=0, max_tokens=24, top_p=0.5, top_k=3, seed=7).outputs[0]
    assert a.token_ids == b.token_ids and len(a.token_ids) == 24


def test_temperature_controls_diversity(smol_bf16):
    cold = texts(smol_bf16, STORY, temperature=0.05, max_tokens=12)
    hot = texts(smol_bf16, STORY, temperature=1.5, max_tokens=12)
    assert len(set(hot)) > len(set(cold))
    assert len(set(hot)) >= 5


@pytest.mark.parametrize("knob", [dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)])
def test_truncation_to_one_token_equals_greedy(smol_fp32, knob):
    # fp32: bf16 logits tie often enough (one ulp is 0.125 at 16-32) that top_k=1 keeps two tokens
    greedy = gen(smol_fp32, STORY, temperature=0, max_tokens=16).outputs[0].token_ids
    for seed in range(3):
        out = gen(smol_fp32, STORY, temperature=1.0, max_tokens=16, seed=seed, **knob).outputs[0].token_ids
        assert out == greedy


@pytest.mark.parametrize("knob", [dict(top_k=5), dict(top_p=0.5), dict(min_p=0.3)])
def test_truncation_reduces_diversity(smol_bf16, knob):
    def first_tokens(**kw):
        return {gen(smol_bf16, STORY, temperature=1.5, max_tokens=1, seed=s, **kw).outputs[0].token_ids[0]
                for s in range(16)}

    free, cut = first_tokens(), first_tokens(**knob)
    assert len(cut) < len(free)
    if "top_k" in knob:
        assert len(cut) <= knob["top_k"]


def test_top_k_keeps_sampled_tokens_in_the_top_k(smol_bf16):
    for seed in range(3):
        out = gen(smol_bf16, STORY, temperature=2.0, top_k=3, max_tokens=12, seed=seed, logprobs=3).outputs[0]
        assert all(pos[t].rank <= 3 for t, pos in zip(out.token_ids, out.logprobs))


def _repeats(token_ids):
    return len(token_ids) - len(set(token_ids))


REPEAT = "apple banana apple banana apple banana apple banana"


def test_repetition_penalty_reduces_repeats(smol_bf16):
    plain = gen(smol_bf16, REPEAT, temperature=0, max_tokens=24).outputs[0].token_ids
    penalized = gen(smol_bf16, REPEAT, temperature=0, max_tokens=24, repetition_penalty=1.8).outputs[0].token_ids
    assert _repeats(penalized) < _repeats(plain)


@pytest.mark.parametrize("knob", ["presence_penalty", "frequency_penalty"])
def test_presence_and_frequency_penalties_reduce_repeats(smol_bf16, knob):
    plain = gen(smol_bf16, REPEAT, temperature=0, max_tokens=32).outputs[0].token_ids
    penalized = gen(smol_bf16, REPEAT, temperature=0, max_tokens=32, **{knob: 2.0}).outputs[0].token_ids
    assert _repeats(penalized) < _repeats(plain)
    # a negative penalty encourages repeats
    eager = gen(smol_bf16, STORY, temperature=0, max_tokens=32, **{knob: -2.0}).outputs[0].token_ids
    assert _repeats(eager) >= _repeats(gen(smol_bf16, STORY, temperature=0, max_tokens=32).outputs[0].token_ids)


def test_logit_bias(smol_bf16):
    tok = smol_bf16.get_tokenizer()
    forced = tok.encode(" zebra", add_special_tokens=False)[0]
    out = gen(smol_bf16, STORY, temperature=0, max_tokens=4, logit_bias={forced: 100}).outputs[0]
    assert out.token_ids == [forced] * 4
    greedy = gen(smol_bf16, STORY, temperature=0, max_tokens=1).outputs[0].token_ids[0]
    banned = gen(smol_bf16, STORY, temperature=0, max_tokens=1, logit_bias={greedy: -100}).outputs[0]
    assert banned.token_ids[0] != greedy


def test_seed_reproducible_and_independent_of_batch(smol_fp32):
    # fp32: in bf16 the batch shape moves logits by a few ulps, enough to move a sample at a boundary
    p = SamplingParams(temperature=1.0, max_tokens=20, seed=1234)
    alone = smol_fp32.generate([STORY], p, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=0.8, max_tokens=30 + i, seed=None) for i in range(5)]
    prompts = ["Hello there", STORY, "def f(x):", "Paris is", "A B C D"]
    batch = smol_fp32.generate(prompts + [STORY], others + [p], use_tqdm=False)
    assert batch[-1].outputs[0].token_ids == alone
    assert smol_fp32.generate([STORY], p, use_tqdm=False)[0].outputs[0].token_ids == alone
    other_seed = gen(smol_fp32, STORY, temperature=1.0, max_tokens=20, seed=4321).outputs[0].token_ids
    assert other_seed != alone


def test_max_tokens_min_tokens_and_ignore_eos(smol_fp32):
    # fp32: in bf16 the greedy text depends on the batches and prefix-cache hits earlier tests left
    # (a CI run's CHAT answer ran past 200 tokens), and this test needs one that ends on its own
    short = gen(smol_fp32, CHAT, temperature=0, max_tokens=200).outputs[0]
    assert short.finish_reason == "stop" and len(short.token_ids) < 200  # the model ends on its own
    forced = gen(smol_fp32, CHAT, temperature=0, max_tokens=200, min_tokens=len(short.token_ids) + 10).outputs[0]
    assert len(forced.token_ids) >= len(short.token_ids) + 10
    long = gen(smol_fp32, CHAT, temperature=0, max_tokens=40, ignore_eos=True).outputs[0]
    assert len(long.token_ids) == 40 and long.finish_reason == "length"


def test_stop_string_across_token_boundaries(smol_bf16):
    full = gen(smol_bf16, STORY, temperature=0, max_tokens=32).outputs[0]
    tok = smol_bf16.get_tokenizer()
    pieces = [tok.decode([t]) for t in full.token_ids]
    # a stop string that starts inside one token and ends inside a later one
    start = len(pieces[0]) + len(pieces[1]) + 1
    stop = full.text[start:start + len(pieces[2]) + 2]
    assert len(stop) >= 3
    cut = gen(smol_bf16, STORY, temperature=0, max_tokens=32, stop=[stop]).outputs[0]
    assert cut.text == full.text[:full.text.index(stop)]
    assert cut.finish_reason == "stop" and cut.stop_reason == stop
    kept = gen(smol_bf16, STORY, temperature=0, max_tokens=32, stop=[stop], include_stop_str_in_output=True).outputs[0]
    assert kept.text == full.text[:full.text.index(stop) + len(stop)]


def test_stop_token_ids(smol_bf16):
    full = gen(smol_bf16, STORY, temperature=0, max_tokens=20).outputs[0]
    stop_tok = full.token_ids[5]
    first = full.token_ids.index(stop_tok)
    out = gen(smol_bf16, STORY, temperature=0, max_tokens=20, stop_token_ids=[stop_tok]).outputs[0]
    assert out.token_ids == full.token_ids[:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_tok
    assert out.text == smol_bf16.get_tokenizer().decode(full.token_ids[:first])


def test_n_samples(smol_bf16):
    out = gen(smol_bf16, STORY, n=4, temperature=1.2, max_tokens=12, seed=3)
    assert [o.index for o in out.outputs] == [0, 1, 2, 3]
    assert len({o.text for o in out.outputs}) >= 3
    again = gen(smol_bf16, STORY, n=4, temperature=1.2, max_tokens=12, seed=3)
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in out.outputs]


def test_logprobs_are_consistent_with_prompt_logprobs(smol_fp32):
    out = gen(smol_fp32, STORY, temperature=0, max_tokens=8, logprobs=3).outputs[0]
    assert len(out.logprobs) == 8
    for tok, pos in zip(out.token_ids, out.logprobs):
        assert pos[tok].rank == 1  # greedy picks the top token
        assert len(pos) == 3 and all(lp.logprob <= 0 for lp in pos.values())
        ranks = sorted(lp.rank for lp in pos.values())
        assert ranks == [1, 2, 3]
    assert out.cumulative_logprob == pytest.approx(sum(p[t].logprob for t, p in zip(out.token_ids, out.logprobs)))
    # teacher forcing the same tokens scores them the same
    ids = smol_fp32.get_tokenizer().encode(STORY) + out.token_ids
    scored = smol_fp32.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)[0]
    n = len(ids) - 8
    for j, (tok, pos) in enumerate(zip(out.token_ids, out.logprobs)):
        assert scored.prompt_logprobs[n + j][tok].logprob == pytest.approx(pos[tok].logprob, abs=1e-4)


def test_sampled_logprob_and_rank_under_sampling(smol_bf16):
    out = gen(smol_bf16, STORY, temperature=1.5, max_tokens=16, logprobs=0, seed=5).outputs[0]
    for tok, pos in zip(out.token_ids, out.logprobs):
        assert list(pos) == [tok] and pos[tok].rank >= 1 and math.isfinite(pos[tok].logprob)


@pytest.mark.parametrize("kwargs,param", [
    (dict(n=0), "n"), (dict(temperature=-0.1), "temperature"), (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"), (dict(top_k=-2), "top_k"), (dict(top_k=1.5), "top_k"),
    (dict(min_p=1.1), "min_p"), (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-3), "frequency_penalty"), (dict(repetition_penalty=0), "repetition_penalty"),
    (dict(seed="x"), "seed"), (dict(max_tokens=0), "max_tokens"), (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"), (dict(logprobs=-1), "logprobs"),
    (dict(prompt_logprobs=-1), "prompt_logprobs"), (dict(stop=[""]), "stop"),
    (dict(stop_token_ids=[-1]), "stop_token_ids"), (dict(logit_bias={1: 200}), "logit_bias"),
    (dict(logit_bias={"x": 1}), "logit_bias"), (dict(temperature="hot"), "temperature"),
])
def test_invalid_params_name_the_parameter(kwargs, param):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param and param in str(e.value)


@pytest.mark.parametrize("kwargs,param", [
    (dict(logit_bias={10**7: 1}), "logit_bias"), (dict(stop_token_ids=[10**7]), "stop_token_ids"),
    (dict(logprobs=100), "logprobs"), (dict(prompt_logprobs=100), "prompt_logprobs"),
])
def test_params_checked_against_the_model(smol_bf16, kwargs, param):
    with pytest.raises(InvalidRequestError) as e:
        smol_bf16.generate([STORY], SamplingParams(**kwargs), use_tqdm=False)
    assert e.value.param == param
    assert not smol_bf16.engine.has_unfinished_requests()


def test_prompt_too_long_is_rejected(smol_bf16):
    limit = smol_bf16.engine.max_model_len
    with pytest.raises(InvalidRequestError, match=str(limit)):
        smol_bf16.generate([[100] * (limit - 10)], SamplingParams(max_tokens=20), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="empty"):
        smol_bf16.generate([[]], SamplingParams(), use_tqdm=False)


def test_skip_special_tokens(smol_fp32):
    # ignore_eos lets the model run past <|im_end|>, which then appears in the text only when asked
    # (fp32: the second run hits the prefix cache, and in bf16 that may move a near-tie)
    kw = dict(temperature=0, max_tokens=60, ignore_eos=True)
    raw = gen(smol_fp32, CHAT, skip_special_tokens=False, **kw).outputs[0]
    clean = gen(smol_fp32, CHAT, **kw).outputs[0]
    assert raw.token_ids == clean.token_ids and 2 in raw.token_ids  # 2 = <|im_end|>
    assert "<|im_end|>" in raw.text and "<|im_end|>" not in clean.text


@pytest.mark.parametrize("native", [False, True], ids=["torch-ops", "cpu-kernel"])
@pytest.mark.parametrize("width", [7, 2048, 4096, 49152, 151936, 4096 * 3 + 5])
def test_first_argmax_is_torch_argmax(width, native, monkeypatch):
    """The sampler's greedy pick (chunked for speed, in torch ops or in one C++ op once the CPU
    kernels are loaded) is each row's first maximum, ties included."""
    import torch

    from tokenmill.model.kernels import load_cpu_kernels
    from tokenmill.worker import sampler
    from tokenmill.worker.sampler import first_argmax

    if native and not load_cpu_kernels():
        pytest.skip("no C++ toolchain")
    monkeypatch.setattr(sampler, "cpu_kernels_loaded", lambda: native)

    g = torch.Generator().manual_seed(width)
    rows = [torch.randn(width, generator=g),
            torch.randint(0, 3, (width,), generator=g).float(),  # many ties of the maximum
            torch.zeros(width),  # all tied: index 0
            torch.full((width,), float("-inf"))]
    last = torch.full((width,), -5.0)
    last[-1] = 4.0  # the maximum in the last position (the tail past the chunks)
    ties = torch.randn(width, generator=g)
    ties[[width // 3, width - 1]] = 9.0  # the first of two equal maxima
    x = torch.stack(rows + [last, ties])
    assert torch.equal(first_argmax(x), torch.argmax(x, dim=-1))
    assert first_argmax(x)[2] == 0 and first_argmax(x)[4] == width - 1 and first_argmax(x)[5] == width // 3


def test_a_processor_edits_only_the_rows_it_says_it_acts_on():
    """Plain greedy rows skip the processors (Sampler.plain_greedy): a processor whose acts_on says
    no must leave the row alone, at its draft positions too (a view with more output)."""
    import torch

    from tokenmill.core.messages import CoreSamplingParams
    from tokenmill.worker.logits_processors import default_processors
    from tokenmill.worker.request_state import RequestState

    def state(output, **params):
        return RequestState("r", [3, 4] + output, 2, CoreSamplingParams(**params), None, [], 0, list(output), [0, 1])

    states = [state([]), state([5]), state([5, 5], temperature=0.0), state([5], logit_bias={6: 2.0}),
              state([5], min_tokens=1), state([5], min_tokens=2), state([5], min_tokens=3),
              state([], min_tokens=2),
              state([5], repetition_penalty=1.2), state([5], presence_penalty=0.5), state([5], frequency_penalty=0.5)]
    acted = set()
    for processor in default_processors():
        for s in states:
            for view in (s, s.with_drafts([7, 8])):
                logits = torch.randn(1, 16)
                before = logits.clone()
                processor(logits, [view])
                if not processor.acts_on(s):
                    assert torch.equal(logits, before), (type(processor).__name__, s.params, view.output_token_ids)
                elif not torch.equal(logits, before):
                    acted.add(type(processor).__name__)
    assert acted == {"LogitBias", "MinTokens", "RepetitionPenalty", "PresenceFrequencyPenalty"}

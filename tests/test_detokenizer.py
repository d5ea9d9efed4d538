"""Incremental detokenization: streaming-safe UTF-8, text equal to the full decode, stop strings
that span tokens, held-back text while a stop string may still be forming."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from tokenmill import RequestOutputKind, SamplingParams
from tokenmill.engine.detokenizer import IncrementalDetokenizer, TextOffsets

TEXTS = ["héllo wörld — naïve café", "日本語のテキストと中文字符", "emoji 😀🎉👩‍👩‍👧 mixed ✓ text",
         "code: def f(x):\n    return x ** 2  # ✓", "Ελληνικά και русский текст"]


@pytest.fixture(scope="module")
def tok(smol_tokenizer_dir):
    return AutoTokenizer.from_pretrained(str(smol_tokenizer_dir))


@pytest.mark.parametrize("text", TEXTS)
def test_streaming_never_breaks_characters(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.split())  # multi-byte characters really are split across tokens
    detok = IncrementalDetokenizer(tok.backend_tokenizer, [1], SamplingParams())
    deltas = []
    for t in ids:
        detok.update([t])
        deltas.append(detok.delta(False))
    deltas.append(detok.delta(True))
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tok.decode(ids) == text


def test_stop_string_spanning_tokens_is_held_back_then_cut(tok):
    text = "The answer is forty-two. Done."
    ids = tok.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tok.backend_tokenizer, [1], SamplingParams(stop=["y-tw"]))
    streamed, stop = "", None
    for t in ids:
        stop, _ = detok.update([t])
        streamed += detok.delta(stop is not None)
        if stop:
            break
    assert stop == "y-tw"
    assert streamed == "The answer is fort"
    assert "y-t" not in streamed


def test_a_stop_string_mid_step_ends_the_output_at_its_token(tok):
    """Several tokens in one update (a speculative step): those after the token that completes the
    stop string are not output."""
    ids = tok.encode("The answer is forty-two. Done.", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok.backend_tokenizer, [1], SamplingParams(stop=["y-tw"]))
    stop, used = detok.update(ids)
    assert stop == "y-tw" and detok.text == "The answer is fort"
    assert tok.decode(ids[:used]).startswith("The answer is forty-tw")
    assert "y-tw" not in tok.decode(ids[:used - 1])
    assert detok.update(ids[:3]) == (None, 3)  # no stop string: every token


def test_text_offsets_index_the_text(tok):
    """Legacy logprobs' text_offset: an emoji's pieces count once; a special token the tokenizer added
    (not in the text, as a BOS) takes no room; one the text holds does."""
    text = "<|im_start|>hi \U0001F600 ok"
    ids = [tok.convert_tokens_to_ids("<|endoftext|>")] + tok.encode(text, add_special_tokens=False)
    offsets = TextOffsets(tok.backend_tokenizer, [], skip_special_tokens=False, text=text)
    at = [offsets.next(t) for t in ids]
    assert at[:3] == [0, 0, len("<|im_start|>")] and at[-1] == text.index(" ok") and offsets.offset == len(text)


def test_engine_stream_deltas_concatenate_to_final_text(smol_bf16):
    engine = smol_bf16.engine
    prompt = "Translate to Japanese and Chinese, with emoji: Good morning, my friend!"
    engine.add_request("utf8", prompt, SamplingParams(temperature=0.8, seed=1, max_tokens=48,
                                                      output_kind=RequestOutputKind.DELTA))
    deltas, tokens = [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas.append(out.outputs[0].text)
            tokens += out.outputs[0].token_ids
    joined = "".join(deltas)
    assert joined == smol_bf16.get_tokenizer().decode(tokens, skip_special_tokens=True)
    # a broken character can only appear where the model itself produced invalid UTF-8
    assert joined.count("\ufffd") == smol_bf16.get_tokenizer().decode(tokens).count("\ufffd")


@pytest.mark.parametrize("n", [1, 2])
def test_stream_interval_gathers_tokens_and_loses_none(smol_bf16, n):
    """--stream-interval 4: the first token at once, then chunks of 4 tokens (one per step here),
    the rest with the end; the same tokens and text as streaming every token."""
    engine = smol_bf16.engine

    def stream(interval):
        engine.output_processor.stream_interval = interval
        try:
            engine.add_request(f"si{interval}-{n}", "Write a short poem about the sea.",
                               SamplingParams(temperature=0.8, seed=3, max_tokens=23, n=n, stop=["zq!"],
                                              ignore_eos=True, output_kind=RequestOutputKind.DELTA))
            chunks: dict[int, list] = {i: [] for i in range(n)}
            while engine.has_unfinished_requests():
                for out in engine.step():
                    for o in out.outputs:
                        chunks[o.index].append((o.text, list(o.token_ids), o.finish_reason))
            return chunks
        finally:
            engine.output_processor.stream_interval = 1

    every, gathered = stream(1), stream(4)
    for i in range(n):
        assert [len(c[1]) for c in every[i]] == [1] * 23
        sizes = [len(c[1]) for c in gathered[i]]
        assert sizes[0] == 1 and all(s == 4 for s in sizes[1:-1]) and sizes[-1] <= 4, sizes
        assert sum(sizes) == 23 and gathered[i][-1][2] == "length"
        assert "".join(c[0] for c in gathered[i]) == "".join(c[0] for c in every[i])
        assert sum((c[1] for c in gathered[i]), []) == sum((c[1] for c in every[i]), [])

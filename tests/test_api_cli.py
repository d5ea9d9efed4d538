"""The offline API (`LLM.generate`, `LLM.chat`), model resolution and the CLI."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tokenmill import LLM, EngineConfig, SamplingParams
from tokenmill.config import parse_size
from tokenmill.errors import ConfigError, InvalidRequestError
from tokenmill.model.loader import resolve_model


def test_generate_returns_outputs_in_order_with_timings(smol_bf16):
    prompts = ["The capital of France is", [1, 504, 3458, 282], "Water boils at"]
    outs = smol_bf16.generate(prompts, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    assert [o.request_id for o in outs] == sorted((o.request_id for o in outs), key=int)
    assert outs[1].prompt_token_ids == [1, 504, 3458, 282] and outs[1].prompt is None
    for o in outs:
        c = o.outputs[0]
        assert o.finished and c.finish_reason in ("stop", "length") and c.text
        assert c.text == smol_bf16.get_tokenizer().decode(c.token_ids, skip_special_tokens=True)
        m = o.metrics
        assert m.arrival_time <= m.first_scheduled_time <= m.first_token_time <= m.finished_time
        assert m.ttft > 0 and m.e2e_latency >= m.ttft


def test_chat_uses_the_template(smol_bf16):
    out = smol_bf16.chat([{"role": "user", "content": "What is 2+2? Answer with a number."}],
                         SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0]
    tok = smol_bf16.get_tokenizer()
    assert tok.decode(out.prompt_token_ids).startswith("<|im_start|>system")
    assert "4" in out.outputs[0].text and out.outputs[0].finish_reason == "stop"
    # content given as OpenAI text parts renders the same prompt
    parts = smol_bf16.chat([{"role": "user", "content": [{"type": "text", "text": "What is 2+2? "},
                                                          {"type": "text", "text": "Answer with a number."}]}],
                           SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0]
    assert parts.prompt_token_ids == out.prompt_token_ids


def test_engine_config_validation():
    with pytest.raises(ConfigError, match="max_num_seqs"):
        EngineConfig.from_kwargs(max_num_seqs=0)
    with pytest.raises(ConfigError, match="block_size"):
        EngineConfig.from_kwargs(block_size=12)
    with pytest.raises(ConfigError, match="dtype"):
        EngineConfig.from_kwargs(dtype="int3")
    with pytest.raises(ConfigError, match="not both"):
        EngineConfig.from_kwargs(kv_cache_memory="1GiB", memory_utilization=0.5)
    with pytest.raises(ConfigError, match="unknown engine argument"):
        EngineConfig.from_kwargs(max_num_seq=4)
    assert EngineConfig.from_kwargs(kv_cache_memory="48MiB").cache.kv_cache_memory == 48 * 2**20
    assert parse_size("4GiB") == 4 * 2**30 and parse_size("2GB") == 2 * 10**9 and parse_size(1024) == 1024
    with pytest.raises(ConfigError):
        parse_size("lots")


def test_kv_budget_too_small_for_max_model_len():
    with pytest.raises(ConfigError, match="max_model_len"):
        LLM(kv_cache_memory="1MiB", max_model_len=4096, progress=False)


def test_model_resolution(tiny_llama_dir, tmp_path):
    assert resolve_model(None).path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert resolve_model("smollm2-135m").kind == "gguf"
    assert resolve_model(str(tiny_llama_dir)).kind == "hf"
    with pytest.raises(ConfigError, match="not found"):
        resolve_model(str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match="config.json"):
        resolve_model(str(tmp_path))


def _cli(*args, env=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "tokenmill.entrypoints.cli.main", *args], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


def test_cli_generate_streams_the_greedy_completion(smol_bf16):
    expected = smol_bf16.generate(["The three primary colors are"], SamplingParams(temperature=0, max_tokens=20),
                                  use_tqdm=False)[0].outputs[0].text
    # the fixture's weights (dequantized to bf16): the GGUF's own types are another model's numerics
    r = _cli("generate", "--temperature", "0", "--max-tokens", "20", "--dtype", "bfloat16", "--quantization", "none",
             "--kv-cache-memory", "64MiB", "--max-model-len", "1024", "The three primary colors are")
    assert r.returncode == 0, r.stderr
    assert r.stdout.rstrip("\n") == expected


def test_cli_chat_session():
    # "What is the capital of France?" alone is a coin toss for SmolLM2's first token ("The" over "L"
    # by 0.03-0.14 nats, flipped by the activation codes); with "Answer in one word." by ~1.4 nats
    r = subprocess.run([sys.executable, "-m", "tokenmill.entrypoints.cli.main", "chat", "--temperature", "0",
                        "--max-tokens", "40", "--kv-cache-memory", "64MiB", "--max-model-len", "1024"],
                       input="What is the capital of France? Answer in one word.\n/exit\n", capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


def test_cli_flags_from_environment_and_errors():
    r = _cli("generate", "--help", env={"TOKENMILL_MAX_NUM_SEQS": "7"})
    assert r.returncode == 0 and "TOKENMILL_MAX_NUM_SEQS" in r.stdout and "default: 7" in r.stdout
    r = _cli("generate", "--help", env={"TOKENMILL_MAX_NUM_SEQS": "many"})
    assert r.returncode == 2 and "TOKENMILL_MAX_NUM_SEQS" in r.stderr
    r = _cli("generate", "--model", "/no/such/model", "hi")
    assert r.returncode == 1 and "not found" in r.stderr


def test_chat_template_override(tmp_path, tiny_llama_dir):
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant] "
    path = tmp_path / "template.jinja"
    path.write_text(template)
    for given in (template, str(path)):
        llm = LLM(str(tiny_llama_dir), chat_template=given, kv_cache_memory="32MiB", progress=False)
        out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=1), use_tqdm=False)[0]
        assert llm.get_tokenizer().decode(out.prompt_token_ids) == "[user] hi\n[assistant] "
    with pytest.raises(ConfigError, match="chat template"):
        LLM(str(tiny_llama_dir), chat_template="/no/such/file.jinja", kv_cache_memory="32MiB", progress=False)


@pytest.mark.parametrize("command", [["serve"], ["generate"], ["chat"], ["bench", "throughput"], ["bench", "serve"],
                                     ["calibrate"], ["estimate"], ["simulate"]])
def test_every_command_has_help(command):
    r = _cli(*command, "--help")
    assert r.returncode == 0 and "usage: tokenmill" in r.stdout, r.stderr


def test_a_bad_prompt_in_a_batch_submits_nothing(smol_bf16):
    with pytest.raises(InvalidRequestError):
        smol_bf16.generate(["fine", "also fine", [10**9]], SamplingParams(max_tokens=2), use_tqdm=False)
    assert not smol_bf16.engine.has_unfinished_requests()

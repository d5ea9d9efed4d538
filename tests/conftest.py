"""Shared fixtures: the embedded SmolLM2 (tokenmill and Hugging Face), tiny random Llama/Qwen2
folders, and a private cache directory per test session."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

# Keep Hugging Face offline and quiet: weights come from local files only.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SMALL_KV = dict(kv_cache_memory="256MiB", max_model_len=2048)


@pytest.fixture(scope="session")
def smol_path():
    from tokenmill.model.loader import resolve_model

    return resolve_model(None).path


@pytest.fixture(scope="session")
def smol_fp32():
    """The GGUF dequantized at load (quantization="none"): the weights Hugging Face computes with."""
    from tokenmill import LLM

    return LLM(dtype="float32", quantization="none", progress=False, **SMALL_KV)


@pytest.fixture(scope="session")
def smol_bf16():
    from tokenmill import LLM

    return LLM(dtype="bfloat16", quantization="none", progress=False, **SMALL_KV)


@pytest.fixture(scope="session")
def smol_gguf():
    """The GGUF in its own types (the default for a .gguf), bf16 activations."""
    from tokenmill import LLM

    return LLM(dtype="bfloat16", quantization="gguf", progress=False, **SMALL_KV)


@pytest.fixture(scope="session")
def hf_smol(smol_path):
    """Hugging Face's own GGUF loader and Llama code on the same file: an independent reference."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(smol_path.parent), gguf_file=smol_path.name,
                                                 dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def grammar_compiler():
    """A grammar compiler on the embedded model's tokenizer (49152 tokens, EOS 2), shut down after
    the module."""
    from tokenmill.model.loader import load_tokenizer, resolve_model
    from tokenmill.structured_output.compiler import GrammarCompiler

    tokenizer = load_tokenizer(resolve_model(None))
    c = GrammarCompiler(lambda: tokenizer, vocab_size=49152, stop_token_ids=[2])
    yield c
    c.shutdown()


@pytest.fixture(scope="session")
def smol_tokenizer_dir(smol_path):
    from tokenmill.model.loader import gguf_loader

    return gguf_loader.tokenizer_dir(smol_path)


def _save_tiny(kind: str, folder, tokenizer_dir, **overrides) -> None:
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    common = dict(vocab_size=49152, hidden_size=256, intermediate_size=352, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                  initializer_range=0.25, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
    common.update(overrides)
    torch.manual_seed(0)
    if kind == "llama":
        cfg = LlamaConfig(**common, tie_word_embeddings=True, rope_theta=50000.0,
                          rope_scaling={"rope_type": "llama3", "factor": 4.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 128})
        model = LlamaForCausalLM(cfg)
    elif kind == "mistral":  # Mistral without a sliding window is Llama: same code path
        model = MistralForCausalLM(MistralConfig(**common, sliding_window=None, tie_word_embeddings=False))
    else:
        cfg = Qwen2Config(**common, tie_word_embeddings=False, rope_theta=10000.0)
        model = Qwen2ForCausalLM(cfg)
        with torch.no_grad():  # HF initializes biases to zero; make them matter
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    model.save_pretrained(folder)
    for f in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, f), folder)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory, smol_tokenizer_dir):
    folder = tmp_path_factory.mktemp("tiny-llama")
    _save_tiny("llama", folder, smol_tokenizer_dir)
    return folder


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory, smol_tokenizer_dir):
    folder = tmp_path_factory.mktemp("tiny-qwen2")
    _save_tiny("qwen2", folder, smol_tokenizer_dir)
    return folder


@pytest.fixture(scope="session")
def tiny_qwen2_mqa_dir(tmp_path_factory, smol_tokenizer_dir):
    """Qwen2 with one KV head: it cannot be split over 2 tensor-parallel ranks (it is replicated)."""
    folder = tmp_path_factory.mktemp("tiny-qwen2-mqa")
    _save_tiny("qwen2", folder, smol_tokenizer_dir, num_key_value_heads=1)
    return folder


@pytest.fixture(scope="session")
def tiny_mistral_dir(tmp_path_factory, smol_tokenizer_dir):
    folder = tmp_path_factory.mktemp("tiny-mistral")
    _save_tiny("mistral", folder, smol_tokenizer_dir)
    return folder


def pytest_report_header(config):
    from tokenmill.utils.cpu import cpu_flags, describe

    amx = "with AMX" if "amx_tile" in cpu_flags() else "no AMX"
    return f"tokenmill CPU: {describe()} ({amx}); TOKENMILL_CPU_ISA caps the level"

"""GGUF types without a kernel of their own (Q3_K, IQ4_NL, IQ4_XS) run as Q8_0 blocks: the
rewrite against gguf's own dequantization, and a tiny Llama in those types against the same file
dequantized to fp32 (the Q8_0 kernels themselves are checked on every ISA path in
test_quant_kernels.py, -128 codes included)."""

from __future__ import annotations

import gc
import logging

import numpy as np
import pytest
from gguf.quants import dequantize

from tokenmill import LLM, SamplingParams
from tokenmill.config import EngineConfig
from tokenmill.errors import ConfigError
from tokenmill.model.layers.quantization.gguf_repack import IQ4_NL, IQ4_XS, Q3_K, Q8_0, repack_rows
from tokenmill.model.loader import gguf_loader, resolve_model
from tokenmill.model.quant_kernels import quant_kernels_available
from tokenmill.planning.model_spec import model_spec

from .tiny_gguf import assert_greedy_close, tiny_prompts, write_tiny_gguf

# ggml type -> (weights per block, bytes per block, byte offset of the fp16 scale d)
LAYOUT = {Q3_K: (256, 110, 108), IQ4_NL: (32, 18, 0), IQ4_XS: (256, 136, 0)}


def random_rows(qtype: int, rows: int, k: int, rng, scale: float, extremes: bool = False) -> np.ndarray:
    """Random bits with ordinary fp16 scales; with `extremes`, the largest fp16, a subnormal, zero
    and a negative scale among them."""
    block, size, d_at = LAYOUT[qtype]
    raw = rng.integers(0, 256, size=(rows, k // block * size), dtype=np.uint8)
    blocks = raw.reshape(rows, -1, size)
    d = (rng.standard_normal(blocks.shape[:2]) * scale).astype(np.float32)
    if extremes:
        d.reshape(-1)[:4] = [65504.0, 6e-8, 0.0, -3.0]
    blocks[..., d_at:d_at + 2] = d.astype(np.float16)[..., None].view(np.uint8)
    return raw


@pytest.mark.parametrize("qtype", [Q3_K, IQ4_NL], ids=["Q3_K", "IQ4_NL"])
def test_exact_types_become_the_same_weights(qtype):
    rng = np.random.default_rng(qtype)
    raw = random_rows(qtype, 9, 1024, rng, 0.01, extremes=True)
    got = dequantize(repack_rows(raw, qtype), Q8_0).reshape(9, 1024)
    np.testing.assert_array_equal(got, dequantize(raw, qtype).reshape(9, 1024))
    # a few rows at a time (as for an embedding's millions of weights): the same bytes
    np.testing.assert_array_equal(repack_rows(raw, qtype, chunk_weights=2048), repack_rows(raw, qtype))
    if qtype == Q3_K:  # the largest-magnitude code (-32 * -4 = +128) really occurred, stored negated
        q8 = repack_rows(raw, qtype).reshape(-1, 34)
        assert (q8[:, 2:].view(np.int8) == -128).any()


def test_iq4_xs_scales_are_rounded_to_fp16_only():
    rng = np.random.default_rng(3)
    raw = random_rows(IQ4_XS, 9, 1024, rng, 0.01)
    ref = dequantize(raw, IQ4_XS).reshape(9, 1024)
    got = dequantize(repack_rows(raw, IQ4_XS), Q8_0).reshape(9, 1024)
    assert np.all(np.abs(got - ref) <= np.abs(ref) * 2.0**-11)
    assert not np.array_equal(got, ref)  # a 6-bit scale times d needs more than fp16's 11 bits


# each kind of layer in a type without a kernel, and one in a type with one (Q8_0 beside a rewritten one)
TYPES = {"token_embd": Q3_K, "attn_q": Q3_K, "attn_k": IQ4_XS, "attn_v": Q8_0, "attn_output": IQ4_NL,
         "ffn_gate": Q3_K, "ffn_up": IQ4_XS, "ffn_down": Q3_K, "output": IQ4_NL}


def write_tiny_llama(path, corrupt: str | None = None) -> None:
    rng = np.random.default_rng(0)

    def packed(name, kind, n, k):
        t = TYPES[kind]
        if t == Q8_0:
            q = rng.integers(-127, 128, size=(n * k // 32, 32), dtype=np.int8)
            d = (rng.standard_normal(n * k // 32) * 0.02).astype(np.float16)
            rows = np.concatenate([d[:, None].view(np.uint8), q.view(np.uint8)], 1).reshape(n, -1)
        else:  # scales for weights of ~0.02-0.1, as the model's norms expect
            rows = random_rows(t, n, k, rng, {Q3_K: 0.002, IQ4_NL: 0.001, IQ4_XS: 0.0001}[t])
        if name == corrupt:
            rows[3, LAYOUT[t][2] + 1] = 0x7C  # the first block's d -> inf
        return rows, t

    write_tiny_gguf(path, "llama", "tiny-repacked-llama", packed,
                    lambda n: (1 + rng.standard_normal(n) * 0.1).astype(np.float32), norm_eps=1e-5)


@pytest.fixture(scope="module")
def tokenizer():
    return str(gguf_loader.tokenizer_dir(resolve_model(None).path))


def _llm(path, tokenizer, **kw) -> LLM:
    return LLM(model=str(path), tokenizer=tokenizer, kv_cache_memory="64MiB", max_model_len=256, progress=False,
               dtype="float32", **kw)


@pytest.mark.skipif(not quant_kernels_available(), reason="no C++ toolchain")
def test_a_model_in_types_without_kernels_runs_packed_and_matches_the_dequantized_model(tmp_path, tokenizer, caplog):
    path = tmp_path / "tiny-repacked.gguf"
    write_tiny_llama(path)
    prompts = tiny_prompts()
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
    outs = {}
    for q in ("gguf", "none"):
        with caplog.at_level(logging.INFO):
            llm = _llm(path, tokenizer, quantization=q, quant_act_bits=16)
        if q == "gguf":
            # the start-up line: Q3_K for the embedding and q, gate, down of both layers
            assert "Q8_0 from IQ4_NL x3, Q8_0 from IQ4_XS x4, Q8_0 from Q3_K x7" in caplog.text
            assert "no native kernel" not in caplog.text  # nothing fell back to a dequantized copy
            assert "Q3_K has no kernel of its own" in caplog.text
            weights = llm.engine.core.worker.weight_bytes
        else:
            assert llm.engine.core.worker.weight_bytes > 3 * weights  # fp32 copies: 32 bits against 8.5
        # what `tokenmill estimate` plans for, without loading the weights
        planned = model_spec(EngineConfig.from_kwargs(model=str(path), tokenizer=tokenizer, dtype="float32",
                                                      quantization=q)).weight_bytes
        assert abs(planned - llm.engine.core.worker.weight_bytes) <= 0.02 * planned, (q, planned)
        outs[q] = llm.generate(prompts, greedy, use_tqdm=False)
        del llm
        gc.collect()
    assert_greedy_close(outs["gguf"], outs["none"])


@pytest.mark.skipif(not quant_kernels_available(), reason="no C++ toolchain")
def test_a_corrupt_block_of_a_rewritten_type_is_a_clear_error(tmp_path, tokenizer):
    path = tmp_path / "tiny-corrupt.gguf"
    write_tiny_llama(path, corrupt="blk.1.ffn_gate.weight")
    with pytest.raises(ConfigError, match="ffn_gate.weight.*corrupt.*non-finite scale"):
        _llm(path, tokenizer, quantization="gguf")

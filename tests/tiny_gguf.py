"""A tiny decoder written as a GGUF file for tests, with no tokenizer metadata (it runs with
--tokenizer, SmolLM2's): the header, then every tensor by its GGUF name, in the order the tests'
random draws were made in."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from tokenmill.model.layers.quantization.formats import FORMATS, random_blocks

HIDDEN, INTER, LAYERS, HEADS, KV_HEADS, VOCAB = 256, 512, 2, 4, 2, 49152


def write_tiny_gguf(path, arch: str, name: str, packed: Callable, floats: Callable, biases: bool = False,
                    norm_eps: float = 1e-6, rope_base: float | None = None) -> None:
    """packed(gguf_name, kind, rows, cols) -> ([rows, bytes] uint8, ggml type), kind being the
    name's layer part (token_embd, attn_q, ..., ffn_down, output); floats(n) -> float32 [n], for
    norms and (with `biases`, Qwen2's) q/k/v biases."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(name)
    w.add_context_length(1024)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(INTER)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    if rope_base is not None:
        w.add_rope_freq_base(rope_base)
    w.add_layer_norm_rms_eps(norm_eps)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)

    def add(gguf_name, kind, n, k):
        rows, qtype = packed(gguf_name, kind, n, k)
        w.add_tensor(gguf_name, rows, raw_shape=rows.shape, raw_dtype=gguf.GGMLQuantizationType(qtype))

    kv = KV_HEADS * HIDDEN // HEADS
    add("token_embd.weight", "token_embd", VOCAB, HIDDEN)
    for i in range(LAYERS):
        b = f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", floats(HIDDEN))
        for proj, n in (("q", HIDDEN), ("k", kv), ("v", kv)):
            add(b + f"attn_{proj}.weight", f"attn_{proj}", n, HIDDEN)
            if biases:
                w.add_tensor(b + f"attn_{proj}.bias", floats(n))
        add(b + "attn_output.weight", "attn_output", HIDDEN, HIDDEN)
        w.add_tensor(b + "ffn_norm.weight", floats(HIDDEN))
        add(b + "ffn_gate.weight", "ffn_gate", INTER, HIDDEN)
        add(b + "ffn_up.weight", "ffn_up", INTER, HIDDEN)
        add(b + "ffn_down.weight", "ffn_down", HIDDEN, INTER)
    w.add_tensor("output_norm.weight", floats(HIDDEN))
    add("output.weight", "output", VOCAB, HIDDEN)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def tiny_prompts(n: int = 6) -> list[list[int]]:
    rng = np.random.default_rng(1)
    return [[1] + rng.integers(3, VOCAB, size=int(rng.integers(4, 40))).tolist() for _ in range(n)]


def assert_greedy_close(outs, refs, tol: float = 0.01) -> None:
    """The same greedy tokens, and each chosen token's logprob within `tol`."""
    for a, b in zip(outs, refs, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb, t in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, a.outputs[0].token_ids):
            assert abs(la[t].logprob - lb[t].logprob) < tol, (la[t], lb[t])


# Qwen2.5-Coder's mix: q, k and v merge into one layer of two types
KQUANT_TYPES = {"token_embd": "Q4_K", "attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q4_K",
                "ffn_gate": "Q4_K", "ffn_up": "Q5_0", "ffn_down": "Q6_K", "output": "Q6_K"}


def write_tiny_kquant_gguf(path, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)

    def packed(name, kind, n, k):
        fmt = KQUANT_TYPES[kind]
        return random_blocks(fmt, n, k, rng, scale=0.002, extremes=False), FORMATS[fmt].id

    write_tiny_gguf(path, "qwen2", "tiny-kquant-qwen2", packed,
                    lambda n: (rng.standard_normal(n) * 0.1).astype(np.float32), biases=True, rope_base=1e6)

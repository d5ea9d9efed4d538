"""The fp32 prompt kernel (csrc/prefill_attention.cpp): causal attention of a prompt chunk over its
sequence's paged K/V, against a float64 reference, and through the engine against SDPA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill.model.kernels import load_cpu_kernels
from tokenmill.utils.cpu import active_isa

pytestmark = pytest.mark.skipif(not load_cpu_kernels() or active_isa() == "portable",
                                reason="the prompt kernel needs AVX2 and a C++ toolchain")


def _reference(q, k_cache, v_cache, table, ctx, scale):
    bs, hkv, d = k_cache.shape[1:]
    t = torch.arange(ctx)
    slots = table[t // bs] * bs + t % bs
    k, v = (c.reshape(-1, hkv, d)[slots].double().transpose(0, 1)[None] for c in (k_cache, v_cache))
    q_len = q.shape[0]
    mask = t[None, :] <= torch.arange(ctx - q_len, ctx)[:, None]
    out = F.scaled_dot_product_attention(q.double().transpose(0, 1)[None], k, v, attn_mask=mask, scale=scale,
                                         enable_gqa=True)
    return out[0].transpose(0, 1)


def _case(heads, kv_heads, head_dim, block_size, ctx, q_len, spread=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    nb = -(-ctx // block_size)
    k_cache = torch.randn(3 * nb, block_size, kv_heads, head_dim, generator=g) * spread
    v_cache = torch.randn(3 * nb, block_size, kv_heads, head_dim, generator=g)
    table = torch.randperm(3 * nb, generator=g)[:nb]  # blocks scattered over the pool
    qkv = torch.randn(q_len, heads * head_dim + 3 * head_dim, generator=g)  # q as a strided view, as in a layer
    return qkv[:, :heads * head_dim].view(q_len, heads, head_dim), k_cache, v_cache, table


@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(9, 3, 64, 16), (12, 2, 128, 16), (14, 2, 64, 4),
                                                                  (4, 4, 32, 32)])
@pytest.mark.parametrize("ctx,q_len", [(1, 1), (5, 5), (31, 31), (33, 33), (100, 37), (300, 1), (129, 64),
                                       (250, 250)])
def test_prompt_chunk_matches_reference(heads, kv_heads, head_dim, block_size, ctx, q_len):
    """Fresh prompts (q_len == ctx) and chunks after cached context, across the kernel's 32-key steps
    and its tiles of query rows (a last tile of one row, GQA groups of 1 to 7 heads)."""
    q, k_cache, v_cache, table = _case(heads, kv_heads, head_dim, block_size, ctx, q_len)
    out = torch.full((q_len, heads, head_dim), float("nan"))
    assert torch.ops.tokenmill.prefill_attention(out, q, k_cache, v_cache, table, ctx, head_dim ** -0.5)
    ref = _reference(q, k_cache, v_cache, table, ctx, head_dim ** -0.5)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=2e-5)


def test_a_rows_result_does_not_depend_on_its_chunk():
    """Each row is computed alone, whatever tile of rows and chunk it falls in: a prompt's rows equal
    those of the same prompt with one more token, and of chunks after cached context, bit for bit
    (SDPA's last rows moved with the prompt's length)."""
    q, k_cache, v_cache, table = _case(9, 3, 64, 16, 250, 250, seed=5)

    def rows(first, ctx):
        out = torch.empty(ctx - first, 9, 64)
        assert torch.ops.tokenmill.prefill_attention(out, q[first:ctx], k_cache, v_cache, table, ctx, 0.125)
        return out

    whole = rows(0, 250)
    assert torch.equal(rows(0, 249), whole[:249])
    for first in (150, 200, 237, 249):
        assert torch.equal(rows(first, 250), whole[first:])


def test_peaked_scores_stay_finite_and_exact():
    """Scores in the hundreds: the online softmax rescales as each step's maximum rises, without
    overflow (a late key that dominates, an early one that did)."""
    q, k_cache, v_cache, table = _case(9, 3, 64, 16, 200, 200, spread=30.0, seed=3)
    out = torch.empty(200, 9, 64)
    assert torch.ops.tokenmill.prefill_attention(out, q, k_cache, v_cache, table, 200, 0.125)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), _reference(q, k_cache, v_cache, table, 200, 0.125), atol=1e-4,
                               rtol=1e-4)


def test_bad_input_is_refused():
    q, k_cache, v_cache, table = _case(9, 3, 64, 16, 40, 40)
    out = torch.empty(40, 9, 64)
    with pytest.raises(RuntimeError, match="cover"):  # a table of 2 blocks for 40 keys
        torch.ops.tokenmill.prefill_attention(out, q, k_cache, v_cache, table[:2], 40, 0.125)
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.tokenmill.prefill_attention(out, q, k_cache, v_cache, table + 1000, 40, 0.125)
    with pytest.raises(RuntimeError, match="fp32"):
        torch.ops.tokenmill.prefill_attention(out.bfloat16(), q.bfloat16(), k_cache, v_cache, table, 40, 0.125)
    with pytest.raises(RuntimeError, match="ctx_len"):  # more rows than keys
        torch.ops.tokenmill.prefill_attention(out, q, k_cache, v_cache, table, 39, 0.125)


def test_engine_prompts_through_the_kernel_match_sdpa():
    """The embedded model with fp32 weights (no packed kernels, whose rounding follows the rows of a
    step): prompts whole and in 64-token chunks after their cached part, through the kernel and
    through SDPA, give the same greedy tokens and logprobs within fp32 rounding."""
    from tokenmill import LLM, SamplingParams

    llm = LLM(dtype="float32", quantization="none", max_num_batched_tokens=64, max_model_len=1024,
              kv_cache_memory="256MiB", enable_prefix_caching=False, progress=False)
    backend = llm.engine.core.worker.backend
    if backend.name != "cpu_paged":
        pytest.skip("the cpu_paged backend is not in use")
    prompts = ["The history of the printing press " * 12, "def fibonacci(n):\n    " * 9, "Hello"]
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=3)
    runs = {}
    for on in (True, False):
        backend.prefill_kernel = on
        runs[on] = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(runs[True], runs[False]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
            for tok, lp in lb.items():
                assert abs(la[tok].logprob - lp.logprob) < 1e-4


@pytest.mark.parametrize("storage", [torch.bfloat16, torch.int8, torch.float8_e4m3fn])
def test_quantized_cache_prompts_through_the_kernel_match_sdpa(storage, monkeypatch):
    """A bf16, int8 or fp8 cache under fp32 queries: a fresh prompt (its own K/V) and a chunk after cached
    context (the context dequantized) through the kernel equal SDPA's rows within fp32 rounding.
    (Through the engine the two differ more: a rounding difference in one layer can move a code of
    the next layer's cache by a step.)"""
    from tokenmill.model.attention.backend import BatchLayout
    from tokenmill.model.attention.cpu_paged import CPUPagedBackend
    from tokenmill.model.attention.quant_kv import allocate

    heads, hkv, d, bs = 9, 3, 64, 16
    g = torch.Generator().manual_seed(0)
    cache = allocate(1, 16, bs, hkv, d, storage, torch.device("cpu"))[0]
    backend = CPUPagedBackend(bs, torch.device("cpu"))
    tables = [[3, 7, 1], [9, 2, 12, 5, 0]]
    taken = []
    kernel_call = CPUPagedBackend._prefill_contiguous
    monkeypatch.setattr(CPUPagedBackend, "_prefill_contiguous",
                        staticmethod(lambda *a: taken.append(kernel_call(*a)) or taken[-1]))

    def step(query_lens, seq_lens, kernel):
        n = sum(query_lens)
        q, k, v = (torch.randn(n, h, d, generator=g) for h in (heads, hkv, hkv))
        slots = torch.cat([torch.tensor([tables[i][t // bs] * bs + t % bs for t in range(s - ql, s)])
                           for i, (ql, s) in enumerate(zip(query_lens, seq_lens))])
        meta = backend.build_metadata(BatchLayout(query_lens, seq_lens, tables, slots, 0))
        backend.prefill_kernel = kernel
        return backend.forward(q, k, v, cache, meta, 0.125)

    step([40, 46], [40, 46], False)  # the second sequence's first 46 tokens into the cache
    inputs = g.get_state()
    outs = []
    for kernel in (True, False):  # the same inputs both ways (the second write stores the same codes)
        g.set_state(inputs)
        outs.append(step([33, 24], [33, 70], kernel))
    assert taken == [True, True]  # both chunks went through the kernel
    torch.testing.assert_close(outs[0], outs[1], atol=2e-5, rtol=2e-5)


def test_engine_fp32_prompt_logprobs_do_not_depend_on_what_follows():
    """The default fp32 engine (the GGUF's packed weights, whose products compute each row alike):
    a prompt's logprobs equal those of the same prompt with one more token, bit for bit, where the
    prompt kernel runs. (Through SDPA the last block's attention rows moved by ~1e-7, and this
    model's 8-bit activation codes made that up to 0.12 nats at a position.)"""
    import random

    from tokenmill import LLM, SamplingParams

    llm = LLM(dtype="float32", max_model_len=1024, kv_cache_memory="128MiB", enable_prefix_caching=False,
              progress=False)
    if not llm.engine.core.worker.backend.prefill_kernel:
        pytest.skip("fp32 prompts go through SDPA on this CPU")
    rng = random.Random(0)
    ids = [rng.randrange(100, 40000) for _ in range(400)]
    params = SamplingParams(max_tokens=1, prompt_logprobs=0)
    longer, shorter = (llm.generate([p], params, use_tqdm=False)[0].prompt_logprobs for p in (ids, ids[:-1]))
    assert len(shorter) == 399
    for pos, (a, b) in enumerate(zip(longer[1:399], shorter[1:]), start=1):
        assert {t: lp.logprob for t, lp in a.items()} == {t: lp.logprob for t, lp in b.items()}, pos

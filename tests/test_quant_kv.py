"""Quantized KV cache (--kv-cache-dtype int8 / fp8_e4m3 / fp8_e5m2 / bfloat16): the write and decode kernels
against SDPA on what is stored, per ISA variant, and through the engine."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill import LLM, SamplingParams
from tokenmill.errors import ConfigError
from tokenmill.model.quant_kernels import quant_kernels_available, quant_kv_ops, supported_variants

pytestmark = pytest.mark.skipif(not quant_kernels_available(), reason="no C++ toolchain")
STORAGE = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
ROUNDING = {"int8": 0.5 / 127, "fp8_e4m3": 2**-4, "fp8_e5m2": 2**-3}  # of a head's absmax: half a step, at most


def _filled_cache(ops, kind, dtype, lens, hkv, d, bs=16):
    """A paged cache of `kind` holding random K/V of sequences of `lens` tokens (every token row
    written by kv_write_quant); returns data, scale, tables, and the K/V as written."""
    per_seq = max(8, -(-max(lens) // bs))
    nb = per_seq * len(lens) + 8
    data = torch.zeros(2, nb, bs, hkv, d, dtype=STORAGE[kind])
    scale = torch.zeros(2, nb, bs, hkv)
    tables = torch.randperm(nb)[:per_seq * len(lens)].view(len(lens), per_seq)  # no block shared between sequences
    ks, vs = [], []
    for i, n in enumerate(lens):
        k = (torch.randn(n, hkv, d) * 3).to(dtype)
        v = torch.randn(n, hkv, d).to(dtype)
        k[0] = 0  # an all-zero head: scale 0, no NaN
        ops.kv_write_quant(k, v, data[0], data[1], scale[0], scale[1], _slots(tables[i], n, bs))
        ks.append(k)
        vs.append(v)
    return data, scale, tables, ks, vs


def _slots(table, n, bs=16):
    p = torch.arange(n)
    return table[p // bs] * bs + p % bs


def _reference(q, data, scale, table, n, d, hkv):
    """SDPA of one row over what the cache stores (codes times scales) for its first n tokens."""
    slots = _slots(table, n)
    k, v = (data[j].view(-1, hkv, d)[slots].float() * scale[j].view(-1, hkv)[slots, :, None] for j in (0, 1))
    return F.scaled_dot_product_attention(q.float().unsqueeze(1), k.transpose(0, 1), v.transpose(0, 1), scale=0.125,
                                          enable_gqa=True).squeeze(1)


@pytest.mark.parametrize("variant", supported_variants())
@pytest.mark.parametrize("kind", list(STORAGE))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantized_cache_write_and_decode(variant, kind, dtype):
    torch.manual_seed(0)
    ops = quant_kv_ops(variant)
    hkv, heads, d, lens = 2, 6, 64, [1, 7, 33, 120]
    data, scale, tables, ks, vs = _filled_cache(ops, kind, dtype, lens, hkv, d)
    q = torch.randn(len(lens), heads, d).to(dtype)
    out = torch.empty_like(q)
    ops.paged_decode_attention_q(out, q, data[0], data[1], scale[0], scale[1], tables, torch.tensor(lens), 0.125)
    for i, n in enumerate(lens):
        slots = _slots(tables[i], n)
        stored = [data[j].view(-1, hkv, d)[slots].float() * scale[j].view(-1, hkv)[slots, :, None] for j in (0, 1)]
        # what the kernel reads back is within the format's rounding of what was written
        rel = ROUNDING[kind]
        for j, x in enumerate((ks[i], vs[i])):
            amax = x.float().abs().amax(-1, keepdim=True)
            assert ((stored[j] - x.float()).abs() <= rel * amax + 1e-6).all()
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(out[i].float(), _reference(q[i], data, scale, tables[i], n, d, hkv),
                                   atol=tol, rtol=tol)


@pytest.mark.parametrize("kind", list(STORAGE))
@pytest.mark.parametrize("hkv,heads,d", [(2, 6, 64), (3, 9, 64), (2, 12, 128), (1, 10, 128)])
def test_avx512_decode_reads_a_quantized_cache(kind, hkv, heads, d):
    """The attention library's AVX-512 kernel on int8 / fp8 caches (bf16 queries; int8 through the
    fp32 path in an AVX2 build): against SDPA over the stored values, for plain rows and a
    verification run (rows over one table, lengths L..L+2), each row the same as alone."""
    from tokenmill.model.kernels import load_cpu_kernels

    torch.manual_seed(1)
    if not load_cpu_kernels():
        pytest.skip("no CPU kernels")
    lens = [1, 70, 200, 300]
    data, scale, tables, _, _ = _filled_cache(quant_kv_ops(), kind, torch.bfloat16, lens, hkv, d)
    rows = [(0, 1), (1, 70), (2, 200), (3, 298), (3, 299), (3, 300)]  # the last three: a verification run
    q = torch.randn(len(rows), heads, d).to(torch.bfloat16)
    row_tables = torch.stack([tables[s] for s, _ in rows])
    row_lens = torch.tensor([n for _, n in rows])
    out = torch.empty_like(q)
    scaled = torch.ops.tokenmill.paged_decode_attention_scaled
    if not scaled(out, q, data[0], data[1], scale[0], scale[1], row_tables, row_lens, 0.125):
        # an AVX2 build takes int8 through its fp32 path (the queries widened); fp8 needs AVX-512
        pytest.skip("no AVX-512 path on this CPU (or TOKENMILL_CPU_ISA caps it)")
    for i, (s, n) in enumerate(rows):
        torch.testing.assert_close(out[i].float(), _reference(q[i], data, scale, tables[s], n, d, hkv),
                                   atol=2e-2, rtol=2e-2)
        alone = torch.empty_like(q[i:i + 1])
        scaled(alone, q[i:i + 1], data[0], data[1], scale[0], scale[1], row_tables[i:i + 1], row_lens[i:i + 1], 0.125)
        assert torch.equal(alone, out[i:i + 1])


@pytest.mark.parametrize("kind", ["int8", "bfloat16"])
@pytest.mark.parametrize("hkv,heads,d", [(3, 9, 64), (2, 12, 128), (1, 10, 128)])
def test_avx2_decode_reads_an_int8_or_bf16_cache_under_fp32(kind, hkv, heads, d):
    """The attention library's AVX2 fp32 kernel on an int8 cache with scales or a bf16 one without:
    against SDPA over the stored values, rows of several chunks, each row the same as alone."""
    from tokenmill.model.kernels import load_cpu_kernels

    torch.manual_seed(2)
    if not load_cpu_kernels():
        pytest.skip("no CPU kernels")
    lens = [1, 70, 200, 300]
    if kind == "int8":
        data, scale, tables, _, _ = _filled_cache(quant_kv_ops(), kind, torch.float32, lens, hkv, d)
    else:
        per_seq = -(-max(lens) // 16)
        nb = per_seq * len(lens) + 8
        data, scale = torch.randn(2, nb, 16, hkv, d).to(torch.bfloat16), torch.zeros(2, 0)
        tables = torch.randperm(nb)[:per_seq * len(lens)].view(len(lens), per_seq)
    stored_scale = scale if kind == "int8" else torch.ones(2, data.shape[1], 16, hkv)
    q = torch.randn(len(lens), heads, d)
    out = torch.empty_like(q)
    scaled = torch.ops.tokenmill.paged_decode_attention_scaled
    if not scaled(out, q, data[0], data[1], scale[0], scale[1], tables, torch.tensor(lens), 0.125):
        pytest.skip("no AVX2 path in this build (TOKENMILL_CPU_ISA caps it)")
    for i, n in enumerate(lens):
        torch.testing.assert_close(out[i], _reference(q[i], data, stored_scale, tables[i], n, d, hkv),
                                   atol=1e-5, rtol=1e-4)
        alone = torch.empty_like(q[i:i + 1])
        scaled(alone, q[i:i + 1], data[0], data[1], scale[0], scale[1], tables[i:i + 1], torch.tensor([n]), 0.125)
        assert torch.equal(alone, out[i:i + 1])


@pytest.mark.parametrize("kind", list(STORAGE))
def test_quantized_cache_halves_the_bytes_and_generates(kind):
    kw = dict(dtype="bfloat16", kv_cache_memory="64MiB", max_model_len=512, progress=False)
    plain = LLM(**kw)
    llm = LLM(kv_cache_dtype=kind, **kw)
    assert llm.engine.core.worker.kv_storage == STORAGE[kind]
    w, w0 = llm.engine.core.worker, plain.engine.core.worker
    assert w.kv_bytes_per_token < 0.54 * w0.kv_bytes_per_token  # 64 + 4 bytes per head and token vs 128
    assert w.num_blocks > 1.8 * w0.num_blocks  # the same budget holds ~twice the tokens
    params = SamplingParams(temperature=0, max_tokens=24)
    prompt = "The capital of France is Paris. The capital of Germany is"
    got = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].text
    assert got.startswith(" Berlin"), got


def test_bfloat16_cache_under_an_fp32_model():
    llm = LLM(dtype="float32", quantization="none", kv_cache_dtype="bfloat16", kv_cache_memory="64MiB",
              max_model_len=512, max_num_batched_tokens=16, progress=False)
    assert llm.engine.core.worker.kv_storage == torch.bfloat16
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert out[0].outputs[0].text.startswith(" Paris")


def test_fp8_is_vllms_name_for_e4m3():
    from tokenmill.config import EngineConfig

    assert EngineConfig.from_kwargs(kv_cache_dtype="fp8").cache.kv_cache_dtype == "fp8_e4m3"
    with pytest.raises(ConfigError, match="torch_sdpa backend cannot read it"):
        LLM(kv_cache_dtype="fp8", attention_backend="torch_sdpa", progress=False)


def test_quantized_cache_needs_a_backend_that_reads_it():
    with pytest.raises(ConfigError, match="torch_sdpa backend cannot read it"):
        LLM(kv_cache_dtype="int8", attention_backend="torch_sdpa", progress=False)
    with pytest.raises(ConfigError, match="kv_cache_dtype"):
        LLM(kv_cache_dtype="int4", progress=False)


@pytest.mark.parametrize("storage", [torch.int8, torch.float8_e4m3fn, torch.bfloat16])
def test_quantized_cache_takes_memory_only_as_blocks_are_used(storage):
    """A 1 GiB quantized pool is mapped, not written, at start-up (torch.zeros wrote all of it):
    resident memory grows only by the blocks a write touches, and the pool reads as zeros."""
    from tokenmill.model.attention.quant_kv import allocate

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    before = rss()
    caches = allocate(32, 4096, 16, 4, 64, storage, "cpu")  # 32 layers x 2 x 4096 blocks x 16 x 4 x 64
    assert caches[0].data.numel() * storage.itemsize * 32 >= 2**30
    assert rss() - before < 64 << 20
    caches[5].data[1, 7].fill_(1)
    if caches[5].scale.numel():
        caches[5].scale.fill_(0.5)
    assert rss() - before < 128 << 20 and caches[6].data.float().abs().sum() == 0

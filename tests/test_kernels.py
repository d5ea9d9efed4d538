"""tokenmill's C++ CPU kernels against the PyTorch ops they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenmill.model.kernels import load_cpu_kernels
from tokenmill.model.layers.activation import silu_and_mul
from tokenmill.model.layers.norm import RMSNorm
from tokenmill.model.layers.rotary import RotaryEmbedding, apply_rotary

pytestmark = pytest.mark.skipif(not load_cpu_kernels(), reason="no C++ toolchain: portable ops are used")
DTYPES = [torch.float32, torch.bfloat16]


def _same(a, b, dtype):
    if dtype == torch.float32:
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    else:  # the kernels round at the same points as the eager ops: bitwise equal
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_with_and_without_residual(dtype):
    torch.manual_seed(0)
    x, res = torch.randn(37, 576, dtype=dtype) * 3, torch.randn(37, 576, dtype=dtype)
    norm = RMSNorm(576, 1e-5, dtype)
    norm.weight.data = torch.randn(576, dtype=dtype)
    ref_out, ref_res = norm(x, res.clone())
    out, res2 = torch.empty_like(x), res.clone()
    torch.ops.tokenmill.rms_norm(out, x, res2, norm.weight, 1e-5)
    _same(res2, ref_res, dtype)
    _same(out, ref_out, dtype)
    torch.ops.tokenmill.rms_norm(out, x, None, norm.weight, 1e-5)
    _same(out, norm(x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, inter", [(19, 1536), (1, 4864), (3, 96)])  # rows in pieces, a last short one
def test_silu_and_mul(dtype, rows, inter):
    x = torch.randn(rows, 2 * inter, dtype=dtype) * 4
    out = torch.empty(rows, inter, dtype=dtype)
    torch.ops.tokenmill.silu_and_mul(out, x)
    _same(out, silu_and_mul(x), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotary_in_place_on_strided_qkv(dtype, head_dim):
    heads, kv_heads, t = 6, 2, 23
    rope = RotaryEmbedding(head_dim, 4096, 10000.0, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                     "high_freq_factor": 4.0, "original_max_position_embeddings": 256})
    qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    q = qkv[:, :heads * head_dim].view(t, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(t, kv_heads, head_dim)
    v_before = qkv[:, (heads + kv_heads) * head_dim:].clone()
    pos = torch.randint(0, 4096, (t,))
    cos, sin = rope.lookup(pos, dtype)
    ref_q, ref_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    torch.ops.tokenmill.rotary_embedding(q, k, rope.cos, rope.sin, pos)
    _same(q, ref_q, dtype)
    _same(k, ref_k, dtype)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim:], v_before)  # v untouched


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,heads,kv_heads,block_size", [(64, 9, 3, 16), (128, 8, 2, 4), (64, 4, 4, 32)])
def test_paged_decode_attention_matches_sdpa(dtype, head_dim, heads, kv_heads, block_size):
    torch.manual_seed(1)
    num_blocks, lens = 64, [1, 5, 16, 17, 100, 250]
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, dtype=dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, dtype=dtype)
    max_blocks = -(-max(lens) // block_size)
    tables = torch.stack([torch.randperm(num_blocks)[:max_blocks] for _ in lens])
    q = torch.randn(len(lens), heads, head_dim, dtype=dtype)
    out = torch.empty_like(q)
    torch.ops.tokenmill.paged_decode_attention(out, q, k_cache, v_cache, tables, torch.tensor(lens), 0.125)
    for i, n in enumerate(lens):
        k = k_cache[tables[i]].reshape(-1, kv_heads, head_dim)[:n].transpose(0, 1).float()
        v = v_cache[tables[i]].reshape(-1, kv_heads, head_dim)[:n].transpose(0, 1).float()
        ref = F.scaled_dot_product_attention(q[i].float().unsqueeze(1), k, v, scale=0.125, enable_gqa=True)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(out[i].float(), ref.squeeze(1), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 9, 3), (128, 12, 2)])
def test_verification_rows_equal_rows_alone(dtype, head_dim, heads, kv_heads):
    """A verification's rows (one table, lengths L..L+k, run together by the kernel) give bit for
    bit what each row gives alone, and match SDPA; runs longer than the kernels' longest (AVX-512's
    and AVX2's: 32), and runs next to single decodes, too."""
    torch.manual_seed(2)
    block_size, num_blocks = 16, 96
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, dtype=dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, dtype=dtype)
    seqs = [(1, 40), (5, 250), (1, 7), (20, 31), (3, 1), (40, 70)]  # (rows, length of the first row)
    lens = [first + i for rows, first in seqs for i in range(rows)]
    max_blocks = -(-max(lens) // block_size)
    seq_tables = [torch.randperm(num_blocks)[:max_blocks] for _ in seqs]
    tables = torch.stack([seq_tables[s] for s, (rows, _) in enumerate(seqs) for _ in range(rows)])
    q = torch.randn(len(lens), heads, head_dim, dtype=dtype)
    out = torch.empty_like(q)
    torch.ops.tokenmill.paged_decode_attention(out, q, k_cache, v_cache, tables, torch.tensor(lens), 0.125)
    _rows_alone_and_sdpa(out, q, k_cache, v_cache, tables, lens, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_of_other_sequences_with_rising_lengths(dtype):
    """Rows whose lengths rise by one but whose tables part at a block only the longer ones reach
    (different sequences sharing a cached prefix): each row reads its own table's keys, although a
    run of rows takes the offsets of its longest row."""
    torch.manual_seed(5)
    block_size, num_blocks, head_dim, heads, kv_heads = 16, 32, 64, 9, 3
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, dtype=dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, dtype=dtype)
    shared = torch.tensor([3, 17, 8, 11])
    lens = [63, 64, 65, 66, 67]  # rows 2-4 reach a 5th block: row 2's and 3's is the same, row 4's its own
    fifth = [0, 0, 20, 20, 21]
    tables = torch.stack([torch.cat([shared, torch.tensor([f])]) for f in fifth])
    q = torch.randn(len(lens), heads, head_dim, dtype=dtype)
    out = torch.empty_like(q)
    torch.ops.tokenmill.paged_decode_attention(out, q, k_cache, v_cache, tables, torch.tensor(lens), 0.125)
    _rows_alone_and_sdpa(out, q, k_cache, v_cache, tables, lens, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 9, 3), (128, 12, 2)])
def test_prefill_rows_equal_rows_alone(dtype, head_dim, heads, kv_heads):
    """A prompt's tokens as rows of one table (lengths 1..L; the backend's paged prefill, and every
    prompt in batch-invariant mode): with AVX-512 bf16, past a few MiB of partials each (run, kv
    head) becomes one task over all its key chunks, with a buffer of its own; fp32 with AVX2 takes
    runs of 32 rows a chunk at a time. Every row is still bit for bit the row alone, and matches
    SDPA (a sample of rows)."""
    torch.manual_seed(4)
    block_size, num_blocks, length = 16, 64, 700
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, dtype=dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, dtype=dtype)
    table = torch.randperm(num_blocks)[:-(-length // block_size)]
    lens = list(range(1, length + 1))
    tables = table.repeat(length, 1)
    q = torch.randn(length, heads, head_dim, dtype=dtype)
    out = torch.empty_like(q)
    torch.ops.tokenmill.paged_decode_attention(out, q, k_cache, v_cache, tables, torch.tensor(lens), 0.125)
    rows = [0, 1, 15, 16, 63, 64, 65, 300, 511, 698, 699]
    _rows_alone_and_sdpa(out[rows], q[rows], k_cache, v_cache, tables[rows], [lens[i] for i in rows], dtype)


def _rows_alone_and_sdpa(out, q, k_cache, v_cache, tables, lens, dtype):
    """Each row of a batched result is bit for bit the row run alone, and matches SDPA."""
    kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    for i, n in enumerate(lens):
        alone = torch.empty_like(q[i:i + 1])
        torch.ops.tokenmill.paged_decode_attention(alone, q[i:i + 1].clone(), k_cache, v_cache, tables[i:i + 1],
                                                   torch.tensor([n]), 0.125)
        assert torch.equal(out[i], alone[0]), (i, n)
        k = k_cache[tables[i]].reshape(-1, kv_heads, head_dim)[:n].transpose(0, 1).float()
        v = v_cache[tables[i]].reshape(-1, kv_heads, head_dim)[:n].transpose(0, 1).float()
        ref = F.scaled_dot_product_attention(q[i].float().unsqueeze(1), k, v, scale=0.125, enable_gqa=True)
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(out[i].float(), ref.squeeze(1), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim,heads,kv_heads", [(64, 9, 3), (64, 4, 1), (128, 12, 2), (64, 16, 16)])
def test_paged_decode_attention_key_split(dtype, head_dim, heads, kv_heads):
    """One sequence (the decode of one stream, where the keys are split over the threads) and a
    few, at lengths around the key chunks, against SDPA; each row bit for bit what it gives in
    another batch (the split depends on a row's length only)."""
    torch.manual_seed(3)
    block_size, num_blocks = 16, 160
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, dtype=dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, dtype=dtype)
    lens = [1, 17, 63, 64, 65, 190, 2000]
    max_blocks = -(-max(lens) // block_size)
    tables = torch.stack([torch.randperm(num_blocks)[:max_blocks] for _ in lens])
    q = torch.randn(len(lens), heads, head_dim, dtype=dtype)
    batched = torch.empty_like(q)
    torch.ops.tokenmill.paged_decode_attention(batched, q, k_cache, v_cache, tables, torch.tensor(lens), 0.125)
    _rows_alone_and_sdpa(batched, q, k_cache, v_cache, tables, lens, dtype)


@pytest.mark.parametrize("width", [7, 16, 49152, 151936 + 5])
def test_argmax_rows_is_torch_argmax(width):
    """The greedy pick in one op: each row's first maximum, a NaN counting as the largest (the first
    NaN), +0 and -0 equal, rows of -inf, maxima in the tail past whole vectors, strided rows."""
    g = torch.Generator().manual_seed(width)
    wide = torch.randn(10, width + 3, generator=g)
    x = wide[:, :width]  # rows 3 floats apart from the next one's start: a stride, not contiguous
    x[1] = torch.randint(0, 3, (width,), generator=g).float()  # many tied maxima
    x[2] = float("-inf")
    x[3] = -5.0
    x[3, -1] = 4.0  # the maximum last
    x[4, [width // 3, width - 1]] = 99.0  # the first of two equal maxima
    x[5] = -1.0
    x[5, width // 2:] = 0.0
    x[5, width // 2] = -0.0  # -0 first, then +0: the first zero
    x[6, [width // 2, width - 1]] = float("nan")  # the first NaN, wherever the maximum is
    x[7, 0] = float("nan")
    x[8] = float("inf")
    assert x.stride(0) == width + 3
    got = torch.ops.tokenmill.argmax_rows(x)
    assert got.dtype == torch.long and torch.equal(got, torch.argmax(x, dim=-1))
    assert got[4] == width // 3 and got[5] == width // 2 and got[6] == width // 2 and got[7] == 0
    from tokenmill.worker.sampler import first_argmax  # the sampler takes the op once the kernels load

    assert torch.equal(first_argmax(x.contiguous()), got)


@pytest.mark.parametrize("width", [7, 37, 32768 + 3])
def test_argmax_prob_rows_is_max_and_softmax(width):
    """The draft's pick: the first maximum and its softmax probability, as max(dim) and
    exp(max - logsumexp) give them; a row of -inf or with a NaN has a NaN probability."""
    from tokenmill.worker.spec_decode.draft_model import draft_pick

    g = torch.Generator().manual_seed(width)
    x = torch.randn(6, width, generator=g) * 4
    x[1, width // 2] = 1e4  # one certain token
    x[2, [1, width - 1]] = 60.0  # two equal maxima: the first, half the mass each
    x[3] = float("-inf")
    x[4, width - 1] = float("nan")
    x[5, -1] = 30.0  # the maximum in the tail past whole vectors
    idx, prob = torch.ops.tokenmill.argmax_prob_rows(x)
    best, ref_idx = x.max(dim=-1)
    ref = (best - torch.logsumexp(x, dim=-1)).exp()
    assert torch.equal(idx, torch.argmax(x, dim=-1)) and torch.equal(idx[[0, 1, 2, 5]], ref_idx[[0, 1, 2, 5]])
    fine = [0, 1, 2, 5]
    torch.testing.assert_close(prob[fine], ref[fine], rtol=1e-5, atol=0)
    assert prob[1] == 1.0 and abs(prob[2].item() - 0.5) < 1e-5 and idx[2] == 1
    assert prob[3].isnan() and prob[4].isnan() and idx[4] == width - 1
    got_idx, got_prob = draft_pick(x[fine])
    assert torch.equal(got_idx, idx[fine]) and torch.equal(got_prob, prob[fine])

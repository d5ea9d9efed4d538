"""Quantized-weight kernels, per format and per ISA variant this CPU can run: dequantization equals
gguf-py's reference, and the packed matmul equals dequantize-then-fp32-matmul."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tokenmill.model.layers.quantization.formats import FORMATS, dequantize_own, random_blocks, row_bytes
from tokenmill.model.quant_kernels import quant_kernels_available, quant_ops, supported_variants

pytestmark = pytest.mark.skipif(not quant_kernels_available(), reason="no C++ toolchain")
VARIANTS = supported_variants()
GGUF_TYPES = ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K"]
OWN_TYPES = ["I8_ROW", "I4_G128"]
K_QUANTS = ["Q4_K", "Q5_K", "Q6_K"]


def _reference_dequant(name: str, w: np.ndarray, rows: int, k: int) -> torch.Tensor:
    if name in GGUF_TYPES:
        from gguf.quants import dequantize

        return torch.from_numpy(dequantize(w.reshape(rows, -1), FORMATS[name].id).reshape(rows, k).astype(np.float32))
    return dequantize_own(name, w.reshape(rows, -1), k)


def _packed(variant, name, w):
    """GGUF rows -> the kernels' layout."""
    return quant_ops(variant).repack(torch.from_numpy(w), FORMATS[name].id, w.shape[0], _k(name, w))


def _k(name, w):
    f = FORMATS[name]
    return (w.shape[1] - f.row_head) // f.bytes * f.block


def _quantize_activations(x: torch.Tensor, bits: int = 8, pow2: bool = False) -> torch.Tensor:
    """What the kernel multiplies: x rounded to int8 in blocks of 32 (scale amax / 127), plus with 16
    bits the rounding residual in 1/256 steps, as floats. With pow2 (K-quant weights, 8 bits) a
    block's scale is its 256-value super-block's amax / 127 over the largest 2^s, s <= 3, that keeps
    the block's codes within 127."""
    xb = x.float().view(x.shape[0], -1, 32)
    amax = xb.abs().amax(-1, keepdim=True)
    if pow2:
        amax_b = amax.view(x.shape[0], -1, 8).amax(-1, keepdim=True).repeat_interleave(8, 1)
        s = torch.zeros_like(amax)
        for _ in range(3):
            s = torch.where(amax * 2 ** (s + 1) <= amax_b, s + 1, s)
        inv = torch.where(amax_b > 0, torch.tensor(127.0) / amax_b, torch.zeros(())) * 2 ** s
        scale = amax_b / 127.0 / 2 ** s
    else:
        inv = torch.where(amax > 0, torch.tensor(127.0) / amax, torch.zeros(()))
        scale = amax / 127.0
    y = xb * inv
    q = torch.round(y)
    if bits == 16:
        q = q + torch.round((y - q) * 256).clamp(-127, 127) / 256
    return (q * scale).view_as(x.float())


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name", GGUF_TYPES + OWN_TYPES)
def test_dequantize_matches_reference(variant, name):
    rows, k = 37, 512
    w = random_blocks(name, rows, k, np.random.default_rng(0))
    ref = _reference_dequant(name, w, rows, k)
    out = torch.empty(rows, k)
    quant_ops(variant).dequantize(out, _packed(variant, name, w), FORMATS[name].id, k)
    torch.testing.assert_close(out, ref, rtol=1e-6, atol=1e-30)
    assert ref.abs().max() > 1e3 and (ref == 0).all(-1).any(), "extreme scales and zero rows are covered"


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name", GGUF_TYPES + OWN_TYPES)
@pytest.mark.parametrize("m", [1, 3, 4, 7])
@pytest.mark.parametrize("bits", [8, 16])
def test_packed_matmul_matches_dequantized(variant, name, m, bits):
    rows, k = 45, 768  # 45: a last group of 5 rows
    rng = np.random.default_rng(m)
    w = random_blocks(name, rows, k, rng)
    deq = _reference_dequant(name, w, rows, k).double()
    x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32)) * torch.tensor([1.0, 0.0, 1e3, 1e-3, 1, 1, 1])[
        :m, None]
    out = torch.empty(m, rows)
    quant_ops(variant).qlinear(out, x, [_packed(variant, name, w)], [FORMATS[name].id], [rows], None, 0, bits)
    # exact arithmetic on what the kernel multiplies (int8 activations): fp32 rounding apart
    xq = _quantize_activations(x, bits, bits == 8 and name in K_QUANTS).double()
    ref = xq @ deq.T
    scale = (xq.abs() @ deq.abs().T) + 1e-30
    assert ((out.double() - ref).abs() / scale).max() < 1e-5
    # against the fp32 activations: rounding x to int8 moves each product by at most 0.4% of its
    # block's largest |x| (~1e-4 of sum |x| |w| in a typical row, ~2e-3 where one block dominates)
    exact = x.double() @ deq.T
    err = ((out.double() - exact).abs() / (x.double().abs() @ deq.abs().T + 1e-30)).max()
    assert err < (1e-2 if bits == 8 else 1e-4)


@pytest.mark.parametrize("variant", VARIANTS)
def test_merged_shards_of_different_types_bias_and_bf16(variant):
    """One call over q (Q4_K), k (Q4_K) and v (Q6_K) shards, with a bias, bf16 in and out."""
    k, sizes, types = 512, [64, 32, 32], ["Q4_K", "Q4_K", "Q6_K"]
    rng = np.random.default_rng(3)
    ws = [random_blocks(t, n, k, rng) for t, n in zip(types, sizes)]
    deq = torch.cat([_reference_dequant(t, w, n, k) for t, w, n in zip(types, ws, sizes)])
    bias = torch.randn(sum(sizes))
    x = torch.randn(2, k).bfloat16()
    out = torch.empty(2, sum(sizes), dtype=torch.bfloat16)
    quant_ops(variant).qlinear(out, x, [_packed(variant, t, w) for t, w in zip(types, ws)],
                               [FORMATS[t].id for t in types], sizes, bias, 0)
    ref = _quantize_activations(x, 8, True).double() @ deq.double().T + bias.double()
    torch.testing.assert_close(out.double(), ref.bfloat16().double(), rtol=1e-2, atol=1e-2 * ref.abs().max().item())


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("types,pow2", [(["Q4_K", "Q6_K"], True), (["Q4_K", "Q8_0"], False)])
def test_8bit_codes_take_power_of_two_scales_only_for_k_quants(variant, types, pow2):
    """A merged call of K-quant shards codes activations with power-of-two scales within each
    super-block, one with any other type with a free scale per 32: each gives exactly the product
    of its codes."""
    k, sizes = 512, [24, 16]
    rng = np.random.default_rng(11)
    ws = [random_blocks(t, n, k, rng) for t, n in zip(types, sizes)]
    deq = torch.cat([_reference_dequant(t, w, n, k) for t, w, n in zip(types, ws, sizes)]).double()
    x = torch.randn(3, k)
    x[:, ::97] *= 50  # outliers: the two codings differ by far more than rounding
    out = torch.empty(3, sum(sizes))
    quant_ops(variant).qlinear(out, x, [_packed(variant, t, w) for t, w in zip(types, ws)],
                               [FORMATS[t].id for t in types], sizes, None, 0, 8)
    xq = _quantize_activations(x, 8, pow2).double()
    assert ((out.double() - xq @ deq.T).abs() / (xq.abs() @ deq.abs().T + 1e-30)).max() < 1e-5


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_many_rows_go_through_the_dense_gemm(variant, dtype):
    k, rows, m = 256, 40, 9
    w = random_blocks("Q4_1", rows, k, np.random.default_rng(5))
    deq = _reference_dequant("Q4_1", w, rows, k)
    x = torch.randn(m, k).to(dtype)
    out = torch.empty(m, rows, dtype=dtype)
    quant_ops(variant).qlinear(out, x, [_packed(variant, "Q4_1", w)], [FORMATS["Q4_1"].id], [rows], None, 8)
    torch.testing.assert_close(out, torch.nn.functional.linear(x, deq.to(dtype)), rtol=2e-2, atol=1e-2)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name", GGUF_TYPES + OWN_TYPES)
def test_dequantize_to_bf16_rounds_each_float_to_nearest_even(variant, name):
    """The bf16 slabs of the many-row path: each weight as its float value rounded to nearest even,
    rows of a partial last group and a slice of rows starting inside a group included."""
    rows, k = 37, 512
    packed = _packed(variant, name, random_blocks(name, rows, k, np.random.default_rng(7)))
    ops, qt = quant_ops(variant), FORMATS[name].id
    f32, b16 = torch.empty(rows, k), torch.empty(rows, k, dtype=torch.bfloat16)
    ops.dequantize(f32, packed, qt, k)
    ops.dequantize(b16, packed, qt, k)
    assert torch.equal(b16.view(torch.int16), f32.bfloat16().view(torch.int16))


@pytest.mark.parametrize("variant", VARIANTS)
def test_embedding_rows(variant):
    k, vocab = 256, 50
    w = random_blocks("Q6_K", vocab, k, np.random.default_rng(6))
    deq = _reference_dequant("Q6_K", w, vocab, k)
    ids = torch.tensor([3, 0, 49, 3])
    out = torch.empty(4, k)
    packed = _packed(variant, "Q6_K", w)
    quant_ops(variant).embedding(out, ids, packed, FORMATS["Q6_K"].id, k)
    torch.testing.assert_close(out, deq[ids], rtol=1e-6, atol=0)
    with pytest.raises(RuntimeError, match="out of range"):
        quant_ops(variant).embedding(out[:1], torch.tensor([56]), packed, FORMATS["Q6_K"].id, k)


def test_row_bytes_match_gguf():
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    for name in GGUF_TYPES:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
        assert row_bytes(FORMATS[name].id, 1024) == 1024 // block * size


# Where each format's codes lie in a block (GGUF's layouts): all set, every code is its format's largest.
_CODE_BYTES = {"Q4_0": (2, 18), "Q4_1": (4, 20), "Q5_0": (2, 22), "Q5_1": (4, 24), "Q4_K": (16, 144),
               "Q5_K": (16, 176), "Q6_K": (0, 192), "Q8_0": (2, 34)}
_LARGEST = {"Q8_0": 0x80}  # -128: signed codes are largest in magnitude at their most negative


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name", list(_CODE_BYTES))
@pytest.mark.parametrize("bits", [8, 16])
def test_largest_codes_against_largest_activations(variant, name, bits):
    """The AVX2 kernel adds several pairs of code products in 16 bits before widening them (8 for
    4-bit codes, 4 for 5-bit, 2 for 6-bit): with every weight code at its largest and every
    activation code at +-127 those sums are at their largest, and still exact. Q8_0's 16-bit codes
    are products of 16-bit activations in int32 (a third row alternates their signs)."""
    rows, k = 16, 512
    w = random_blocks(name, rows, k, np.random.default_rng(13))
    f = FORMATS[name]
    lo, hi = _CODE_BYTES[name]
    w.reshape(rows, -1, f.bytes)[:, :, lo:hi] = _LARGEST.get(name, 0xFF)
    x = torch.ones(3, k)
    x[1] = -1.0
    x[2, 1::2] = -1.0
    out = torch.empty(3, rows)
    quant_ops(variant).qlinear(out, x, [_packed(variant, name, w)], [f.id], [rows], None, 0, bits)
    deq = _reference_dequant(name, w, rows, k).double()
    ref = x.double() @ deq.T
    assert ((out.double() - ref).abs() / (x.double().abs() @ deq.abs().T + 1e-30)).max() < 1e-5


# Every variant and format through 1-17 rows, both codes: a digest of the results (run in a child).
_DIGEST = """
import hashlib, numpy as np, torch
from tokenmill.model.layers.quantization.formats import FORMATS, random_blocks
from tokenmill.model.quant_kernels import quant_ops, supported_variants
h = hashlib.sha256()
for variant in supported_variants():
    ops, rng = quant_ops(variant), np.random.default_rng(0)
    for name in {names}:
        qt, k = FORMATS[name].id, 3 * 256
        w = ops.repack(torch.from_numpy(random_blocks(name, 40, k, rng)), qt, 40, k)
        for m in (1, 3, 16, 17):
            x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
            for bits in (8, 16):
                out = torch.empty(m, 40)
                ops.qlinear(out, x, [w], [qt], [40], None, 0, bits)
                h.update(out.numpy().tobytes())
print(h.hexdigest())
"""


def test_products_read_only_what_they_wrote():
    """The activation codes and row tiles live in buffers that are not zeroed first: with glibc
    filling every new allocation with a byte pattern (MALLOC_PERTURB_), two patterns give the same
    results to the bit."""
    import os
    import subprocess
    import sys

    script = _DIGEST.format(names=GGUF_TYPES + OWN_TYPES)
    digests = {subprocess.run([sys.executable, "-c", script], env={**os.environ, "MALLOC_PERTURB_": p},
                              capture_output=True, text=True, check=True, timeout=600).stdout.strip()
               for p in ("85", "170")}
    assert len(digests) == 1 and len(next(iter(digests))) == 64, digests

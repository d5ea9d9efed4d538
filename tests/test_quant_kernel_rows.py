"""The packed kernels give every row the same result however it is computed: alone or with others
(the rows of a decode batch, a verification or a prompt), and at any prefetch distance and level."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.test_quant_kernels import GGUF_TYPES, OWN_TYPES, VARIANTS, _packed
from tokenmill.model.layers.quantization.formats import FORMATS, random_blocks
from tokenmill.model.quant_kernels import quant_kernels_available, quant_ops

pytestmark = pytest.mark.skipif(not quant_kernels_available(), reason="no C++ toolchain")


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name", ["Q4_K", "Q6_K"])
def test_prefetch_distance_changes_no_result(variant, name):
    """The packed kernels' prefetch distance and cache level (set per CPU vendor at load) only move
    reads earlier: with 8- and 16-bit codes (AVX2 runs Q4_K's 8-bit codes in its super-block kernel),
    and with rows in one pass (prefetched) and in two (the second reads from cache)."""
    from tokenmill.model.quant_kernels import prefetch_ahead, prefetch_level

    rows, k = 72, 1536
    rng = np.random.default_rng(8)
    w = random_blocks(name, rows, k, rng)
    ops, qt = quant_ops(variant), FORMATS[name].id
    packed = _packed(variant, name, w)
    x = torch.from_numpy(rng.standard_normal((9, k)).astype(np.float32))
    cases = [(m, bits) for m in (1, 3, 9) for bits in (8, 16)]
    outs = []
    try:
        for dist in (0, 64, 1024, 4096, 1 << 20):
            for level in (1, 2):
                ops.set_prefetch_ahead(dist, level)
                for m, bits in cases:
                    out = torch.empty(m, rows)
                    ops.qlinear(out, x[:m], [packed], [qt], [rows], None, 0, bits)
                    outs.append(out)
    finally:
        ops.set_prefetch_ahead(prefetch_ahead(), prefetch_level())
    for i, out in enumerate(outs):
        assert torch.equal(out, outs[i % len(cases)]), i


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name", GGUF_TYPES + OWN_TYPES)
@pytest.mark.parametrize("bits", [8, 16])
def test_few_rows_match_one_row_at_a_time(variant, name, bits):
    """M rows in one call give each row exactly what it gets alone (what --batch-invariant relies
    on): the rows share each decoded weight chunk (up to 8 rows with AVX-512, 4 on AVX2) but not
    their arithmetic. Odd shapes: 45 and 13 output rows (a lone last group of 8, a partial one),
    K of one to three blocks; a zero row and a large one."""
    ops, qt = quant_ops(variant), FORMATS[name].id
    rng = np.random.default_rng(11)
    for rows, k in [(45, 3 * FORMATS[name].block), (13, FORMATS[name].block * (2 if FORMATS[name].block < 256 else 1))]:
        packed = _packed(variant, name, random_blocks(name, rows, k, rng))
        x = torch.from_numpy(rng.standard_normal((16, k)).astype(np.float32))
        x[1] = 0.0
        x[2] *= 1e3
        single = torch.empty(16, rows)
        for i in range(16):
            ops.qlinear(single[i:i + 1], x[i:i + 1], [packed], [qt], [rows], None, 0, bits)
        for m in (1, 2, 3, 5, 8, 13, 16):
            out = torch.empty(m, rows)
            ops.qlinear(out, x[:m], [packed], [qt], [rows], None, 0, bits)
            assert torch.equal(out, single[:m]), f"{m} rows"


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("name", ["Q4_K", "Q6_K"])
@pytest.mark.parametrize("bits", [8, 16])
def test_many_rows_in_blocks_match_one_row_at_a_time(variant, name, bits):
    """Prefill-sized products: at K = 8960 the AVX-512 kernel splits 97 rows into blocks that stay in
    L2 (40, 40, 17 rows) and tiles of 8, 8, ..., 6, 6, 5, the AVX2 one into 13 blocks of 7-8 rows (25
    of 3-4 with 16-bit codes); every row still gets what it gets alone."""
    ops, qt = quant_ops(variant), FORMATS[name].id
    rng = np.random.default_rng(12)
    rows, k, m = 21, 8960, 97
    packed = _packed(variant, name, random_blocks(name, rows, k, rng))
    x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32))
    out = torch.empty(m, rows)
    ops.qlinear(out, x, [packed], [qt], [rows], None, 0, bits)
    for i in (0, 7, 8, 39, 40, 63, 80, 91, 96):
        single = torch.empty(1, rows)
        ops.qlinear(single, x[i:i + 1], [packed], [qt], [rows], None, 0, bits)
        assert torch.equal(out[i:i + 1], single), f"row {i}"

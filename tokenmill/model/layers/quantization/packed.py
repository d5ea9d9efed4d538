"""The linear method of weights kept packed (GGUF blocks, tokenmill's int8/int4): one flat byte
parameter holds every shard's rows in its own format, and one kernel call multiplies by all of
them (quant_gemm.cpp).

Policy for the product x[M, K] . W^T, by the number of rows M:
- M < dense_min_rows: the packed kernel (int8 activations, integer dot products); it reads the
  weights once per call, as stored, which is what decoding at low concurrency is bound by;
- M >= dense_min_rows: dequantize W slab by slab and run the dense GEMM (oneDNN, AMX where the
  CPU has it), which wins once each weight is reused by enough rows, if it does at all.
The crossover is measured per kind of CPU, and where it moved with them per activation precision and
weight format (benchmarks/quant_crossover.py, BENCHMARKS.md); --quant-dense-min-rows sets it for
every layer. None in the tables: the packed kernel at every row count. In
batch-invariant mode every product takes the packed kernel, which computes each row the same way
whatever the batch (so where the policy is None, packed weights are row-invariant anyway).
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.errors import ConfigError
from tokenmill.model.layers.quantization.base import LinearMethod
from tokenmill.model.layers.quantization.formats import BY_ID, row_bytes
from tokenmill.model.layers.quantization.huge_pages import packed_weight_storage
from tokenmill.model.quant_kernels import quant_ops
from tokenmill.utils.cpu import active_isa, cpu_family, cpu_model_number, cpu_vendor

# measured crossovers (rows) per ISA level: see BENCHMARKS.md, "Quantized GEMM crossover".
# avx512_bf16 (a Xeon without AMX, 2026-11-22): the packed kernel is faster than dequant+GEMM, and
# than oneDNN's bf16 GEMM on a dense copy, at every row count up to 2048 (the default step budget)
# but Q6_K at 2048 (a tie), so it runs everything. avx512 (no VNNI; 2026-11-23, capped on the same
# Xeon): packed wins at every row count up to 512 too. avx2 (capped, fp32, oneDNN capped to AVX2,
# 2026-11-23): dequant+GEMM wins from 128 rows on three of four shapes (256 on the fourth).
# scalar: not re-measured since the x8 layout and the 16-row AVX-512 kernel. amx: never measured with
# these kernels, so measured at load (crossover.py); None is only its fallback (tensor or pipeline
# parallelism), the safer way to be wrong: dequantizing for a few rows costs several times more.
DENSE_MIN_ROWS: dict[str, int | None] = {"scalar": 1, "avx2": 128, "avx512": None, "avx512_bf16": None, "amx": None}
# CPU kinds whose crossover differs from their level's. AMD EPYC (Zen 5) with AVX512-BF16 and no AMX
# (2026-11-25): its oneDNN bf16 GEMM runs 1.2-2x the packed kernel's rate from 64 rows, and with the
# SIMD dequantization (quant_dequant.h) dequant+GEMM wins from 128 rows on three of four shapes
# (256 on Qwen-1.5B's gate_up, within 8% at 128), by up to 1.6x at 512. An AMD EPYC with AVX2 only
# (2026-11-28, fp32, SmolLM2's Q4_1 shapes with 16-bit codes): packed 1.2-1.3x at 128 rows, even at
# 512-2048; its Q8_0 head packed at every row count (1.1x at 2048).
DENSE_MIN_ROWS_BY_VENDOR: dict[tuple[str, str], int | None] = {("AuthenticAMD", "avx512_bf16"): 128,
                                                               ("AuthenticAMD", "avx2"): 512}
# The same CPU kinds with 8-bit activation codes (half the packed kernel's integer work), per weight
# format; a format not listed: the packed kernel at every row count. AMD EPYC (2026-11-26, 8960x1536):
# packed is 1.1-1.3x dequant+GEMM at 2048 rows for every format but those whose 5th/6th bits are
# added from bit planes (Q5_0, Q5_1, Q6_K), where dequant+GEMM wins by 1.1-1.2x from 512. Since
# the 32-weight block kernels are fully unrolled (quant_zmm.h, static_for), Q5_0 and Q5_1 (9728x896)
# are packed-faster at 512 rows (1.06-1.07x) and tie at 1024.
# An AMD EPYC Zen 4 (family 25; 2026-11-27), whose 512-bit operations take two cycles: packed is
# 1.05-1.6x dequant+GEMM for Q4_K, Q4_1 and Q5_0 at 512-2048 rows, and for Q6_K at 512 (1.13x) and 1024
# (1.02x); at 2048 Q6_K went either way (1.02x, 0.77x) until its chains started at the -32 offset
# (2026-12-05): 1.19-1.28x at 2048 in three runs, both Qwen shapes. An AMD EPYC with AVX2 only (a Zen 4 VM without
# AVX-512; 2026-11-28, fp32): packed is 1.1-2.0x dequant+GEMM at 128-2048 rows for Q4_1, Q4_K, Q5_0
# and Q6_K, but for the 0.5B's Q6_K down at 2048 (0.90x). A Zen 3 EPYC (family 25 model 1, AVX2 only;
# 2026-11-29, fp32): packed is 1.05-1.38x dequant+GEMM for both Q6_K downs at 2048 rows (1.05-1.6x at
# 128-1024), 1.3-2.3x for Q4_K and Q5_0. Keys with a model number come first, then with a family.
DENSE_MIN_ROWS_8BIT_BY_VENDOR: dict[tuple[str, ...], dict[str, int]] = {
    ("AuthenticAMD", "avx2", "25", "1"): {},
    ("AuthenticAMD", "avx512_bf16", "25"): {},
    ("AuthenticAMD", "avx512_bf16"): {"Q5_0": 1024, "Q5_1": 1024, "Q6_K": 512},
    ("AuthenticAMD", "avx2"): {"Q6_K": 2048}}


def default_dense_min_rows(act_bits: int | str = 16, qtype: int | None = None) -> int:
    """The active ISA's crossover on this CPU kind for these activation codes ("auto": as 16 until
    measured) and weight format; 0: never dequantize (what qlinear takes as "no dense path")."""
    level = active_isa()
    kind = (cpu_vendor(), level)
    if act_bits == 8:
        for key in (kind + (cpu_family(), cpu_model_number()), kind + (cpu_family(),), kind):
            if key in DENSE_MIN_ROWS_8BIT_BY_VENDOR:
                return DENSE_MIN_ROWS_8BIT_BY_VENDOR[key].get(BY_ID[qtype].name if qtype is not None else "", 0)
    return DENSE_MIN_ROWS_BY_VENDOR.get(kind, DENSE_MIN_ROWS[level]) or 0


class PackedLinearMethod(LinearMethod):
    """Weights stored packed in `qtypes` (one format per shard)."""

    # bumped whenever any layer's codes or outlier channels change: plans that copied them (the fused
    # decode layers, the draft loop) are rebuilt
    settings_version = 0

    def __init__(self, qtypes: list[int], dense_min_rows: int | None = None, act_bits: int | str = 16):
        self.qtypes = list(qtypes)
        self.main_qtype = self.qtypes[0]  # the format of most of the weight's bytes, once loaded
        # --quant-dense-min-rows; None: the measured crossover; "measure": measured at load (crossover.py)
        self.fixed_dense_min_rows = dense_min_rows
        self.ops = quant_ops()
        self.set_act_bits(act_bits)

    def set_act_bits(self, bits: int | str) -> None:
        """The activation codes (8, 16, or "auto" before act_bits.py measures it), and the crossover
        that goes with them."""
        self.act_bits = bits
        PackedLinearMethod.settings_version += 1
        fixed = self.fixed_dense_min_rows
        self.dense_min_rows = default_dense_min_rows(bits, self.main_qtype) if fixed in (None, "measure") else fixed

    def create_weights(self, layer, in_features, shard_sizes, dtype, device) -> None:
        if len(shard_sizes) != len(self.qtypes):
            raise ConfigError(f"{len(shard_sizes)} shards but {len(self.qtypes)} formats")
        for qt in self.qtypes:
            if in_features % BY_ID[qt].block:
                raise ConfigError(f"{BY_ID[qt].name} weights need an input size that is a multiple of "
                                  f"{BY_ID[qt].block}, got {in_features}")
        # each shard in the kernels' x8 layout: the loader repacks it there from the GGUF's rows
        sizes = [self.ops.x8_bytes(qt, n, in_features) for n, qt in zip(shard_sizes, self.qtypes)]
        layer.q_rows = list(shard_sizes)
        layer.q_out = sum(shard_sizes)
        layer.q_offsets = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
        layer.q_in = in_features
        layer.weight = nn.Parameter(packed_weight_storage(layer.q_offsets[-1], device),
                                    requires_grad=False)
        layer.weight.weight_loader = self._loader(layer)
        layer.q_views = None
        layer.q_outliers = None

    def narrow_columns(self, layer, loaded, start, size, shard_id=None):
        """Raw rows [rows, bytes]: the bytes of whole blocks (the QuantConfig chose a dense method
        where a split would cut one)."""
        f = BY_ID[self.qtypes[list(layer.shard_slices).index(shard_id) if shard_id is not None else 0]]
        if f.row_head or start % f.block or size % f.block:
            raise ConfigError(f"cannot split {f.name} weights at input columns {start}..{start + size}")
        return loaded.narrow(1, start // f.block * f.bytes, size // f.block * f.bytes)

    def _loader(self, layer):
        def load(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
            loaded = layer.local_part(loaded, shard_id)
            i = list(layer.shard_slices).index(shard_id) if shard_id is not None else 0
            qt, n = self.qtypes[i], layer.q_rows[i]
            if loaded.dtype != torch.uint8 or loaded.numel() != n * row_bytes(qt, layer.q_in):
                raise ConfigError(f"packed weight shard {shard_id!r}: got {loaded.dtype} x {loaded.numel()}, "
                                  f"expected {n * row_bytes(qt, layer.q_in)} bytes of {BY_ID[qt].name}")
            # straight from the mapped file into the x8 layout: no staging copy of ~1 GB (Qwen-1.5B)
            self.ops.repack_into(param.data[layer.q_offsets[i]:layer.q_offsets[i + 1]],
                                 loaded.contiguous().reshape(-1), qt, n, layer.q_in)

        return load

    def process_weights_after_loading(self, layer) -> None:
        """The loader wrote every shard in the kernels' x8 layout: views of the shards, and the
        crossover of the format most of the bytes are in."""
        sizes = [b - a for a, b in zip(layer.q_offsets, layer.q_offsets[1:])]
        self.shard_views(layer)
        self.main_qtype = max(zip(sizes, self.qtypes))[1]
        self.set_act_bits(self.act_bits)

    def process_raw_rows(self, layer) -> None:
        """For a weight that holds rows as quantized (GGUF's row layout, shard after shard at
        q_offsets), not through the loader: quantized at load, a draft's reduced vocabulary. Repacks
        them into one new flat tensor (as the loader does), then as process_weights_after_loading."""
        flat = layer.weight.data
        sizes = [self.ops.x8_bytes(qt, n, layer.q_in) for qt, n in zip(self.qtypes, layer.q_rows)]
        offsets = [sum(sizes[:i]) for i in range(len(sizes) + 1)]
        x8 = packed_weight_storage(offsets[-1], flat.device)  # on huge pages, as the loader's
        for i, (qt, n) in enumerate(zip(self.qtypes, layer.q_rows)):
            self.ops.repack_into(x8[offsets[i]:offsets[i + 1]], flat[layer.q_offsets[i]:layer.q_offsets[i + 1]],
                                 qt, n, layer.q_in)
        layer.q_offsets = offsets
        layer.weight = nn.Parameter(x8, requires_grad=False)
        PackedLinearMethod.process_weights_after_loading(self, layer)

    @staticmethod
    def shard_views(layer) -> list[torch.Tensor]:
        flat = layer.weight.data
        layer.q_views = [flat[a:b] for a, b in zip(layer.q_offsets, layer.q_offsets[1:])]
        return layer.q_views

    def apply(self, layer, x, bias, out_dtype=None):
        if not x.is_contiguous():
            x = x.contiguous()
        out = torch.empty(x.shape[0], layer.q_out, dtype=out_dtype or x.dtype)
        dense = 0 if layer.row_tile is not None else self.dense_min_rows
        self.ops.qlinear(out, x, layer.q_views, self.qtypes, layer.q_rows, bias, dense, self.act_bits,
                         *self.outliers(layer))
        return out

    def outliers(self, layer) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The outlier channels qlinear takes with 8-bit codes (csrc/quant_outliers.h): (columns, W's
        columns as [n, out + 16] fp32), or (None, None)."""
        found = getattr(layer, "q_outliers", None)
        return found if found is not None and self.act_bits == 8 else (None, None)

    def set_outliers(self, layer, columns: list[int] | None) -> None:
        """Leaves these input columns out of the 8-bit codes of `layer`'s products and adds them back
        exactly, from W's columns dequantized here a slab of rows at a time (act_bits.py)."""
        PackedLinearMethod.settings_version += 1
        if not columns:
            layer.q_outliers = None
            return
        if len(set(columns)) != len(columns) or not all(0 <= c < layer.q_in for c in columns):
            raise ValueError(f"outlier columns must be distinct, in [0, {layer.q_in}): {columns}")
        cols = torch.tensor(sorted(columns), dtype=torch.long)
        w = torch.zeros(len(cols), layer.q_out + 16)
        first, slab = 0, 4096  # rows: a multiple of the x8 layout's groups of 8
        for view, qt, n in zip(layer.q_views, self.qtypes, layer.q_rows):
            group = self.ops.x8_bytes(qt, 8, layer.q_in)
            for r0 in range(0, n, slab):
                r1 = min(n, r0 + slab)
                dense = torch.empty(r1 - r0, layer.q_in)
                self.ops.dequantize(dense, view[r0 // 8 * group:(r1 + 7) // 8 * group], qt, layer.q_in)
                w[:, first + r0:first + r1] = dense[:, cols].t()
            first += n
        layer.q_outliers = (cols, w)

    def plan_lists(self, layer) -> tuple[list[torch.Tensor], list[int]]:
        """What decode_layers.cpp's Packed::read takes for this layer: the tensors and the ints of its
        qlinear calls."""
        cols, w = self.outliers(layer)
        tensors = [] if cols is None else [cols, w]
        ints = [self.dense_min_rows, self.act_bits, int(cols is not None), len(layer.q_views)]
        for view, qt, rows in zip(layer.q_views, self.qtypes, layer.q_rows):
            tensors.append(view)
            ints += [qt, rows]
        return tensors, ints

    def embed(self, layer, ids, dtype):
        out = torch.empty(ids.shape[0], layer.q_in, dtype=dtype, device=ids.device)
        self.ops.embedding(out, ids, layer.weight.data, self.qtypes[0], layer.q_in)
        return out

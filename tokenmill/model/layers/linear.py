"""Linear layers that load their own weights, including merged ones (qkv, gate+up) that take shards.

How a layer stores and multiplies its weight is its `method` (layers/quantization): today's dense
weights (`UnquantizedLinearMethod`, below) unless the model's QuantConfig picks another one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill import distributed
from tokenmill.distributed.partition import HeadShard
from tokenmill.errors import ConfigError
from tokenmill.model.layers.batch_invariance import in_row_tiles
from tokenmill.model.layers.quantization.base import LinearMethod, QuantConfig


def default_weight_loader(param: nn.Parameter, loaded, shard_id=None) -> None:
    """Copies a whole checkpoint tensor (a torch tensor or a lazy safetensors slice) into `param`."""
    if tuple(param.shape) != tuple(loaded.shape):
        raise ConfigError(f"weight shape {tuple(loaded.shape)} does not match parameter {tuple(param.shape)}")
    param.data.copy_(loaded.to(param.dtype))


def _param(shape: tuple[int, ...], dtype: torch.dtype, device, loader) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
    p.weight_loader = loader
    return p


def shard_rows_loader(layer: Linear):
    """Loads a checkpoint shard (q, k, v / gate, up) into its row range of a merged parameter,
    taking only this rank's part of it under tensor parallelism."""

    def load(param: nn.Parameter, loaded, shard_id=None) -> None:
        if shard_id is None and len(layer.shard_slices) > 1:  # already merged in the checkpoint
            if layer.tp_size > 1:
                raise ConfigError("a checkpoint with merged projections cannot be split over ranks yet")
            default_weight_loader(param, loaded)
            return
        loaded = layer.local_part(loaded, shard_id)
        target = param.data[layer.shard_slices[shard_id]]
        if tuple(target.shape) != tuple(loaded.shape):
            raise ConfigError(f"shard {shard_id!r}: shape {tuple(loaded.shape)} != {tuple(target.shape)}")
        target.copy_(loaded.to(param.dtype))

    return load


class UnquantizedLinearMethod(LinearMethod):
    """Dense weights in the model dtype. On CPU the weight goes to oneDNN pre-packed: in bf16 1.3-2x
    faster GEMMs at the small batch sizes of decoding; in fp32 on an AMD EPYC 2.5-5x faster than
    F.linear (MKL), and a row's result, in tiles of 2-32 rows, does not depend on the rows beside it,
    which MKL's does from 4 rows (batch_invariance.py). `keep_plain` keeps the plain weight as well
    (an LM head whose weight the embedding shares: the head's packed copy costs its size again, and
    pays, since one row through MKL's head was the slowest product of an fp32 step); otherwise the
    plain weight is dropped after packing."""

    def __init__(self, keep_plain: bool = False):
        self.keep_plain = keep_plain

    def create_weights(self, layer, in_features, shard_sizes, dtype, device) -> None:
        layer.weight = _param((sum(shard_sizes), in_features), dtype, device, shard_rows_loader(layer))

    def process_weights_after_loading(self, layer) -> None:
        layer.packed_weight = prepack(layer.weight)
        if layer.packed_weight is not None and not self.keep_plain:
            layer.weight.data = torch.empty(0, dtype=layer.weight.dtype)

    def apply(self, layer, x, bias, out_dtype=None):
        if layer.packed_weight is not None:
            y = torch.ops.mkldnn._linear_pointwise(x, layer.packed_weight, bias, "none", [], "")
        elif (x.dtype == layer.weight.dtype == torch.bfloat16 and getattr(layer, "row_tile", None) is None
              and x.numel() >= _BF16_IN_FP32_MIN_ROWS * x.shape[-1]):
            y = bf16_linear_in_fp32_slabs(x, layer.weight, bias)
        else:
            y = F.linear(x, layer.weight, bias)
        return y if out_dtype is None else y.to(out_dtype)

    def embed(self, layer, ids, dtype):
        return F.embedding(ids, layer.weight)


class Linear(nn.Module):
    """y = x W^T (+ b). The weight is [out_features, in_features] as in Hugging Face checkpoints.
    `prefix` is the layer's checkpoint name, by which a QuantConfig chooses its method.

    Tensor parallelism (`parallel`): "column" keeps rows `row_ranges[shard]` (start, size) of each
    checkpoint shard, and the output stays split; "row" keeps input columns `in_range` (start, size)
    and all-reduces the output (the bias is added once, after the sum). `in_features` and the shard
    sizes are this rank's."""

    packed_weight: torch.Tensor | None = None  # the unquantized method's oneDNN-packed weight
    row_tile: int | None = None  # batch-invariant mode: GEMMs in fixed row tiles

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 dtype: torch.dtype = torch.float32, device=None, quant_config: QuantConfig | None = None,
                 prefix: str = "", shard_names: dict | None = None, parallel: str | None = None,
                 row_ranges: dict | None = None, in_range: tuple[int, int] | None = None):
        super().__init__()
        self.parallel = parallel
        self.tp_size = distributed.state().tp_size if parallel else 1
        self.row_ranges = row_ranges or {}
        self.in_range = in_range
        if parallel == "row" and in_range is not None:
            in_features = in_range[1]
        self.in_features, self.out_features = in_features, out_features
        self.dtype = dtype  # of activations; the weight's own dtype depends on the method
        names = shard_names or {None: prefix}
        sizes = getattr(self, "_shard_sizes", {None: out_features})
        self.shard_slices: dict = {}
        start = 0
        for shard_id, size in sizes.items():
            self.shard_slices[shard_id] = slice(start, start + size)
            start += size
        split = in_range if parallel == "row" and self.tp_size > 1 else None
        self.method = (quant_config.linear_method([names[s] for s in sizes], in_range=split)
                       if quant_config is not None else UnquantizedLinearMethod())
        self.method.create_weights(self, in_features, list(sizes.values()), dtype, device)
        self.bias = _param((out_features,), dtype, device, shard_rows_loader(self)) if bias else None

    def local_part(self, loaded, shard_id):
        """This rank's part of a checkpoint tensor of this layer (weight or bias)."""
        if self.tp_size == 1:
            return loaded
        if self.parallel == "column":
            start, size = self.row_ranges[shard_id]
            return loaded.narrow(0, start, size)
        if len(loaded.shape) == 1:  # a row-parallel layer's bias is whole
            return loaded
        return self.method.narrow_columns(self, loaded, *self.in_range, shard_id)

    def process_weights_after_loading(self) -> None:
        self.method.process_weights_after_loading(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.parallel == "row" and self.tp_size > 1:
            y = distributed.tp_all_reduce(in_row_tiles(self._matmul_no_bias, x, self.row_tile))
            return y if self.bias is None else y + self.bias
        return in_row_tiles(self._matmul, x, self.row_tile)

    def _matmul(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x, self.bias)

    def _matmul_no_bias(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x, None)


# Below oneDNN's bf16 GEMM (plain AVX2), F.linear's bf16 GEMM runs ~0.2 ms a row on 3072 x 576 (8 G
# multiply-adds/s, 2 Zen 3 cores): from 4 rows, converting ~4 MiB weight slabs to fp32 for the fp32
# GEMM costs less (8 rows 1.7x, 64 rows 4.6x, 256 rows 7.4x faster; BENCHMARKS.md). Not in
# batch-invariant mode: a row's sums would then depend on its tile's row count.
_BF16_IN_FP32_MIN_ROWS = 4
_SLAB_BYTES = 4 << 20


def bf16_linear_in_fp32_slabs(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x W^T (+ b) for bf16 x and W, in fp32 GEMMs over row slabs of W converted one at a time (the
    whole weight in fp32 would be a second copy, twice its size); the result rounded to bf16."""
    x32 = x.reshape(-1, x.shape[-1]).float()
    out = torch.empty(x32.shape[0], weight.shape[0], dtype=torch.bfloat16, device=x.device)
    step = max(8, _SLAB_BYTES // (4 * weight.shape[1]))
    for r0 in range(0, weight.shape[0], step):
        b = None if bias is None else bias[r0:r0 + step].float()
        out[:, r0:r0 + step] = F.linear(x32, weight[r0:r0 + step].float(), b)
    return out.reshape(*x.shape[:-1], weight.shape[0])


def prepack(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's pre-packed copy of a bf16 or fp32 CPU weight, or None where oneDNN has no GEMM of that
    dtype for this CPU (bf16 needs AVX-512 or AVX-NE-CONVERT; plain AVX2 runs bf16 through F.linear)."""
    if not (weight.device.type == "cpu" and weight.dtype in (torch.bfloat16, torch.float32)
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.data)
    except RuntimeError:
        return None


class MergedLinear(Linear):
    """Several projections of the same input fused into one GEMM; checkpoints store them apart, so
    each shard is loaded into its row range. `shard_names` maps each shard id to its checkpoint
    name (for the QuantConfig: shards of one layer may come in different formats). Column-parallel
    when `row_ranges` is given: shard sizes are then this rank's rows."""

    def __init__(self, in_features: int, shard_sizes: dict, bias: bool = False,
                 dtype: torch.dtype = torch.float32, device=None, quant_config: QuantConfig | None = None,
                 shard_names: dict | None = None, row_ranges: dict | None = None):
        self._shard_sizes = dict(shard_sizes)
        names = shard_names or {s: str(s) for s in shard_sizes}
        super().__init__(in_features, sum(shard_sizes.values()), bias, dtype, device, quant_config,
                         shard_names=names, parallel="column" if row_ranges else None, row_ranges=row_ranges)


class QKVLinear(MergedLinear):
    """q, k and v of this rank's heads (all of them without tensor parallelism)."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, dtype: torch.dtype = torch.float32, device=None,
                 quant_config: QuantConfig | None = None, prefix: str = "", heads: HeadShard | None = None):
        heads = heads or HeadShard(0, num_heads, 0, num_kv_heads)
        self.q_size, self.kv_size = heads.num_heads * head_dim, heads.num_kv_heads * head_dim
        names = {s: f"{prefix}.{s}_proj" for s in ("q", "k", "v")}
        kv = (heads.kv_start * head_dim, self.kv_size)
        ranges = {"q": (heads.q_start * head_dim, self.q_size), "k": kv, "v": kv}
        super().__init__(hidden_size, {"q": self.q_size, "k": self.kv_size, "v": self.kv_size},
                         bias, dtype, device, quant_config, names, row_ranges=ranges)

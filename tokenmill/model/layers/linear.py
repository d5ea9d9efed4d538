"""Linear layers that load their own weights, including merged ones (qkv, gate+up) that take shards."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.errors import ConfigError


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
    if param.shape != loaded.shape:
        raise ConfigError(f"weight shape {tuple(loaded.shape)} does not match parameter {tuple(param.shape)}")
    param.data.copy_(loaded)


def _param(shape: tuple[int, ...], dtype: torch.dtype, device, loader) -> nn.Parameter:
    p = nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)
    p.weight_loader = loader
    return p


class Linear(nn.Module):
    """y = x W^T (+ b). The weight is [out_features, in_features] as in Hugging Face checkpoints."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = _param((out_features, in_features), dtype, device, self.weight_loader)
        self.bias = _param((out_features,), dtype, device, self.weight_loader) if bias else None

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        default_weight_loader(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Several projections of the same input fused into one GEMM; checkpoints store them apart, so
    each shard is loaded into its row range."""

    def __init__(self, in_features: int, shard_sizes: dict, bias: bool = False,
                 dtype: torch.dtype = torch.float32, device=None):
        super().__init__(in_features, sum(shard_sizes.values()), bias, dtype, device)
        self.shard_slices: dict = {}
        start = 0
        for shard_id, size in shard_sizes.items():
            self.shard_slices[shard_id] = slice(start, start + size)
            start += size

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id=None) -> None:
        if shard_id is None:  # already merged in the checkpoint
            default_weight_loader(param, loaded)
            return
        rows = self.shard_slices[shard_id]
        target = param.data[rows]
        if target.shape != loaded.shape:
            raise ConfigError(f"shard {shard_id!r}: shape {tuple(loaded.shape)} != {tuple(target.shape)}")
        target.copy_(loaded)


class QKVLinear(MergedLinear):
    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, dtype: torch.dtype = torch.float32, device=None):
        self.q_size, self.kv_size = num_heads * head_dim, num_kv_heads * head_dim
        super().__init__(hidden_size, {"q": self.q_size, "k": self.kv_size, "v": self.kv_size},
                         bias, dtype, device)

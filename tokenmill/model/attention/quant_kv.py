"""A KV cache stored in another dtype than the model's: int8, fp8 e4m3 or e5m2 with a float scale per
token and kv head (about half the bytes of bf16), or bf16 under an fp32 model. The cpu_paged
backend writes it with `kv_write_quant` and its decode kernel reads it in place; prefill chunks
that attend to cached context gather and dequantize the blocks they need."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.config.engine import SCALED_KV_CACHE_DTYPES
from tokenmill.errors import ConfigError
from tokenmill.utils.memory import zeros

STORAGE = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2,
           "bfloat16": torch.bfloat16}
SCALED = tuple(STORAGE[name] for name in SCALED_KV_CACHE_DTYPES)  # codes with a float scale per token and kv head


@dataclass
class QuantizedKVCache:
    data: torch.Tensor  # [2, num_blocks, block_size, Hkv, D]
    scale: torch.Tensor  # [2, num_blocks, block_size, Hkv] float32; empty when unscaled (bf16)

    def __getitem__(self, i: int) -> torch.Tensor:  # K (0) or V (1), dequantization is the reader's job
        return self.data[i]


def storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype | None:
    """The cache's element dtype, or None for a plain cache in the model dtype."""
    if kv_cache_dtype == "auto" or STORAGE[kv_cache_dtype] == model_dtype:
        return None
    if model_dtype not in (torch.float32, torch.bfloat16):
        raise ConfigError(f"kv_cache_dtype={kv_cache_dtype} needs a float32 or bfloat16 model, not {model_dtype}",
                          param="kv_cache_dtype")
    return STORAGE[kv_cache_dtype]


def bytes_per_token_head(storage: torch.dtype | None, model_dtype: torch.dtype, head_dim: int) -> int:
    """K or V of one token and kv head, scale included."""
    if storage is None:
        return head_dim * model_dtype.itemsize
    scale = 4 if storage in SCALED else 0
    return head_dim * storage.itemsize + scale


def allocate(layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
             storage: torch.dtype, device) -> list[QuantizedKVCache]:
    scaled = storage in SCALED
    data = zeros((layers, 2, num_blocks, block_size, kv_heads, head_dim), storage, device)
    scale = zeros((layers, 2, num_blocks, block_size, kv_heads) if scaled else (layers, 2, 0), torch.float32, device)
    return [QuantizedKVCache(data[i], scale[i]) for i in range(layers)]


def gather_dequantized(cache: QuantizedKVCache, which: int, block_ids: torch.Tensor, dtype: torch.dtype):
    """[n_blocks * block_size, Hkv, D] of K (0) or V (1) in `dtype`."""
    blocks = torch.index_select(cache.data[which], 0, block_ids).to(torch.float32)
    if cache.scale.numel():
        blocks = blocks * torch.index_select(cache.scale[which], 0, block_ids).unsqueeze(-1)
    return blocks.to(dtype).flatten(0, 1)

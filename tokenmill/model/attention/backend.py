"""The attention-backend interface.

A backend turns the runner's per-sequence layout of a flat batch into its own metadata once per
step (`build_metadata`), then, in every layer, writes the new K/V into the paged cache and attends
each query to its sequence's cached context (`forward`). The flat batch is ordered decodes first
(query length 1, or 1 + k when verifying k draft tokens), then prefill chunks, so a backend can
treat the two groups differently.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from tokenmill.errors import ConfigError

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "cpu_paged", "torch_sdpa")


@dataclass
class BatchLayout:
    """What the runner knows about one flat batch, in batch order (decodes first)."""

    query_lens: list[int]  # new tokens per sequence this step
    seq_lens: list[int]  # context length per sequence after this step (cached + new)
    block_tables: list[list[int]]  # KV block ids per sequence, covering seq_len
    slot_mapping: torch.Tensor  # [num_tokens] cache slot of each new token
    num_decodes: int  # leading sequences that decode: query_len 1, or 1 + k drafts to verify


class AttentionMetadata:
    """Backend-specific, built once per step and shared by every layer."""


class AttentionBackend(ABC):
    name: str = "abstract"

    def __init__(self, block_size: int, device: torch.device):
        self.block_size = block_size
        self.device = device

    @abstractmethod
    def build_metadata(self, layout: BatchLayout) -> AttentionMetadata: ...

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q: [T, H, D]; k, v: [T, Hkv, D]; kv_cache: [2, num_blocks, block_size, Hkv, D].
        Returns [T, H * D]."""


def get_attention_backend(name: str, block_size: int, device: torch.device, head_dim: int) -> AttentionBackend:
    from tokenmill.model.attention.cpu_paged import CPUPagedBackend
    from tokenmill.model.attention.torch_sdpa import TorchSDPABackend

    if name not in BACKENDS:
        raise ConfigError(f"unknown attention backend {name!r}; choose from {', '.join(BACKENDS)}")
    if name in ("auto", "cpu_paged") and device.type == "cpu":
        if CPUPagedBackend.available(device, head_dim):
            return CPUPagedBackend(block_size, device)
        if name == "cpu_paged":
            from tokenmill.model import kernels

            reason = kernels.unavailable_reason or f"it needs a head_dim that is a multiple of 32, not {head_dim}"
            raise ConfigError(f"the cpu_paged attention backend is unavailable: {reason}", param="attention_backend")
    return TorchSDPABackend(block_size, device)

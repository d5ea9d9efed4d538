from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.model.layers.linear import can_prepack, default_weight_loader, in_row_tiles


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size, dtype=dtype, device=device),
                                   requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class LMHead(VocabEmbedding):
    """Projects hidden states to vocabulary logits (fp32, for sampling). May share the embedding."""

    packed_weight: torch.Tensor | None = None
    row_tile: int | None = None  # batch-invariant mode (see linear.in_row_tiles)

    def tie(self, embedding: VocabEmbedding) -> None:
        self.weight = embedding.weight

    def process_weights_after_loading(self) -> None:
        # a packed copy (the embedding may share the plain weight): ~2x faster at decode batch sizes
        if can_prepack(self.weight):
            self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(self.weight.data)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return in_row_tiles(self._matmul, hidden, self.row_tile).float()

    def _matmul(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.packed_weight is not None:
            return torch.ops.mkldnn._linear_pointwise(hidden, self.packed_weight, None, "none", [], "")
        return F.linear(hidden, self.weight)

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.model.layers.batch_invariance import in_row_tiles
from tokenmill.model.layers.linear import default_weight_loader, prepack


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
    row_tile: int | None = None  # batch-invariant mode (see batch_invariance.in_row_tiles)

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def tie(self, embedding: VocabEmbedding) -> None:
        self.weight = embedding.weight

    def process_weights_after_loading(self) -> None:
        # a packed copy (the embedding may share the plain weight): ~2x faster at decode batch sizes
        self.packed_weight = prepack(self.weight)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return in_row_tiles(self._matmul, hidden, self.row_tile).float()

    def _matmul(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.packed_weight is not None:
            return torch.ops.mkldnn._linear_pointwise(hidden, self.packed_weight, None, "none", [], "")
        return F.linear(hidden, self.weight)

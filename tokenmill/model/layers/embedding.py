from __future__ import annotations

import torch
from torch import nn

from tokenmill.model.layers.batch_invariance import in_row_tiles
from tokenmill.model.layers.linear import UnquantizedLinearMethod
from tokenmill.model.layers.quantization.base import QuantConfig


class VocabEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype = torch.float32, device=None,
                 quant_config: QuantConfig | None = None, prefix: str = "model.embed_tokens"):
        super().__init__()
        self.dtype = dtype
        self.method = quant_config.embedding_method(prefix) if quant_config else UnquantizedLinearMethod()
        self.method.create_weights(self, hidden_size, [vocab_size], dtype, device)

    def process_weights_after_loading(self) -> None:
        if not isinstance(self.method, UnquantizedLinearMethod):  # a dense table stays as it is
            self.method.process_weights_after_loading(self)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.method.embed(self, ids, self.dtype)


class LMHead(nn.Module):
    """Projects hidden states to vocabulary logits (fp32, for sampling). May share the embedding's
    weight (and then its format)."""

    packed_weight: torch.Tensor | None = None
    row_tile: int | None = None  # batch-invariant mode (see batch_invariance.in_row_tiles)

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype = torch.float32, device=None,
                 quant_config: QuantConfig | None = None, prefix: str = "lm_head"):
        super().__init__()
        self.in_features, self.out_features, self.dtype = hidden_size, vocab_size, dtype
        self.method = quant_config.linear_method([prefix]) if quant_config else UnquantizedLinearMethod()
        self.method.create_weights(self, hidden_size, [vocab_size], dtype, device)

    _tied: list | None = None

    def tie(self, embedding: VocabEmbedding) -> None:
        self.weight = embedding.weight
        self._tied = [embedding]  # a list: not a submodule
        method = embedding.method
        # the embedding keeps reading the plain weight: pack a copy, keep the original
        dense = isinstance(method, UnquantizedLinearMethod)
        self.method = UnquantizedLinearMethod(keep_plain=True) if dense else method

    def process_weights_after_loading(self) -> None:
        if self._tied and not isinstance(self.method, UnquantizedLinearMethod):
            embedding = self._tied[0]  # processed already (it comes first): share its packed weight
            self.weight = embedding.weight
            for name, value in vars(embedding).items():
                if name.startswith("q_"):
                    setattr(self, name, value)
            return
        self.method.process_weights_after_loading(self)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return in_row_tiles(self._matmul, hidden, self.row_tile)

    def _matmul(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, hidden, None, out_dtype=torch.float32)

"""The token embedding and the LM head, split by vocabulary rows under tensor parallelism
(vLLM's VocabParallelEmbedding / ParallelLMHead): each rank holds a contiguous range of rows; the
embedding looks up the ids in its range, zeroes the others and all-reduces; the head computes its
range's logits and all-gathers them."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill import distributed
from tokenmill.distributed.partition import split_evenly
from tokenmill.model.layers.batch_invariance import in_row_tiles
from tokenmill.model.layers.linear import UnquantizedLinearMethod
from tokenmill.model.layers.quantization.base import QuantConfig


class _VocabShard(nn.Module):
    def __init__(self, vocab_size: int):
        super().__init__()
        st = distributed.state()
        self.tp_size = st.tp_size
        self.vocab_size = vocab_size
        self.shard_sizes = [split_evenly(vocab_size, st.tp_size, r)[1] for r in range(st.tp_size)]
        self.vocab_start, self.num_rows = split_evenly(vocab_size, st.tp_size, st.tp_rank)
        self.shard_slices = {None: slice(0, self.num_rows)}  # for the packed method's loader

    def local_part(self, loaded, shard_id=None):
        return loaded if self.tp_size == 1 else loaded.narrow(0, self.vocab_start, self.num_rows)

    def _loader(self):
        def load(param: nn.Parameter, loaded, shard_id=None) -> None:
            loaded = self.local_part(loaded)
            if tuple(param.shape) != tuple(loaded.shape):
                raise ValueError(f"vocabulary shard {tuple(loaded.shape)} != {tuple(param.shape)}")
            param.data.copy_(loaded.to(param.dtype))

        return load


class VocabEmbedding(_VocabShard):
    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype = torch.float32, device=None,
                 quant_config: QuantConfig | None = None, prefix: str = "model.embed_tokens"):
        super().__init__(vocab_size)
        self.dtype = dtype
        self.method = quant_config.embedding_method(prefix) if quant_config else UnquantizedLinearMethod()
        self.method.create_weights(self, hidden_size, [self.num_rows], dtype, device)
        if isinstance(self.method, UnquantizedLinearMethod):
            self.weight.weight_loader = self._loader()

    def process_weights_after_loading(self) -> None:
        if not isinstance(self.method, UnquantizedLinearMethod):  # a dense table stays as it is
            self.method.process_weights_after_loading(self)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return self.method.embed(self, ids, self.dtype)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_start + self.num_rows)
        local = torch.where(outside, 0, ids - self.vocab_start)
        x = self.method.embed(self, local, self.dtype)
        x.masked_fill_(outside.unsqueeze(1), 0)
        return distributed.tp_all_reduce(x)


class LMHead(_VocabShard):
    """Projects hidden states to vocabulary logits (fp32, for sampling). May share the embedding's
    weight (and then its format)."""

    packed_weight: torch.Tensor | None = None
    row_tile: int | None = None  # batch-invariant mode (see batch_invariance.in_row_tiles)

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype = torch.float32, device=None,
                 quant_config: QuantConfig | None = None, prefix: str = "lm_head"):
        super().__init__(vocab_size)
        self.in_features, self.out_features, self.dtype = hidden_size, self.num_rows, dtype
        self.method = quant_config.linear_method([prefix]) if quant_config else UnquantizedLinearMethod()
        self.method.create_weights(self, hidden_size, [self.num_rows], dtype, device)
        if isinstance(self.method, UnquantizedLinearMethod):
            self.weight.weight_loader = self._loader()

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
        logits = in_row_tiles(self._matmul, hidden, self.row_tile)
        return distributed.tp_all_gather_cols(logits, self.shard_sizes)

    def _matmul(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, hidden, None, out_dtype=torch.float32)

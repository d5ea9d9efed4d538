"""A reduced vocabulary for the draft model's LM head (as FR-Spec and EAGLE-3 do): the draft scores
only the `size` most frequent tokens, so its head reads a fraction of the 152k rows per pass.

Byte-level BPE numbers its tokens in merge order, and a merge is learned because its pair is
frequent: the lowest ids are the most frequent tokens (on the Qwen2.5 vocabulary, the first 32k
ids cover ~99% of the tokens of Python source). The subset is those ids plus the tokenizer's added
tokens above them (EOS, the chat markers), which are rare in text but end every answer.

Lossless: the target still verifies every draft against its full vocabulary, and the draft is
one-hot (its argmax), so a draft from the subset is a draft like any other; a token outside the
subset is never drafted, only produced by the target (rejection_sampler.py).
"""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.model.layers.linear import UnquantizedLinearMethod
from tokenmill.model.layers.quantization.formats import FORMATS, quantize_q4_groups
from tokenmill.model.layers.quantization.packed import PackedLinearMethod


def draft_vocab_ids(size: int, vocab_size: int, special_ids: list[int]) -> torch.Tensor:
    """The `size` lowest ids and the special ones (sorted, unique, within the vocabulary)."""
    ids = set(range(min(size, vocab_size))) | {i for i in special_ids if 0 <= i < vocab_size}
    return torch.tensor(sorted(ids), dtype=torch.long)


class ReducedLMHead(nn.Module):
    """The rows `ids` of an LM head, in its own format: a packed head (int4, GGUF) is dequantized,
    cut and packed again to int4 (I4_G128, or Q4_1 where the rows are no multiple of 128 wide);
    a dense one keeps its dtype. Returns fp32 logits over the subset, column j for token ids[j]."""

    row_tile: int | None = None

    def __init__(self, head: nn.Module, ids: torch.Tensor):
        super().__init__()
        self.ids = ids
        self.in_features, self.out_features = head.in_features, len(ids)
        self.row_tile = head.row_tile
        rows = self._rows(head, ids)
        if isinstance(head.method, PackedLinearMethod):
            fmt = FORMATS["I4_G128"] if head.in_features % 128 == 0 else FORMATS["Q4_1"]
            packed = quantize_q4_groups(rows.float(), fmt.block)
            self.method = PackedLinearMethod([fmt.id], head.method.fixed_dense_min_rows, head.method.act_bits)
            self.q_rows, self.q_out, self.q_in = [len(ids)], len(ids), head.in_features
            self.q_offsets = [0, packed.numel()]
            self.weight = nn.Parameter(packed.reshape(-1), requires_grad=False)
            self.method.process_raw_rows(self)
            cols, _ = head.method.outliers(head)  # the full head's outlier channels (act_bits.py)
            self.method.set_outliers(self, None if cols is None else cols.tolist())
        else:
            self.method = UnquantizedLinearMethod()
            self.weight = nn.Parameter(rows.contiguous(), requires_grad=False)
            self.method.process_weights_after_loading(self)

    @staticmethod
    def _rows(head: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """The head's rows `ids` as a dense tensor (fp32 from a packed head)."""
        if not isinstance(head.method, PackedLinearMethod):
            weight = head.weight.data
            if weight.numel() == 0:  # packed for oneDNN and dropped: recover the rows through the head
                eye = torch.eye(head.in_features, dtype=head.dtype)
                return head.method.apply(head, eye, None, out_dtype=torch.float32).t()[ids].to(head.dtype)
            return weight[ids]
        out = torch.empty(len(ids), head.q_in, dtype=torch.float32)
        row = 0
        for view, qt, n in zip(head.q_views, head.method.qtypes, head.q_rows):
            dense = torch.empty(n, head.q_in, dtype=torch.float32)
            head.method.ops.dequantize(dense, view, qt, head.q_in)
            mask = (ids >= row) & (ids < row + n)
            out[mask] = dense[ids[mask] - row]
            row += n
        return out

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, hidden, None, out_dtype=torch.float32)

"""A proposal's draft passes in one C++ call (csrc/draft_loop.cpp), where the draft model's layers
run fused (fused_decode.py) and its head and embedding are packed.

Each pass is the Python loop's kernels in the same order on the same shapes (embedding, the fused
layers, the final norm, the head, argmax_prob_rows, the p_min test), so the drafts are the same bit
for bit; what goes is the Python between them: ~0.4 ms a pass of one stream (views, metadata,
dispatch), ~1 ms a step of the int4 0.5B drafting for the 1.5B target.
"""

from __future__ import annotations

import torch

from tokenmill.model.fused_decode import packed_linear
from tokenmill.model.layers.quantization.packed import PackedLinearMethod


class FusedDraftLoop:
    """Built lazily (after the KV cache is bound); `get()` gives the C++ loop, or None when the
    draft does not qualify (then the Python loop drafts)."""

    def __init__(self, model: torch.nn.Module, head: torch.nn.Module, vocab_ids: torch.Tensor | None,
                 block_size: int):
        self.model, self.head, self.vocab_ids, self.block_size = model, head, vocab_ids, block_size
        self._plan_source = None  # the FusedDecode the loop holds a plan of (rebuilt with the KV cache)
        self._loop = None

    def get(self):
        inner = getattr(self.model, "model", None)
        if not (getattr(inner, "fused", False) and hasattr(inner, "fused_layers")):
            return None
        fused = inner.fused_layers()
        if fused is not self._plan_source:
            self._plan_source, self._loop = fused, self._build(inner, fused)
        return self._loop

    def _build(self, inner, fused):
        embed, head = inner.embed_tokens, self.head
        # fused.usable: packed layers, the paged backend, no tensor parallelism, and the kernels library
        # (DecodePlan's and DraftLoop's) loaded
        if not (fused.usable and inner.is_first and inner.is_last and packed_linear(head)
                and type(embed.method).embed is PackedLinearMethod.embed
                and inner.norm.weight.dtype in (torch.bfloat16, torch.float32)):
            return None
        head_tensors, head_ints = head.method.plan_lists(head)
        ids = self.vocab_ids if self.vocab_ids is not None else torch.empty(0, dtype=torch.long)
        embedding, qlinear = f"{embed.method.ops.name}::embedding", f"{head.method.ops.name}::qlinear"
        return torch.classes.tokenmill.DraftLoop(
            fused.plan, embed.weight.data, embed.method.qtypes[0], embedding, inner.norm.weight.data, inner.norm.eps,
            head_tensors, head_ints, qlinear, ids, inner.rotary.cos, inner.rotary.sin, self.block_size)

"""Paged attention on PyTorch SDPA (GQA, any dtype, any device).

Decodes: one batched SDPA over K/V gathered block-wise (`index_select`, the fast gather on CPU)
into [num_decodes, Hkv, max_len, D], with a mask for each sequence's true length.
Prefills: one SDPA per sequence; a chunk with no cached context attends to its own fresh K/V
(causal), a chunk after cached context attends to the gathered context with a shifted causal mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenmill.model.attention.backend import AttentionBackend, AttentionMetadata, BatchLayout


@dataclass
class PrefillChunk:
    start: int  # token range in the flat batch
    end: int
    ctx_len: int  # cached + new tokens
    block_ids: torch.Tensor | None  # blocks covering ctx_len (None: no cached context)
    mask: torch.Tensor | None  # [q_len, ctx_len] bool, True = attend


@dataclass
class SDPAMetadata(AttentionMetadata):
    slot_mapping: torch.Tensor
    num_decodes: int
    decode_block_ids: torch.Tensor | None  # [num_decodes * max_blocks], padded with block 0
    decode_len: int  # max_blocks * block_size
    decode_mask: torch.Tensor | None  # [num_decodes, 1, 1, decode_len]
    prefills: list[PrefillChunk]


class TorchSDPABackend(AttentionBackend):
    name = "torch_sdpa"

    def build_metadata(self, layout: BatchLayout) -> SDPAMetadata:
        dev, bs = self.device, self.block_size
        nd = layout.num_decodes
        decode_ids = decode_mask = None
        decode_len = 0
        if nd:
            lens = layout.seq_lens[:nd]
            max_blocks = (max(lens) + bs - 1) // bs
            decode_len = max_blocks * bs
            ids = torch.zeros(nd, max_blocks, dtype=torch.long)
            for i, table in enumerate(layout.block_tables[:nd]):
                n = (lens[i] + bs - 1) // bs
                ids[i, :n] = torch.tensor(table[:n], dtype=torch.long)
            decode_ids = ids.view(-1).to(dev)
            decode_mask = (torch.arange(decode_len)[None, :] < torch.tensor(lens)[:, None]).to(dev)
            decode_mask = decode_mask.view(nd, 1, 1, decode_len)
        prefills = []
        start = nd
        for i in range(nd, len(layout.query_lens)):
            q_len, ctx = layout.query_lens[i], layout.seq_lens[i]
            block_ids = mask = None
            if ctx > q_len:
                n = (ctx + bs - 1) // bs
                block_ids = torch.tensor(layout.block_tables[i][:n], dtype=torch.long, device=dev)
                offset = ctx - q_len
                mask = (torch.arange(ctx, device=dev)[None, :]
                        <= torch.arange(offset, ctx, device=dev)[:, None])
            prefills.append(PrefillChunk(start, start + q_len, ctx, block_ids, mask))
            start += q_len
        return SDPAMetadata(layout.slot_mapping, nd, decode_ids, decode_len, decode_mask, prefills)

    def forward(self, q, k, v, kv_cache, meta: SDPAMetadata, scale: float) -> torch.Tensor:
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = k.shape[1]
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        # Write this step's K/V into their slots first: every read below sees them.
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)

        out = torch.empty_like(q)
        nd = meta.num_decodes
        if nd:
            kd = self._gather(k_cache, meta.decode_block_ids, nd, meta.decode_len)
            vd = self._gather(v_cache, meta.decode_block_ids, nd, meta.decode_len)
            qd = q[:nd].unsqueeze(2)  # [nd, H, 1, D]
            od = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=meta.decode_mask, scale=scale,
                                                enable_gqa=num_heads != num_kv_heads)
            out[:nd] = od.squeeze(2)
        for p in meta.prefills:
            qp = q[p.start:p.end].transpose(0, 1).unsqueeze(0)  # [1, H, q_len, D]
            if p.block_ids is None:
                kp = k[p.start:p.end].transpose(0, 1).unsqueeze(0)
                vp = v[p.start:p.end].transpose(0, 1).unsqueeze(0)
                op = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale,
                                                    enable_gqa=num_heads != num_kv_heads)
            else:
                kp = self._gather(k_cache, p.block_ids, 1, p.ctx_len)
                vp = self._gather(v_cache, p.block_ids, 1, p.ctx_len)
                op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=p.mask, scale=scale,
                                                    enable_gqa=num_heads != num_kv_heads)
            out[p.start:p.end] = op.squeeze(0).transpose(0, 1)
        return out.view(num_tokens, num_heads * head_dim)

    @staticmethod
    def _gather(cache: torch.Tensor, block_ids: torch.Tensor, batch: int, length: int) -> torch.Tensor:
        """[batch, Hkv, length, D] view of the blocks (block-wise index_select, then trim)."""
        blocks = torch.index_select(cache, 0, block_ids)  # [batch*nb, bs, Hkv, D]
        hkv, d = cache.shape[2], cache.shape[3]
        return blocks.view(batch, -1, hkv, d)[:, :length].transpose(1, 2)

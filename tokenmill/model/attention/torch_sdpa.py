"""Paged attention on PyTorch SDPA (GQA, any dtype, any device).

Decodes: one batched SDPA over K/V gathered block-wise (`index_select`, the fast gather on CPU)
into [num_decodes, Hkv, max_len, D], with a mask for each sequence's true length.
Prefills: one SDPA per sequence; a chunk with no cached context attends to its own fresh K/V
(causal), a chunk after cached context attends to the gathered context with a shifted causal mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
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
    table: torch.Tensor | None = None  # int64 blocks covering ctx_len, for a backend's own prompt kernel


@dataclass
class GatheredDecodes:
    block_ids: torch.Tensor  # [num_decodes * max_blocks], padded with block 0
    length: int  # max_blocks * block_size
    mask: torch.Tensor  # [num_decodes, 1, 1, length]


@dataclass
class SDPAMetadata(AttentionMetadata):
    slot_mapping: torch.Tensor
    num_decodes: int  # decode rows: one per decode token (a verification has 1 + k)
    decodes: object  # backend-specific decode data (None when there are no decodes)
    prefills: list[PrefillChunk]


def padded_block_table(tables: list[list[int]], lens: list[int], block_size: int) -> torch.Tensor:
    """[n, max_blocks] int64 block ids covering each sequence's length, padded with block 0."""
    max_blocks = (max(lens) + block_size - 1) // block_size
    out = np.zeros((len(lens), max_blocks), dtype=np.int64)  # filled in numpy: a torch setitem is ~7 us a row
    for i, (table, n) in enumerate(zip(tables, lens)):
        nb = (n + block_size - 1) // block_size
        out[i, :nb] = table[:nb]
    return torch.from_numpy(out)


def decode_rows(layout: BatchLayout) -> tuple[list[list[int]], list[int]]:
    """One decode query per token of the decode group: a verification step's query of 1 + k tokens
    (speculative decoding) becomes 1 + k rows over the same block table, each seeing the keys up
    to itself, so it runs through the decode kernel reading K/V in place."""
    nd = layout.num_decodes
    q_lens, seq_lens, tables = layout.query_lens[:nd], layout.seq_lens[:nd], layout.block_tables[:nd]
    if all(q == 1 for q in q_lens):
        return tables, seq_lens
    out_tables, out_lens = [], []
    for q, ctx, table in zip(q_lens, seq_lens, tables):
        for i in range(ctx - q + 1, ctx + 1):
            out_tables.append(table)
            out_lens.append(i)
    return out_tables, out_lens


class TorchSDPABackend(AttentionBackend):
    name = "torch_sdpa"

    def build_metadata(self, layout: BatchLayout) -> SDPAMetadata:
        tables, lens = decode_rows(layout)
        decodes = self._decode_metadata(tables, lens) if lens else None
        return SDPAMetadata(layout.slot_mapping, len(lens), decodes, self._prefill_metadata(layout))

    def _decode_metadata(self, tables: list[list[int]], lens: list[int]) -> GatheredDecodes:
        ids = padded_block_table(tables, lens, self.block_size)
        length = ids.shape[1] * self.block_size
        mask = torch.arange(length)[None, :] < torch.tensor(lens)[:, None]
        return GatheredDecodes(ids.view(-1).to(self.device), length, mask.view(len(lens), 1, 1, length).to(self.device))

    def _prefill_metadata(self, layout: BatchLayout) -> list[PrefillChunk]:
        dev, bs = self.device, self.block_size
        prefills, start = [], sum(layout.query_lens[:layout.num_decodes])
        for i in range(layout.num_decodes, len(layout.query_lens)):
            q_len, ctx = layout.query_lens[i], layout.seq_lens[i]
            block_ids = mask = None
            if ctx > q_len:
                n = (ctx + bs - 1) // bs
                block_ids = torch.tensor(layout.block_tables[i][:n], dtype=torch.long, device=dev)
                mask = (torch.arange(ctx, device=dev)[None, :]
                        <= torch.arange(ctx - q_len, ctx, device=dev)[:, None])
            prefills.append(PrefillChunk(start, start + q_len, ctx, block_ids, mask))
            start += q_len
        return prefills

    def forward(self, q, k, v, kv_cache, meta: SDPAMetadata, scale: float) -> torch.Tensor:
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = k.shape[1]
        k_cache, v_cache = kv_cache[0], kv_cache[1]
        # Write this step's K/V into their slots first: every read below sees them.
        k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, v)

        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # q may be a strided view
        if meta.num_decodes:
            self._decode(q, out, k_cache, v_cache, meta, scale)
        for p in meta.prefills:
            self._prefill(q, k, v, k_cache, v_cache, p, scale, out)
        return out.view(num_tokens, num_heads * head_dim)

    def _prefill(self, q, k, v, k_cache, v_cache, p: PrefillChunk, scale: float, out) -> None:
        """One prompt chunk's rows of `out`, its K/V already in the cache."""
        gqa = q.shape[1] != k.shape[1]
        qp = q[p.start:p.end].transpose(0, 1).unsqueeze(0)  # [1, H, q_len, D]
        if p.block_ids is None:
            kp = k[p.start:p.end].transpose(0, 1).unsqueeze(0)
            vp = v[p.start:p.end].transpose(0, 1).unsqueeze(0)
            op = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            kp = self._gather(k_cache, p.block_ids, 1, p.ctx_len)
            vp = self._gather(v_cache, p.block_ids, 1, p.ctx_len)
            op = F.scaled_dot_product_attention(qp, kp, vp, attn_mask=p.mask, scale=scale, enable_gqa=gqa)
        out[p.start:p.end] = op.squeeze(0).transpose(0, 1)

    def _decode(self, q, out, k_cache, v_cache, meta: SDPAMetadata, scale: float) -> None:
        nd, d = meta.num_decodes, meta.decodes
        kd = self._gather(k_cache, d.block_ids, nd, d.length)
        vd = self._gather(v_cache, d.block_ids, nd, d.length)
        od = F.scaled_dot_product_attention(q[:nd].unsqueeze(2), kd, vd, attn_mask=d.mask, scale=scale,
                                            enable_gqa=q.shape[1] != kd.shape[1])
        out[:nd] = od.squeeze(2)

    @staticmethod
    def _gather(cache: torch.Tensor, block_ids: torch.Tensor, batch: int, length: int) -> torch.Tensor:
        """[batch, Hkv, length, D] view of the blocks (block-wise index_select, then trim)."""
        blocks = torch.index_select(cache, 0, block_ids)  # [batch*nb, bs, Hkv, D]
        hkv, d = cache.shape[2], cache.shape[3]
        return blocks.view(batch, -1, hkv, d)[:, :length].transpose(1, 2)

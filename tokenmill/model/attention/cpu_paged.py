"""CPU backend: decode attention reads K/V in place from the paged cache with a C++ kernel
(no gather copy; 2.5-3x faster than gather + SDPA at 64 sequences, see csrc/). Prompt tokens go
through the same kernel where it measured faster than SDPA's flash attention (`paged_prefill`:
bf16 on AVX-512 without AMX, each token a row over the keys up to itself: one layer 1.1-2.6x SDPA
from 128 to 4096 tokens on an AMD EPYC, BENCHMARKS.md). In fp32 with AVX2 or AVX-512 (not AMX) a
prompt chunk goes through csrc/prefill_attention.cpp (blocked like a GEMM, with an online softmax;
`prefill_kernel`), with a bf16 or int8 cache too (over the chunk's own K/V, or its context
dequantized); elsewhere prompts use SDPA as in the portable backend.

In batch-invariant mode (`per_row`), every token, prompt tokens included, goes through the decode
kernel as its own query over the keys before it: its result then depends on nothing but its own
sequence (not on chunking, prefix-cache hits or the batch), at the price of slower long prefills."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tokenmill.model.attention.backend import BatchLayout
from tokenmill.model.attention.quant_kv import QuantizedKVCache, gather_dequantized
from tokenmill.model.attention.torch_sdpa import SDPAMetadata, TorchSDPABackend, padded_block_table


@dataclass
class PagedDecodes:
    tables: torch.Tensor  # [num_decodes, max_blocks] int64
    seq_lens: torch.Tensor  # [num_decodes] int64


# ISA levels where fp32 prompts take the blocked prompt kernel: one layer 1.2-1.9x SDPA's flash
# attention at 128-1100 tokens on an AVX2 EPYC, 1.3-1.8x at 128-2048 on a Zen 4 with AVX-512
# (BENCHMARKS.md), and a row's result does not depend on the chunk's length (SDPA's last rows' did).
# AMX is left to SDPA (not measured there).
PREFILL_KERNEL_ISAS = ("avx2", "avx512", "avx512_bf16")
# ISA levels where the decode kernel runs prompts too. AMX is left to SDPA (not measured: its bf16
# GEMMs may use the tiles).
PAGED_PREFILL_ISAS = ("avx512", "avx512_bf16")


class CPUPagedBackend(TorchSDPABackend):
    name = "cpu_paged"
    per_row = False  # batch-invariant mode
    paged_prefill = False  # prompt tokens through the decode kernel too (see the module's docstring)
    prefill_kernel = False  # fp32 prompt chunks through csrc/prefill_attention.cpp

    @staticmethod
    def available(device: torch.device, head_dim: int) -> bool:
        from tokenmill.model.kernels import load_cpu_kernels

        return device.type == "cpu" and head_dim % 32 == 0 and load_cpu_kernels()

    def enable_paged_prefill(self, dtype: torch.dtype) -> bool:
        from tokenmill.utils.cpu import active_isa

        self.paged_prefill = dtype == torch.bfloat16 and active_isa() in PAGED_PREFILL_ISAS
        return self.paged_prefill

    def enable_prefill_kernel(self, dtype: torch.dtype) -> bool:
        from tokenmill.utils.cpu import active_isa

        self.prefill_kernel = dtype == torch.float32 and active_isa() in PREFILL_KERNEL_ISAS
        return self.prefill_kernel

    def build_metadata(self, layout: BatchLayout) -> SDPAMetadata:
        has_prefill = layout.num_decodes < len(layout.query_lens)
        if not (self.per_row or (self.paged_prefill and has_prefill)):
            meta = super().build_metadata(layout)
            if self.prefill_kernel:
                for i, p in zip(range(layout.num_decodes, len(layout.query_lens)), meta.prefills):
                    nb = (p.ctx_len + self.block_size - 1) // self.block_size
                    p.table = torch.tensor(layout.block_tables[i][:nb], dtype=torch.long)
            return meta
        bs = self.block_size
        lens = torch.cat([torch.arange(ctx - q + 1, ctx + 1) for q, ctx in zip(layout.query_lens, layout.seq_lens)])
        tables = torch.zeros(len(lens), (max(layout.seq_lens) + bs - 1) // bs, dtype=torch.long)
        row = 0
        for q, ctx, table in zip(layout.query_lens, layout.seq_lens, layout.block_tables):
            nb = (ctx + bs - 1) // bs  # each token sees the keys up to itself, in its sequence's blocks
            tables[row:row + q, :nb] = torch.tensor(table[:nb], dtype=torch.long)
            row += q
        return SDPAMetadata(layout.slot_mapping, len(lens), PagedDecodes(tables, lens), [])

    def _decode_metadata(self, tables: list[list[int]], lens: list[int]) -> PagedDecodes:
        return PagedDecodes(padded_block_table(tables, lens, self.block_size), torch.tensor(lens, dtype=torch.long))

    def _decode(self, q, out, k_cache, v_cache, meta: SDPAMetadata, scale: float) -> None:
        nd = meta.num_decodes
        torch.ops.tokenmill.paged_decode_attention(out[:nd], q[:nd].contiguous(), k_cache, v_cache,
                                                   meta.decodes.tables, meta.decodes.seq_lens, scale)

    def _prefill(self, q, k, v, k_cache, v_cache, p, scale: float, out) -> None:
        if p.table is None or not torch.ops.tokenmill.prefill_attention(
                out[p.start:p.end], q[p.start:p.end], k_cache, v_cache, p.table, p.ctx_len, scale):
            super()._prefill(q, k, v, k_cache, v_cache, p, scale, out)

    def forward(self, q, k, v, kv_cache, meta: SDPAMetadata, scale: float) -> torch.Tensor:
        if not isinstance(kv_cache, QuantizedKVCache):
            return super().forward(q, k, v, kv_cache, meta, scale)
        return self._forward_quantized(q, k, v, kv_cache, meta, scale)

    def _forward_quantized(self, q, k, v, cache: QuantizedKVCache, meta: SDPAMetadata, scale: float) -> torch.Tensor:
        """As the parent's forward, on a cache in another dtype (quant_kv.py)."""
        from tokenmill.model.quant_kernels import quant_kv_ops

        ops = quant_kv_ops()
        num_tokens, num_heads, head_dim = q.shape
        num_kv_heads = k.shape[1]
        if cache.scale.numel():
            ops.kv_write_quant(k, v, cache.data[0], cache.data[1], cache.scale[0], cache.scale[1], meta.slot_mapping)
        else:
            for i, x in enumerate((k, v)):
                cache.data[i].view(-1, num_kv_heads, head_dim).index_copy_(0, meta.slot_mapping, x.to(cache.data.dtype))
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        nd = meta.num_decodes
        if nd:  # the AVX-512 kernel of a bf16 cache where it applies, else the portable one
            args = (out[:nd], q[:nd].contiguous(), cache.data[0], cache.data[1], cache.scale[0], cache.scale[1],
                    meta.decodes.tables, meta.decodes.seq_lens, scale)
            if not torch.ops.tokenmill.paged_decode_attention_scaled(*args):
                ops.paged_decode_attention_q(*args)
        gqa = num_heads != num_kv_heads
        for p in meta.prefills:
            if p.block_ids is None:  # fresh chunk: its own K/V, as computed
                kp, vp, mask = k[p.start:p.end], v[p.start:p.end], None
            else:
                kp = gather_dequantized(cache, 0, p.block_ids, q.dtype)[:p.ctx_len]
                vp = gather_dequantized(cache, 1, p.block_ids, q.dtype)[:p.ctx_len]
                mask = p.mask
            if self.prefill_kernel and self._prefill_contiguous(q, kp, vp, p, scale, out):
                continue
            qp = q[p.start:p.end].transpose(0, 1).unsqueeze(0)
            op = F.scaled_dot_product_attention(qp, kp.transpose(0, 1).unsqueeze(0), vp.transpose(0, 1).unsqueeze(0),
                                                attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=gqa)
            out[p.start:p.end] = op.squeeze(0).transpose(0, 1)
        return out.view(num_tokens, num_heads * head_dim)

    @staticmethod
    def _prefill_contiguous(q, kp, vp, p, scale: float, out) -> bool:
        """A chunk's rows through the fp32 prompt kernel over K/V [ctx_len, Hkv, D] in fp32 (a quantized
        cache's context dequantized, or a fresh chunk's own K/V): one block of them. SmolLM2's prompts
        of 512 and 2048 tokens over a bf16 or int8 cache prefilled 1.07-1.14x faster so than with SDPA.
        (`prefill_kernel` is on only for an fp32 model, so kp and vp are fp32.)"""
        kc, vc = (x.contiguous().unsqueeze(0) for x in (kp, vp))  # [1, ctx_len, Hkv, D]
        return torch.ops.tokenmill.prefill_attention(out[p.start:p.end], q[p.start:p.end], kc, vc,
                                                     torch.zeros(1, dtype=torch.long), p.ctx_len, scale)

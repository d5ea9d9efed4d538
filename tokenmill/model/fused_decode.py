"""A decode-only step through every decoder layer in one C++ call (csrc/decode_layers.cpp).

For one stream on a small model, Python's dozen ops per layer (views, allocations, dispatch) cost
as much as the kernels they call. When every layer's weights are packed (GGUF, int8/int4), the
CPU kernels are in use and the batch holds only decode rows (speculative verification rows
included), the layers run as the same kernels called from C++ in the same order, over a plain KV
cache or a quantized one (quant_kv.py): the result is bit for bit that of the Python layers.
Anything else takes the Python layers. The layers' tensors are handed to C++ once, as a
DecodePlan; a step passes only its activations and metadata.
"""

from __future__ import annotations

import torch

from tokenmill import distributed
from tokenmill.model.layers.quantization.packed import PackedLinearMethod


def packed_linear(linear) -> bool:
    """Whether `linear` runs the packed method's qlinear as it is (what the C++ calls do)."""
    m = linear.method
    return (isinstance(m, PackedLinearMethod) and type(m).apply is PackedLinearMethod.apply
            and linear.row_tile is None and linear.q_views is not None)


def _plan_class():
    """decode_layers.cpp's DecodePlan, or None without the CPU kernels."""
    try:
        return torch.classes.tokenmill.DecodePlan
    except RuntimeError:
        return None


class FusedDecode:
    """Built lazily by the model (after loading and KV-cache binding); `usable` says whether the
    model qualifies at all, `applies` whether a step does."""

    def __init__(self, layers: list, backend) -> None:
        from tokenmill.model.attention.cpu_paged import CPUPagedBackend
        from tokenmill.model.attention.quant_kv import QuantizedKVCache
        from tokenmill.model.quant_kernels import quant_kv_ops

        self.layers = layers
        self.usable = False
        self.settings_version = PackedLinearMethod.settings_version  # the codes and channels copied below
        self.first_cache = layers[0].self_attn.kv_cache if layers else None  # rebuilt when it is rebound
        plan_class = _plan_class()
        linears = [lin for ly in layers for lin in (ly.self_attn.qkv_proj, ly.self_attn.o_proj,
                                                  ly.mlp.gate_up_proj, ly.mlp.down_proj)]
        if not (layers and isinstance(backend, CPUPagedBackend) and distributed.state().tp_size == 1
                and plan_class is not None and all(map(packed_linear, linears))
                and all(isinstance(ly.self_attn.kv_cache, torch.Tensor | QuantizedKVCache) for ly in layers)
                and all(lin.bias is None for ly in layers for lin in (ly.self_attn.o_proj, ly.mlp.gate_up_proj,
                                                                     ly.mlp.down_proj))):
            return
        methods = [lin.method for lin in linears]
        if len({m.ops.name for m in methods}) != 1:
            return
        quantized_kv = isinstance(layers[0].self_attn.kv_cache, QuantizedKVCache)
        self.kv_ops = quant_kv_ops().name if quantized_kv else ""  # a quantized cache's kernels (quant_kv.cpp)
        no_scale = torch.empty(0)
        tensors: list[torch.Tensor] = []
        self.ints: list[int] = []  # decode_layers.cpp's DecodePlan reads both lists in this order
        for ly in layers:
            a = ly.self_attn
            kv = a.kv_cache
            scales = (kv.scale[0], kv.scale[1]) if quantized_kv else (no_scale, no_scale)
            tensors += [ly.input_layernorm.weight.data, ly.post_attention_layernorm.weight.data, kv[0], kv[1], *scales]
            self.ints.append(int(a.qkv_proj.bias is not None))
            if a.qkv_proj.bias is not None:
                tensors.append(a.qkv_proj.bias.data.float())  # qlinear adds it in fp32: convert once
            for lin in (a.qkv_proj, a.o_proj, ly.mlp.gate_up_proj, ly.mlp.down_proj):
                more_tensors, more_ints = lin.method.plan_lists(lin)
                tensors += more_tensors
                self.ints += more_ints
        attn = layers[0].self_attn
        self.plan = plan_class(tensors, self.ints, len(layers), attn.num_heads, attn.num_kv_heads, attn.head_dim,
                               layers[0].input_layernorm.eps, attn.scale, f"{methods[0].ops.name}::qlinear",
                               self.kv_ops)
        self.usable = True

    def stale(self) -> bool:
        """The KV cache was reallocated since (its views are held here), or a packed layer's codes or
        outlier channels changed (the plan holds copies). allocate_kv_cache binds every layer's cache at
        once, so the first layer's tells."""
        return (bool(self.layers) and self.layers[0].self_attn.kv_cache is not self.first_cache
                or self.settings_version != PackedLinearMethod.settings_version)

    def applies(self, x: torch.Tensor, meta) -> bool:
        from tokenmill.model.attention.cpu_paged import PagedDecodes

        return (self.usable and x.dtype in (torch.bfloat16, torch.float32) and not getattr(meta, "prefills", True)
                and isinstance(getattr(meta, "decodes", None), PagedDecodes) and meta.num_decodes == x.shape[0])

    def __call__(self, x, residual, rope, meta):
        """(hidden, residual) after the layers; residual None: before the first layer."""
        residual = torch.zeros_like(x) if residual is None else residual
        cos, sin, positions = rope
        x = self.plan.run(x.contiguous(), residual, positions, cos, sin, meta.slot_mapping, meta.decodes.tables,
                          meta.decodes.seq_lens)
        return x, residual

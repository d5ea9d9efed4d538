"""Which input columns of each layer matter, measured once at load for `--quantization int4`:
the mean square of every input column over a short built-in text (llama.cpp's importance matrix,
`llama-imatrix`, computed in place instead of from a file). int4_search weighs each weight's
rounding error by it, since an error in column j costs about E[x_j^2] in the layer's output.

The text is part of Python's own documentation (`pydoc_data.topics`, shipped with every CPython),
so nothing is downloaded; it is not the text perplexity is measured on. The model runs once, dense
(the weights are not quantized yet), through its own layers, with plain causal attention in place
of the paged backend (there is no KV cache yet)."""

from __future__ import annotations

import logging
import time

import torch
import torch.nn.functional as F

from tokenmill.model.layers.linear import UnquantizedLinearMethod

logger = logging.getLogger(__name__)
TOPICS = ("assignment", "exceptions", "function", "class", "for", "if", "import", "numbers", "specialnames")


def calibration_text() -> str:
    from pydoc_data.topics import topics

    return "\n\n".join(topics[t] for t in TOPICS if t in topics)


class _CausalAttention:
    """Stands in for the attention backend during calibration: one sequence, no cache. In fp32 where the
    engine's prompts use the C++ prompt kernel (AVX2), that kernel: torch's SDPA takes its math path
    on a CPU (a score matrix, a mask, softmax), a third of a SmolLM2 pass over 512 tokens."""

    def __init__(self, backend) -> None:
        from tokenmill.model.attention.cpu_paged import PREFILL_KERNEL_ISAS
        from tokenmill.utils.cpu import active_isa

        self.kernel = getattr(backend, "name", None) == "cpu_paged" and active_isa() in PREFILL_KERNEL_ISAS

    def forward(self, q, k, v, kv_cache, meta, scale):
        t, h, _ = q.shape
        if self.kernel and q.dtype == torch.float32:
            out = torch.empty_like(q)
            kc, vc = (x.contiguous().unsqueeze(0) for x in (k, v))  # one block of t positions
            if torch.ops.tokenmill.prefill_attention(out, q.contiguous(), kc, vc, torch.zeros(1, dtype=torch.long),
                                                     t, scale):
                return out.view(t, -1)
        rep = h // k.shape[1]
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                             is_causal=True, scale=scale)
        return out.transpose(0, 1).reshape(t, -1)


def max_positions(model: torch.nn.Module) -> int:
    """How many positions the model's rotary table holds (its max_model_len): a calibration text
    longer than that is cut to it."""
    return min(m.rotary.cos.shape[0] for m in model.modules() if hasattr(m, "rotary"))


def causal_pass(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """The model's final hidden states over `ids` as one sequence, with plain causal attention in
    place of the paged backend (no KV cache)."""
    attn = [m for m in model.modules() if hasattr(m, "backend") and hasattr(m, "kv_cache")]
    backends = {m: m.backend for m in attn}
    try:
        for m in attn:
            m.backend = _CausalAttention(backends[m])
        with torch.inference_mode():
            return model(torch.tensor(ids), torch.arange(len(ids)), None)
    finally:
        for m, b in backends.items():
            m.backend = b


def measure_input_scales(model: torch.nn.Module, ids: list[int], wants) -> int:
    """Sets `quant_input_scale` (mean x_j^2 over the tokens) on every layer `wants(layer)` accepts,
    running the model dense over `ids`. Returns the number of layers measured."""
    layers = [m for m in model.modules() if hasattr(m, "method") and wants(m)]
    if not layers:
        return 0
    t0 = time.perf_counter()
    dense, saved, hooks, sums = UnquantizedLinearMethod(), {}, [], {}

    def record(layer, args):
        x = args[0].detach().float()
        sums[layer] = sums.get(layer, 0) + x.square().sum(0)

    for layer in layers:
        saved[layer] = layer.method
        layer.method = dense
        layer.packed_weight = None  # what the dense method reads first
        hooks.append(layer.register_forward_pre_hook(record))
    try:
        causal_pass(model, ids)
    finally:
        for h in hooks:
            h.remove()
        for layer, method in saved.items():
            layer.method = method
            del layer.packed_weight
    for layer, s in sums.items():
        layer.quant_input_scale = (s / len(ids)).clamp_min(1e-12)
    logger.info("int4 calibration: %d layers over %d tokens of built-in text in %.1fs", len(sums), len(ids),
                time.perf_counter() - t0)
    return len(sums)

"""GGUF weights requantized at load to fewer bits (a draft model's `"quantization": "int4"`): a
layer stored in a wide type (more than 5 bits per weight: Q8_0, Q6_K, Q5_*), the token embedding
(and a tied LM head) included, is dequantized and quantized again to int4, round-to-nearest
(I4_G128 where the input size is a multiple of 128, else Q4_1); narrower types stay as in the
file. A draft's output only has to be likely, not exact (the target verifies every token), and
decoding reads every weight once per token, so half the bytes is nearly half the draft's step."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.model.layers.quantization.base import LinearMethod
from tokenmill.model.layers.quantization.formats import BY_ID, FORMATS
from tokenmill.model.layers.quantization.gguf import GGUFConfig
from tokenmill.model.layers.quantization.packed import PackedLinearMethod
from tokenmill.model.layers.quantization.weight_only import QuantizeAtLoadMethod

_MAX_KEPT_BITS = 5.0  # Q4_0, Q4_1, Q4_K stay


def bits_per_weight(qtype: int) -> float:
    f = BY_ID[qtype]
    return f.bytes * 8 / f.block


class RequantizeMethod(QuantizeAtLoadMethod):
    """Loads the GGUF rows as PackedLinearMethod does, then dequantizes every shard and quantizes
    the layer again to one int4 format (round-to-nearest: a draft's load stays fast, and its
    output only has to be likely)."""

    round_to_nearest = True

    def __init__(self, gguf_types: list[int], dense_min_rows: int | None, act_bits: int):
        super().__init__(FORMATS["I4_G128"].id, dense_min_rows, act_bits)
        self.qtypes = list(gguf_types)

    create_weights = PackedLinearMethod.create_weights

    def process_weights_after_loading(self, layer) -> None:
        PackedLinearMethod.process_weights_after_loading(self, layer)  # the loader's x8 shards, as views
        target = next((f for f in (FORMATS["I4_G128"], FORMATS["Q4_1"]) if layer.q_in % f.block == 0), None)
        if target is None:
            return  # int4 groups would not fit its rows: stays as in the file
        dense = torch.empty(layer.q_out, layer.q_in, dtype=torch.float32)
        row = 0
        for view, qt, n in zip(layer.q_views, self.qtypes, layer.q_rows):
            self.ops.dequantize(dense[row:row + n], view, qt, layer.q_in)
            row += n
        layer.weight = nn.Parameter(dense, requires_grad=False)
        self.qtypes = [target.id]
        super().process_weights_after_loading(layer)


class RequantizedGGUFConfig(GGUFConfig):
    name = "gguf-int4"

    def linear_method(self, shard_names: list[str], in_range: tuple[int, int] | None = None) -> LinearMethod:
        method = super().linear_method(shard_names, in_range)
        if type(method) is PackedLinearMethod and any(bits_per_weight(t) > _MAX_KEPT_BITS for t in method.qtypes):
            return RequantizeMethod(method.qtypes, self.dense_min_rows, self.act_bits)
        return method

    def describe(self) -> str:
        return super().describe() + ", those wider than 5 bits/weight requantized to int4"

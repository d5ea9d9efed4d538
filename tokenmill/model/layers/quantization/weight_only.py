"""`--quantization int8|int4` for Hugging Face folders: weight-only, quantized at load.
int8 is symmetric per output channel, round-to-nearest; int4 is asymmetric per group of 32 (GGUF's
Q4_1 layout) or 128 along the input, its scales and minima fitted to the weights (int4_search.py)
and, for groups of 128, to input statistics measured on built-in text (calibration.py). Every
decoder linear layer is quantized; the embedding and the LM head keep the model dtype (as in
vLLM's default). The packed kernels are the GGUF ones."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.errors import ConfigError
from tokenmill.model.layers.linear import UnquantizedLinearMethod, shard_rows_loader
from tokenmill.model.layers.quantization.base import LinearMethod, QuantConfig
from tokenmill.model.layers.quantization.calibration import max_positions, measure_input_scales
from tokenmill.model.layers.quantization.formats import BY_ID, FORMATS, quantize_i8_row, quantize_q4_groups
from tokenmill.model.layers.quantization.packed import PackedLinearMethod

CALIBRATION_TOKENS = 512  # of built-in text, for int4's input-column importance (calibration.py)


class WeightOnlyConfig(QuantConfig):
    def __init__(self, bits: int, group_size: int = 128, dense_min_rows: int | None = None, act_bits: int | str = 16):
        if bits not in (4, 8):
            raise ConfigError(f"weight-only quantization has 8 or 4 bits, not {bits}")
        if bits == 4 and group_size not in (32, 128):
            raise ConfigError(f"int4 groups are 32 or 128 weights, not {group_size}", param="quant_group_size")
        self.bits, self.group_size, self.dense_min_rows, self.act_bits = bits, group_size, dense_min_rows, act_bits
        self.name = f"int{bits}"

    @property
    def format(self):
        if self.bits == 8:
            return FORMATS["I8_ROW"]
        return FORMATS["Q4_1"] if self.group_size == 32 else FORMATS["I4_G128"]

    def linear_method(self, shard_names: list[str], in_range: tuple[int, int] | None = None) -> LinearMethod:
        if shard_names == ["lm_head"]:
            return UnquantizedLinearMethod()
        if in_range is not None and (in_range[0] % self.format.block or in_range[1] % self.format.block):
            return UnquantizedLinearMethod()  # a rank's columns would cut its groups
        return QuantizeAtLoadMethod(self.format.id, self.dense_min_rows, self.act_bits)

    def embedding_method(self, name: str) -> LinearMethod:
        return UnquantizedLinearMethod()

    def before_processing(self, model, source) -> None:
        """int4 in groups of 128: measure each layer's input columns on built-in text
        (calibration.py) so that the zero-point fit weighs their errors (int4_search.py; groups of
        32 measured no gain from it). Skipped with tensor or pipeline parallelism (a rank cannot run
        the whole model alone) and when CALIBRATION_TOKENS is 0."""
        if self.bits != 4 or self.group_size == 32 or not CALIBRATION_TOKENS:
            return
        from tokenmill import distributed

        st = distributed.state()
        if st.tp_size > 1 or st.pp_size > 1:
            return
        ids = self.calibration_ids(source, min(CALIBRATION_TOKENS, max_positions(model)))
        measure_input_scales(model, ids, lambda m: isinstance(m.method, QuantizeAtLoadMethod))

    def describe(self) -> str:
        if self.bits == 8:
            return "int8 weight-only (I8_ROW, round-to-nearest)"
        return f"int4 weight-only ({self.format.name}, error-minimising scales)"


class QuantizeAtLoadMethod(PackedLinearMethod):
    """Loads the dense weight in fp32, then quantizes it (all shards in one format) and drops it."""

    round_to_nearest = False  # int4: min/max rounding instead of the fitted scales (int4_search.py)

    def __init__(self, qtype: int, dense_min_rows: int | None, act_bits: int):
        super().__init__([qtype], dense_min_rows, act_bits)

    def create_weights(self, layer, in_features, shard_sizes, dtype, device) -> None:
        block = FORMATS["I4_G128"].block if self.qtypes[0] == FORMATS["I4_G128"].id else 32
        if in_features % block:
            raise ConfigError(f"{layer.__class__.__name__} with input size {in_features}: not a multiple of "
                              f"{block}, which {BY_ID[self.qtypes[0]].name} quantization needs; use another "
                              f"--quant-group-size or --quantization none", param="quant_group_size")
        layer.weight = nn.Parameter(torch.empty(sum(shard_sizes), in_features, dtype=torch.float32, device=device),
                                    requires_grad=False)
        layer.weight.weight_loader = shard_rows_loader(layer)

    def process_weights_after_loading(self, layer) -> None:
        dense = layer.weight.data
        if self.qtypes[0] == FORMATS["I8_ROW"].id:
            packed = quantize_i8_row(dense)
        else:
            group = FORMATS["Q4_1"].block if self.qtypes[0] == FORMATS["Q4_1"].id else 128
            packed = quantize_q4_groups(dense, group, round_to_nearest=self.round_to_nearest,
                                        input_scale=getattr(layer, "quant_input_scale", None))
            layer.quant_input_scale = None
        layer.q_rows = [dense.shape[0]]
        layer.q_out = dense.shape[0]
        layer.q_in = dense.shape[1]
        layer.q_offsets = [0, packed.numel()]
        layer.weight = nn.Parameter(packed.reshape(-1), requires_grad=False)
        self.process_raw_rows(layer)

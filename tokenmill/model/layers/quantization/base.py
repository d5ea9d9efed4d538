"""The quantization seam, in the manner of vLLM's LinearMethodBase.

Each linear layer (the LM head and the embedding too) owns a `LinearMethod` that creates its
weight parameter, processes it once loaded, and multiplies by it. A `QuantConfig` picks the method
per layer from the checkpoint (so a GGUF that mixes Q4_K, Q6_K and Q8_0 loads as it is), and tells
the loader which tensors to hand over packed rather than dequantized.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn


class LinearMethod(ABC):
    """How one layer stores its weight ([out_features, in_features], possibly several row shards:
    q/k/v, gate/up) and computes y = x W^T + b."""

    @abstractmethod
    def create_weights(self, layer: nn.Module, in_features: int, shard_sizes: list[int], dtype: torch.dtype,
                       device) -> None:
        """Register `layer.weight` (an nn.Parameter with a `weight_loader(param, loaded, shard_id)`)."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:  # noqa: B027 (optional hook)
        """Repack, quantize or drop what loading left behind; called once, after the last tensor."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None,
              out_dtype: torch.dtype | None = None) -> torch.Tensor:
        """x: [tokens, in_features] -> [tokens, out_features] in `out_dtype` (default: x's)."""

    def embed(self, layer: nn.Module, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows `ids` of the weight (for an embedding table)."""
        raise NotImplementedError(f"{type(self).__name__} cannot serve as an embedding")

    def narrow_columns(self, layer: nn.Module, loaded, start: int, size: int, shard_id=None):
        """Input columns [start, start + size) of a checkpoint weight (a row-parallel rank's part)."""
        return loaded.narrow(1, start, size)

    def extra_bytes(self, layer: nn.Module) -> int:
        """Bytes held beyond the layer's parameters (e.g. a dense copy), for memory accounting."""
        return 0


class QuantConfig(ABC):
    """Chooses the method of every layer, by the checkpoint names of its weight's shards."""

    name: str = "abstract"
    # what encodes the built-in calibration text (act_bits.py, weight_only.py): --tokenizer if given,
    # else the model's own (a GGUF without tokenizer metadata, or a folder without tokenizer files,
    # runs with --tokenizer)
    tokenizer: str | None = None
    trust_remote_code: bool = False

    def calibration_ids(self, source, n: int) -> list[int]:
        """The first n tokens of the built-in calibration text."""
        from tokenmill.model.layers.quantization.calibration import calibration_text
        from tokenmill.model.loader import load_tokenizer

        tok = load_tokenizer(source, self.tokenizer, self.trust_remote_code)
        return tok.encode(calibration_text(), add_special_tokens=False)[:n]

    @abstractmethod
    def linear_method(self, shard_names: list[str], in_range: tuple[int, int] | None = None) -> LinearMethod:
        """shard_names: checkpoint names of the weight's shards, e.g. [...q_proj, ...k_proj, ...v_proj].
        in_range: (start, size) of the input columns a row-parallel rank holds (None: all of them); a
        packed format that cannot be split there (not on whole blocks) must choose a dense method."""

    def embedding_method(self, name: str) -> LinearMethod:
        return self.linear_method([name])

    def before_processing(self, model: nn.Module, source) -> None:  # noqa: B027 (optional hook)
        """Called once every tensor is loaded, before any layer processes its weights (e.g. to
        measure activations while the weights are still dense)."""

    def after_processing(self, model: nn.Module, source, dtype) -> None:
        """Called once every layer has processed its weights: `--quant-act-bits auto` is measured
        here (act_bits.py) by the configs whose layers are packed, then, for those codes, the crossover
        on CPU kinds whose tables have none (crossover.py)."""
        if getattr(self, "act_bits", None) == "auto":
            from tokenmill.model.layers.quantization.act_bits import choose_act_bits

            bits = choose_act_bits(model, source, dtype, self.calibration_ids)
            # for a layer made after loading (none today): the codes of the most precise kind chosen
            self.act_bits = max(bits.values(), default=16)
        from tokenmill.model.layers.quantization.crossover import choose_crossovers

        choose_crossovers(model, dtype)

    def packed_tensors(self) -> set[str]:
        """Checkpoint tensors (names with '.weight') the loader must hand over as raw blocks."""
        return set()

    def describe(self) -> str:
        """One line for the start-up log."""
        return self.name

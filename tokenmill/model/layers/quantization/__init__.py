"""Quantization methods for linear layers (the seam: base.LinearMethod / base.QuantConfig)."""

from __future__ import annotations

import logging

import torch

from tokenmill.errors import ConfigError
from tokenmill.model.layers.quantization.base import LinearMethod, QuantConfig

logger = logging.getLogger(__name__)

QUANTIZATIONS = ("auto", "none", "gguf", "int8", "int4")

__all__ = ["LinearMethod", "QuantConfig", "QUANTIZATIONS", "resolve_quantization", "make_quant_config"]


def resolve_quantization(requested: str, source_kind: str, device: torch.device) -> str:
    """The quantization a model runs with: `auto` is `gguf` for a .gguf file on CPU, else `none`.
    Raises ConfigError for a combination that cannot work."""
    if requested == "auto":
        return "gguf" if source_kind == "gguf" and device.type == "cpu" and _kernels_ok(warn=True) else "none"
    if requested == "none":
        return "none"
    if device.type != "cpu":
        raise ConfigError(f"quantization={requested!r} runs on CPU only (its kernels are C++ CPU kernels); "
                          f"use --quantization none on {device.type}", param="quantization")
    if requested == "gguf" and source_kind != "gguf":
        raise ConfigError("quantization='gguf' needs a .gguf model file; for a Hugging Face folder use int8, int4 "
                          "or none", param="quantization")
    if requested in ("int8", "int4") and source_kind != "hf":
        raise ConfigError(f"quantization={requested!r} quantizes the fp32/bf16 weights of a Hugging Face folder; a "
                          f"GGUF file is already quantized: use gguf (its own types) or none", param="quantization")
    if not _kernels_ok(warn=False):
        raise ConfigError(f"quantization={requested!r} needs tokenmill's C++ kernels, which could not be built here "
                          f"(is a C++ compiler installed?)", param="quantization")
    return requested


def _kernels_ok(warn: bool) -> bool:
    from tokenmill.model.quant_kernels import quant_ops

    try:
        quant_ops()
        return True
    except RuntimeError as e:
        if warn:
            logger.warning("%s; GGUF weights are dequantized at load instead", e)
        return False


def make_quant_config(quantization: str, source, group_size: int, dense_min_rows: int | None,
                      act_bits: int | str = 16, tokenizer: str | None = None,
                      trust_remote_code: bool = False) -> QuantConfig | None:
    """tokenizer: --tokenizer, which then encodes the calibration text too."""
    if quantization == "gguf":
        from tokenmill.model.layers.quantization.gguf import GGUFConfig
        from tokenmill.model.loader import gguf_loader

        config = GGUFConfig(gguf_loader.tensor_types(source.path), dense_min_rows, act_bits)
    elif quantization in ("int8", "int4"):
        from tokenmill.model.layers.quantization.weight_only import WeightOnlyConfig

        config = WeightOnlyConfig(8 if quantization == "int8" else 4, group_size, dense_min_rows, act_bits)
    else:
        return None
    config.tokenizer, config.trust_remote_code = tokenizer, trust_remote_code
    return config

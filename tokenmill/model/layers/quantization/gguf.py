"""GGUF weights in their own quantization (vLLM's `quantization="gguf"`): every tensor of a type
the kernels read stays packed as in the file; Q3_K, IQ4_NL and IQ4_XS are rewritten as Q8_0 blocks
(gguf_repack.py); any other quantized type is dequantized at load to the model dtype, with a warning
naming it. Float tensors (norms, biases, F16/F32 matrices) load as they are."""

from __future__ import annotations

import logging

from tokenmill.model.layers.linear import UnquantizedLinearMethod
from tokenmill.model.layers.quantization.base import LinearMethod, QuantConfig
from tokenmill.model.layers.quantization.formats import BY_ID
from tokenmill.model.layers.quantization.gguf_repack import EXACT, REPACKED, kernel_type
from tokenmill.model.layers.quantization.packed import PackedLinearMethod

logger = logging.getLogger(__name__)

NATIVE_GGUF = {f.id for f in BY_ID.values() if f.id < 100}
FLOAT_GGUF = {0: "F32", 1: "F16", 30: "BF16"}


class GGUFConfig(QuantConfig):
    name = "gguf"

    def __init__(self, tensor_types: dict[str, int], dense_min_rows: int | None = None, act_bits: int | str = 16):
        self.file_types = tensor_types  # checkpoint (Hugging Face) name -> ggml type id in the file
        self.tensor_types = {n: kernel_type(t) for n, t in tensor_types.items()}  # -> the type the kernels read
        self.dense_min_rows = dense_min_rows
        self.act_bits = act_bits
        self._packed: set[str] = set()
        self._warned: set[int] = set()
        self._logged: set[int] = set()

    def linear_method(self, shard_names: list[str], in_range: tuple[int, int] | None = None) -> LinearMethod:
        names = [f"{n}.weight" for n in shard_names]
        types = [self.tensor_types.get(n) for n in names]
        if all(t in NATIVE_GGUF for t in types) and not split_within_blocks(types, in_range):
            self._packed.update(names)
            self._log_repacked(names)
            return PackedLinearMethod(types, self.dense_min_rows, self.act_bits)
        for n in names:
            t = self.file_types.get(n)
            if t is not None and t not in NATIVE_GGUF and t not in FLOAT_GGUF and t not in self._warned:
                self._warned.add(t)
                logger.warning("GGUF type %s has no native kernel in tokenmill: its tensors (e.g. %s) are "
                               "dequantized at load", _type_name(t), n)
        return UnquantizedLinearMethod()

    def _log_repacked(self, names: list[str]) -> None:
        for n in names:
            t = self.file_types.get(n)
            if t in REPACKED and t not in self._logged:
                self._logged.add(t)
                logger.info("GGUF type %s has no kernel of its own: its tensors (e.g. %s) run as %s blocks, %s, at "
                            "%.1fx their bytes in the file", _type_name(t), n, BY_ID[REPACKED[t]].name,
                            "the same weights exactly" if t in EXACT else "scales rounded to fp16 (within 2^-11)",
                            BY_ID[REPACKED[t]].bytes / BY_ID[REPACKED[t]].block / _file_bytes_per_weight(t))

    def packed_tensors(self) -> set[str]:
        return self._packed

    def describe(self) -> str:
        counts: dict[str, int] = {}
        for n in self._packed:
            name = BY_ID[self.tensor_types[n]].name
            if self.file_types[n] in REPACKED:
                name += f" from {_type_name(self.file_types[n])}"
            counts[name] = counts.get(name, 0) + 1
        return "gguf (" + ", ".join(f"{k} x{v}" for k, v in sorted(counts.items())) + ")"


def split_within_blocks(types: list[int | None], in_range: tuple[int, int] | None) -> bool:
    """Whether a row-parallel split at `in_range` would cut a block of one of these formats (the
    layer is then dequantized at load: a packed weight splits along whole blocks only)."""
    if in_range is None:
        return False
    start, size = in_range
    cut = any(t in BY_ID and (start % BY_ID[t].block or size % BY_ID[t].block) for t in types)
    if cut:
        logger.info("input columns %d..%d of a row-parallel layer split %s blocks: dequantized at load", start,
                    start + size, "/".join(BY_ID[t].name for t in types if t in BY_ID))
    return cut


def _file_bytes_per_weight(t: int) -> float:
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[GGMLQuantizationType(t)]
    return size / block


def _type_name(t: int) -> str:
    try:
        from gguf.constants import GGMLQuantizationType

        return GGMLQuantizationType(t).name
    except (ImportError, ValueError):
        return f"type {t}"

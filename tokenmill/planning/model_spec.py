"""What the planner knows about a model without loading its weights: parameter counts, weight and KV
bytes for a dtype or quantization, and a fingerprint that ties a calibration profile to them."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

from tokenmill.config import EngineConfig
from tokenmill.model.model_config import ModelConfig

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class ModelSpec:
    name: str
    config: ModelConfig
    dtype: str  # activations and dense weights: float32 / bfloat16 / float16
    quantization: str  # none, gguf, int8, int4
    kv_cache_dtype: str
    weight_bytes: int
    kv_bytes_per_token: int
    linear_params: int  # weights of the per-token GEMMs (attention and MLP projections)

    @property
    def dtype_bytes(self) -> int:
        return _DTYPE_BYTES[self.dtype]

    @property
    def linear_weight_bytes(self) -> float:
        """Bytes a decode step streams through the GEMMs (the LM head is counted per sampled row)."""
        share = self.linear_params / max(total_params(self.config), 1)
        return self.weight_bytes * share

    def fingerprint(self) -> dict:
        """What a step's cost depends on: the architecture's dimensions and how weights are stored."""
        c = self.config
        dims = [c.architecture, c.vocab_size, c.hidden_size, c.intermediate_size, c.num_hidden_layers,
                c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.tie_word_embeddings, c.attention_bias]
        digest = hashlib.sha256(json.dumps(dims).encode()).hexdigest()[:16]
        return {"name": self.name, "architecture": c.architecture, "dims": digest, "dtype": self.dtype,
                "quantization": self.quantization, "kv_cache_dtype": self.kv_cache_dtype}


def _linear_shapes(c: ModelConfig) -> list[tuple[int, int]]:
    """(out, in) of one layer's qkv, o, gate_up and down projections."""
    return [((c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim, c.hidden_size),
            (c.hidden_size, c.num_attention_heads * c.head_dim), (2 * c.intermediate_size, c.hidden_size),
            (c.hidden_size, c.intermediate_size)]


def linear_params(c: ModelConfig) -> int:
    return c.num_hidden_layers * sum(n * k for n, k in _linear_shapes(c))


def quantized_linear_bytes(c: ModelConfig, quant: str, group_size: int) -> int:
    """The linear layers as `--quantization int8|int4` stores them (layers/quantization/formats.py):
    int8 rows of [float32 scale][K int8]; int4 blocks of 32 (Q4_1, 20 bytes) or 128 (68 bytes)."""
    def row(k: int) -> int:
        if quant == "int8":
            return 4 + k
        return k // 32 * 20 if group_size == 32 else k // 128 * 68

    return c.num_hidden_layers * sum(n * row(k) for n, k in _linear_shapes(c))


def total_params(c: ModelConfig) -> int:
    """As the model holds them: embeddings, projections (and q/k/v biases), norms, an untied LM head."""
    bias = (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim if c.attention_bias else 0
    norms = (2 * c.num_hidden_layers + 1) * c.hidden_size
    head = 0 if c.tie_word_embeddings else c.vocab_size * c.hidden_size
    return c.vocab_size * c.hidden_size + linear_params(c) + c.num_hidden_layers * bias + norms + head


def _gguf_resident_bytes(source, dtype_bytes: int) -> int:
    """Bytes of the GGUF's tensors as `quantization="gguf"` holds them: a type the kernels read as
    stored; Q3_K, IQ4_NL and IQ4_XS as Q8_0 blocks (8.5 bits a weight); any other type, and float
    tensors, at the model dtype (layers/quantization/gguf.py)."""
    import numpy as np

    from tokenmill.model.layers.quantization.formats import BY_ID, row_bytes
    from tokenmill.model.layers.quantization.gguf_repack import REPACKED
    from tokenmill.model.loader import gguf_loader

    index = json.loads((gguf_loader.prepare(source.path) / "tensors.json").read_text())
    total = 0
    for t in index.values():
        weights = int(np.prod(t["shape"]))
        if t["type"] in REPACKED:
            total += t["shape"][0] * row_bytes(REPACKED[t["type"]], weights // t["shape"][0])
        elif t["type"] in BY_ID:
            total += int(np.prod(t["data_shape"])) * np.dtype(t["data_dtype"]).itemsize
        else:
            total += weights * dtype_bytes
    return total


def resolve_quantization(config: EngineConfig, source) -> str:
    """none, gguf, int8 or int4. Engines without a quantization option run dense weights."""
    q = getattr(config.quant, "quantization", "none")
    if q == "auto":
        return "gguf" if source.kind == "gguf" and config.model.torch_device.type == "cpu" else "none"
    return q


def model_spec(config: EngineConfig) -> ModelSpec:
    """Resolve the model (a clear ConfigError if unknown) and size it for the configured dtype."""
    from tokenmill.model.attention.quant_kv import bytes_per_token_head, storage_dtype
    from tokenmill.model.loader import load_model_config, resolve_model

    source = resolve_model(config.model.model)
    mc = load_model_config(source)
    dtype = str(config.model.torch_dtype).removeprefix("torch.")
    quant = resolve_quantization(config, source)
    dense = total_params(mc) * _DTYPE_BYTES[dtype]
    if quant == "gguf":
        weights = _gguf_resident_bytes(source, _DTYPE_BYTES[dtype])
    elif quant in ("int8", "int4"):
        weights = (dense - linear_params(mc) * _DTYPE_BYTES[dtype]
                   + quantized_linear_bytes(mc, quant, config.quant.quant_group_size))
    else:
        weights = dense
    kv_dtype = getattr(config.cache, "kv_cache_dtype", "auto") or "auto"
    # as the worker sizes it (scales included): worker.Worker.kv_bytes_per_token
    per_head = bytes_per_token_head(storage_dtype(kv_dtype, config.model.torch_dtype), config.model.torch_dtype,
                                    mc.head_dim)
    kv_bytes = 2 * mc.num_hidden_layers * mc.num_key_value_heads * per_head
    return ModelSpec(source.name, mc, dtype, quant, kv_dtype, int(weights), kv_bytes, linear_params(mc))

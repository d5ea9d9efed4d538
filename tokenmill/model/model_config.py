"""The model's hyper-parameters, normalized from a Hugging Face config.json or GGUF metadata."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from tokenmill.errors import ConfigError


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2)
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    name: str = ""

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V, every layer: 2 x layers x kv_heads x head_dim (times the dtype size)."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> ModelConfig:
        return cls(**d)

    @classmethod
    def from_hf(cls, hf: dict, name: str = "") -> ModelConfig:
        archs = hf.get("architectures") or []
        if not archs:
            raise ConfigError("config.json has no 'architectures'")
        try:
            heads = hf["num_attention_heads"]
            hidden = hf["hidden_size"]
            # transformers >= 5 nests rope settings under rope_parameters
            rope = dict(hf.get("rope_parameters") or {})
            theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
            scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
            if scaling is not None:
                scaling = dict(scaling)
                scaling.setdefault("rope_type", scaling.get("type", "default"))
            eos = hf.get("eos_token_id")
            return cls(
                architecture=archs[0],
                vocab_size=hf["vocab_size"],
                hidden_size=hidden,
                intermediate_size=hf["intermediate_size"],
                num_hidden_layers=hf["num_hidden_layers"],
                num_attention_heads=heads,
                num_key_value_heads=hf.get("num_key_value_heads") or heads,
                head_dim=hf.get("head_dim") or hidden // heads,
                rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
                rope_theta=float(theta),
                rope_scaling=scaling if scaling and scaling["rope_type"] != "default" else None,
                max_position_embeddings=hf.get("max_position_embeddings", 4096),
                tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                attention_bias=bool(hf.get("attention_bias", archs[0] == "Qwen2ForCausalLM")),
                bos_token_id=hf.get("bos_token_id"),
                eos_token_id=[eos] if isinstance(eos, int) else list(eos or []),
                name=name,
            )
        except KeyError as e:
            raise ConfigError(f"config.json is missing {e}") from None

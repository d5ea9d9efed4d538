"""Model registry: Hugging Face architecture name -> model class."""

from __future__ import annotations

from torch import nn

from tokenmill.errors import ConfigError
from tokenmill.model.llama import LlamaForCausalLM
from tokenmill.model.qwen2 import Qwen2ForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
}


def get_model_class(architecture: str) -> type[nn.Module]:
    try:
        return MODEL_REGISTRY[architecture]
    except KeyError:
        raise ConfigError(f"unsupported architecture {architecture!r}; supported: "
                          f"{', '.join(sorted(MODEL_REGISTRY))}") from None

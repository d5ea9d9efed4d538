"""Qwen2: a Llama-family decoder with bias on the q/k/v projections (usually an untied head)."""

from __future__ import annotations

from dataclasses import replace

from tokenmill.model.llama import LlamaForCausalLM
from tokenmill.model.model_config import ModelConfig


class Qwen2ForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig, *args, **kwargs):
        super().__init__(replace(cfg, attention_bias=True), *args, **kwargs)

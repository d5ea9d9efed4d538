"""Load a Hugging Face model folder: config.json, *.safetensors (or *.bin), tokenizer files."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch

from tokenmill.errors import ConfigError
from tokenmill.model.model_config import ModelConfig


def load_config(path: Path) -> ModelConfig:
    return ModelConfig.from_hf(json.loads((path / "config.json").read_text()), name=path.name)


def iter_weights(path: Path, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    files = sorted(path.glob("*.safetensors"))
    if files:
        from safetensors import safe_open

        for f in files:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    yield name, st.get_tensor(name).to(dtype)
        return
    files = sorted(path.glob("pytorch_model*.bin"))
    if not files:
        raise ConfigError(f"{path} has no *.safetensors or pytorch_model*.bin weights")
    for f in files:
        for name, t in torch.load(f, map_location="cpu", weights_only=True).items():
            yield name, t.to(dtype)


def count_tensors(path: Path) -> int | None:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return len(json.loads(index.read_text())["weight_map"])
    files = sorted(path.glob("*.safetensors"))
    if len(files) == 1:
        from safetensors import safe_open

        with safe_open(str(files[0]), framework="pt") as st:
            return len(list(st.keys()))
    return None

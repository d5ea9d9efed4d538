"""Load a Hugging Face model folder: config.json, *.safetensors (or *.bin), tokenizer files."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from tokenmill.errors import ConfigError
from tokenmill.model.model_config import ModelConfig

if TYPE_CHECKING:  # torch only where weights are read: the front end reads metadata without it
    import torch


def load_config(path: Path) -> ModelConfig:
    cfg = ModelConfig.from_hf(json.loads((path / "config.json").read_text()), name=path.name)
    # generation_config.json's EOS list is what generate() stops on (as vLLM does): an instruct
    # model's config.json often names only its end of turn
    try:
        eos = json.loads((path / "generation_config.json").read_text()).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        eos = None
    eos = [eos] if isinstance(eos, int) else eos if isinstance(eos, list) else []
    cfg.eos_token_id = sorted(set(cfg.eos_token_id) | {t for t in eos if isinstance(t, int)})
    return cfg


class LazyTensor:
    """A safetensors tensor not read yet: a tensor-parallel rank reads only its rows or columns
    (`narrow`), a whole-tensor loader reads it all (`to`). Both give `dtype` first, as a full read
    would."""

    def __init__(self, view, dtype: torch.dtype):
        self.view, self.dtype = view, dtype
        self.shape = tuple(view.get_shape())

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = (slice(None),) * dim + (slice(start, start + length),)
        return self.view[index].to(self.dtype)

    def to(self, dtype: torch.dtype) -> torch.Tensor:
        return self.view[:].to(self.dtype).to(dtype)


def iter_weights(path: Path, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor | LazyTensor]]:
    files = sorted(path.glob("*.safetensors"))
    if files:
        from safetensors import safe_open

        for f in files:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    yield name, LazyTensor(st.get_slice(name), dtype)
        return
    files = sorted(path.glob("pytorch_model*.bin"))
    if not files:
        raise ConfigError(f"{path} has no *.safetensors or pytorch_model*.bin weights")
    import torch

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

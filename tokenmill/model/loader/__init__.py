"""Model loading: resolve the source, read its config and tokenizer. Building the model and reading
its weights is in build.py: this package's own names import no torch, so the server's front end,
which needs only these, starts without it."""

from __future__ import annotations

from tokenmill.model.loader import gguf_loader, hf_loader
from tokenmill.model.loader.source import ModelSource, resolve_model
from tokenmill.model.model_config import ModelConfig

__all__ = ["ModelSource", "resolve_model", "load_model_config", "load_tokenizer", "metadata_cached"]


def load_model_config(source: ModelSource) -> ModelConfig:
    if source.kind == "gguf":
        return gguf_loader.load_config(source.path)
    return hf_loader.load_config(source.path)


def metadata_cached(source: ModelSource) -> bool:
    """Whether reading this model's config needs no pass over its weights file: a folder, or a GGUF
    indexed before (a warm start)."""
    return source.kind != "gguf" or gguf_loader.is_prepared(source.path)


def load_tokenizer(source: ModelSource, override: str | None = None, trust_remote_code: bool = False):
    from tokenmill.model.loader.hf_import import load_auto_tokenizer, load_named_tokenizer

    if override:
        return load_auto_tokenizer(override, trust_remote_code=trust_remote_code)
    if source.kind == "gguf":
        return load_named_tokenizer(str(gguf_loader.tokenizer_dir(source.path)), trust_remote_code=trust_remote_code)
    return load_auto_tokenizer(str(source.path), trust_remote_code=trust_remote_code)

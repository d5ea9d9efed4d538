"""One lock around loading a tokenizer with transformers. transformers imports its modules lazily,
and two threads doing so at once can fail with "cannot import name 'AutoTokenizer'": the engine
loads the tokenizer in a thread while the worker builds the model, which may tokenize built-in
text meanwhile (act_bits.py, calibration.py)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

_lock = threading.Lock()


def load_auto_tokenizer(path: str, **kwargs):
    with _lock:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path, **kwargs)


def load_named_tokenizer(path: str, **kwargs):
    """The class tokenizer_config.json names, for a folder without config.json (a GGUF's converted
    tokenizer), where AutoTokenizer picks that class too (tests/test_tokenizer_loading.py). AutoTokenizer
    first reads the model configuration classes, which import torch: 1.4 s of the server's start-up,
    whose front end needs no torch otherwise. Any other folder: AutoTokenizer."""
    folder = Path(path)
    try:
        name = json.loads((folder / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError):
        name = None
    if not isinstance(name, str) or (folder / "config.json").exists():
        return load_auto_tokenizer(path, **kwargs)
    with _lock:
        import transformers

        cls = getattr(transformers, name, None)
        if cls is not None and hasattr(cls, "from_pretrained"):
            return cls.from_pretrained(path, **kwargs)
    return load_auto_tokenizer(path, **kwargs)

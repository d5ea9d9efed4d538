"""One lock around loading a tokenizer with transformers. transformers imports its modules lazily,
and two threads doing so at once can fail with "cannot import name 'AutoTokenizer'": the engine
loads the tokenizer in a thread while the worker builds the model, which may tokenize built-in
text meanwhile (act_bits.py, calibration.py)."""

from __future__ import annotations

import threading

_lock = threading.Lock()


def load_auto_tokenizer(path: str, **kwargs):
    with _lock:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path, **kwargs)

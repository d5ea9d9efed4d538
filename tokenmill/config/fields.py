"""Helpers the config groups share: a field with help text, byte sizes, common checks."""

from __future__ import annotations

import os
import re
from dataclasses import field

from tokenmill.errors import ConfigError

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4,
          "ki": 1024, "mi": 1024**2, "gi": 1024**3, "ti": 1024**4}


def opt(help: str, default=None, choices: list | None = None, **kw):
    """A config field: its help text and choices become the CLI flag's."""
    meta = {"help": help}
    if choices is not None:
        meta["choices"] = choices
    if "default_factory" in kw:
        return field(metadata=meta, **kw)
    return field(default=default, metadata=meta, **kw)


def parse_size(value: int | float | str) -> int:
    """Parse a byte size: 1048576, '512MiB', '4GiB', '2GB' (decimal), '1.5g'."""
    if isinstance(value, bool):
        raise ConfigError(f"invalid size {value!r}")
    if isinstance(value, (int, float)):
        return int(value)
    m = _SIZE_RE.match(str(value))
    if not m:
        raise ConfigError(f"invalid size {value!r}: use bytes or a unit like 512MiB, 4GiB")
    unit = (m.group(2) or "").lower().rstrip("b")
    return int(float(m.group(1)) * _UNITS[unit])


def check_positive(obj, *names: str, allow_none: bool = False) -> None:
    for name in names:
        v = getattr(obj, name)
        if v is None and allow_none:
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ConfigError(f"{name} must be a positive integer, got {v!r}", param=name)


def check_bool(obj, *names: str) -> None:
    for name in names:
        if not isinstance(getattr(obj, name), bool):
            raise ConfigError(f"{name} must be a bool, got {getattr(obj, name)!r}", param=name)


def check_choice(obj, name: str, choices) -> None:
    v = getattr(obj, name)
    if v not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(map(str, choices))}; got {v!r}", param=name)


def available_memory_bytes() -> int:
    """MemAvailable on Linux; a conservative fallback elsewhere."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")

"""The on-disk cache for what is slow to rebuild (GGUF metadata, converted tokenizers, assembled
model files), keyed by the source file's sha256."""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from tokenmill.errors import ConfigError

logger = logging.getLogger(__name__)


def cache_root() -> Path:
    root = os.environ.get("TOKENMILL_CACHE_DIR")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "tokenmill"


def cache_dir(*parts: str) -> Path:
    """A folder under the cache, created; a clear error when the cache cannot be written."""
    path = cache_root().joinpath(*parts)
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = tempfile.NamedTemporaryFile(dir=path, prefix=".probe-")
        probe.close()
    except OSError as e:
        raise ConfigError(f"the cache directory {cache_root()} is not writable ({e.strerror or e}); "
                          "set TOKENMILL_CACHE_DIR to a writable folder") from None
    return path


class VerdictFile:
    """A small JSON file of measured verdicts in the cache folder (act_bits.py, crossover.py): read
    whole; written best effort by atomic replace, as a read-only cache only costs the measurement
    next time. `path`: a file elsewhere (tests)."""

    def __init__(self, name: str, path: Path | None = None) -> None:
        self.name, self._path = name, path

    @property
    def path(self) -> Path:
        return self._path or cache_root() / self.name

    def read(self) -> dict:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}

    def put(self, key: str, entry: dict, keep=lambda key: True) -> None:
        """Adds key; the other entries stay where keep(their key)."""
        path = self.path
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            data = {k: v for k, v in self.read().items() if keep(k)}
            data[key] = entry
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(data, indent=1))
            tmp.replace(path)
        except OSError as e:
            logger.debug("could not keep a verdict in %s: %s", path, e)


def remove_stale(folder: Path, pattern: str, older_than: float = 3600.0) -> None:
    """Delete what a killed process left half-built (temporary files and folders that are never
    published). Only old ones: a live process may be writing a young one."""
    import time

    now = time.time()
    for leftover in folder.glob(pattern):
        try:
            if now - leftover.stat().st_mtime > older_than:
                shutil.rmtree(leftover) if leftover.is_dir() else leftover.unlink()
        except OSError:
            pass


def file_sha256(path: Path) -> str:
    """sha256 of a file, remembered by (path, size, mtime) so a big file is hashed once."""
    st = path.stat()
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
    index = cache_root() / "hashes.json"
    try:
        known = json.loads(index.read_text())
    except (OSError, ValueError):
        known = {}
    if key in known:
        return known[key]
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    digest = h.hexdigest()
    known[key] = digest
    try:
        atomic_write_text(index, json.dumps(known))
    except OSError:
        pass  # a read-only cache only costs a re-hash
    return digest


def atomic_write_text(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def build_once(lock_path: Path, done: Callable[[], bool], build: Callable[[], None]) -> None:
    """Run `build` unless `done()`, once across threads and processes: under an exclusive file lock,
    `done` asked again once it is held. Each call opens the lock file anew, so threads of one process
    wait on each other too; the kernel drops the lock when its holder dies (even by SIGKILL), so a
    dead builder never blocks the next."""
    if done():
        return
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done():
            build()


def publish_dir(tmp_dir: Path, final: Path) -> None:
    """Move a fully written directory into place; if another process won the race, keep theirs."""
    final.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.rename(tmp_dir, final)
    except OSError:
        shutil.rmtree(tmp_dir, ignore_errors=True)

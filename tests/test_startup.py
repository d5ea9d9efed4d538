"""Start-up failures are one clear line and a non-zero exit, never a hang: a port in use, a
truncated or corrupt GGUF, an unwritable cache directory, no C++ compiler."""

from __future__ import annotations

import socket

import pytest

from tests.server_utils import private_cache, serve_until_exit

pytestmark = pytest.mark.slow


def errors(log: str) -> list[str]:
    return [line for line in log.splitlines() if " ERROR " in line or line.startswith("tokenmill: error")]


def test_port_in_use_is_one_line_and_loads_nothing():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, log = serve_until_exit("--port", str(port), timeout=60)
    assert code == 1, log
    assert errors(log) == [f"tokenmill: error: cannot listen on 127.0.0.1:{port}: Address already in use; "
                           "another process is listening there (choose one with --port)"], log
    assert "failed to load the model" not in log and "loaded" not in log  # the model was never loaded


@pytest.mark.parametrize("damage", ["truncated", "garbage", "header-only"])
def test_damaged_gguf_is_one_clear_error(tmp_path, smol_path, damage):
    data = smol_path.read_bytes()
    bad = tmp_path / "model.gguf"
    bad.write_bytes({"truncated": data[: len(data) // 2], "garbage": bytes(range(256)) * 8,
                     "header-only": data[:4096]}[damage])
    cache = private_cache(tmp_path / "cache")  # no kernel build competes with the failing load
    code, log = serve_until_exit(str(bad), env={"TOKENMILL_CACHE_DIR": str(cache)})
    assert code == 1, log
    [line] = errors(log)
    assert f"failed to load the model: {bad} is not a readable GGUF file" in line and "truncated or corrupt" in line
    assert not list((tmp_path / "cache").glob("gguf/*/tensors.json"))  # nothing half-made is cached


def test_unwritable_cache_dir_is_one_clear_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    code, log = serve_until_exit(env={"TOKENMILL_CACHE_DIR": str(blocker / "cache")})
    assert code == 1, log
    [line] = errors(log)
    assert f"the cache directory {blocker / 'cache'} is not writable" in line and "TOKENMILL_CACHE_DIR" in line


def test_missing_compiler(tmp_path):
    # the attention kernels are not built yet; the rest (quantized GEMMs, model files) is the session's
    cache = private_cache(tmp_path / "cache", rebuild="tokenmill_cpu_kernels", model_files=True)
    env = {"TOKENMILL_CACHE_DIR": str(cache), "CXX": str(tmp_path / "no-such-c++")}
    code, log = serve_until_exit("--attention-backend", "cpu_paged", env=env)
    assert code == 1, log
    [line] = errors(log)
    assert "cpu_paged attention backend is unavailable: no C++ compiler" in line and "set CXX" in line

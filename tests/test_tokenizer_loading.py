"""A GGUF's tokenizer loads as the class its tokenizer_config.json names, not through AutoTokenizer
(whose model-config machinery imports torch, which the server's front end otherwise never needs):
it must be the tokenizer AutoTokenizer gives, token for token. And the front end that results
starts without torch."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from tests.server_utils import ServerProcess
from tokenmill.model.loader import gguf_loader, load_tokenizer, resolve_model

TEXTS = ["Hello world", "def f(x):\n    return x ** 2  # ünïcödé 你好 🙂", " leading space", "a" * 40 + "\t\n\r  x",
         "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>"]
CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "2+2?"}]


def gguf_sources():
    out = []
    for name in ("smollm2-135m", "qwen2.5-coder-0.5b"):
        try:
            out.append(pytest.param(resolve_model(name), id=name))
        except Exception:  # noqa: BLE001 - Qwen is optional (make install-qwen)
            out.append(pytest.param(None, id=name, marks=pytest.mark.skip(reason=f"{name} not installed")))
    return out


@pytest.mark.parametrize("source", gguf_sources())
def test_gguf_tokenizer_is_what_auto_tokenizer_loads(source):
    ours = load_tokenizer(source)
    auto = AutoTokenizer.from_pretrained(str(gguf_loader.tokenizer_dir(source.path)))
    assert type(ours) is type(auto)
    assert len(ours) == len(auto) and ours.all_special_ids == auto.all_special_ids
    assert (ours.bos_token_id, ours.eos_token_id, ours.pad_token_id) == (auto.bos_token_id, auto.eos_token_id,
                                                                         auto.pad_token_id)
    for text in TEXTS:
        ids = auto.encode(text)
        assert ours.encode(text) == ids
        assert ours.decode(ids) == auto.decode(ids)
    assert ours.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True) == \
        auto.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)


_CONVERT_IN_A_CHILD = """
import sys
from pathlib import Path
from tokenmill.model.loader import gguf_loader, hf_import
real = hf_import.load_auto_tokenizer
def counted(*a, **k):
    open(sys.argv[2], "a").write("child\\n")
    return real(*a, **k)
hf_import.load_auto_tokenizer = counted
print(gguf_loader.tokenizer_dir(Path(sys.argv[1])))
"""


@pytest.mark.parametrize("source", gguf_sources())
def test_gguf_conversion_writes_what_transformers_alone_writes(source, tmp_path, monkeypatch):
    """tokenizer_dir converts with gguf's reader swapped for the fast one (gguf_loader.py), and once when
    two threads and another process ask at the same time (a server's front end and engine core): the
    files must be those of transformers' own conversion."""
    import filecmp
    import subprocess
    import sys
    import threading

    from tokenmill.model.loader import hf_import

    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    gguf_loader.prepare(source.path)
    count = tmp_path / "conversions"
    real = hf_import.load_auto_tokenizer
    monkeypatch.setattr(hf_import, "load_auto_tokenizer",
                        lambda *a, **k: count.open("a").write("here\n") and real(*a, **k))
    child = subprocess.Popen([sys.executable, "-c", _CONVERT_IN_A_CHILD, str(source.path), str(count)],
                             stdout=subprocess.PIPE, text=True)
    dirs = []
    threads = [threading.Thread(target=lambda: dirs.append(gguf_loader.tokenizer_dir(source.path))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out, _ = child.communicate(timeout=300)
    assert child.returncode == 0 and out.strip() == str(dirs[0])
    assert len(count.read_text().splitlines()) == 1 and len(dirs) == 2 and dirs[0] == dirs[1]
    plain = tmp_path / "plain"
    AutoTokenizer.from_pretrained(str(source.path.parent), gguf_file=source.path.name).save_pretrained(str(plain))
    names = sorted(p.name for p in plain.iterdir())
    assert names == sorted(p.name for p in dirs[0].iterdir())
    assert all(filecmp.cmp(plain / n, dirs[0] / n, shallow=False) for n in names)
    import gguf

    assert gguf.GGUFReader.__name__ == "GGUFReader", "the fast reader was left in gguf's module"


def test_gguf_without_a_tokenizer_is_a_clear_error(tmp_path, monkeypatch):
    """A GGUF whose header has no vocabulary (tests/tiny_gguf.py writes none): a ConfigError that names
    --tokenizer, not transformers' KeyError, and nothing half-built left in the cache."""
    from tests.tiny_gguf import write_tiny_kquant_gguf
    from tokenmill.errors import ConfigError

    monkeypatch.setenv("TOKENMILL_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "no-vocabulary.gguf"
    write_tiny_kquant_gguf(path)
    with pytest.raises(ConfigError, match="--tokenizer") as e:
        gguf_loader.tokenizer_dir(path)
    assert e.value.param == "tokenizer"
    folder = gguf_loader.prepare(path)
    assert not (folder / "tokenizer").exists() and not list(folder.glob(".build-*"))


@pytest.mark.slow
def test_server_front_end_runs_without_torch():
    srv = ServerProcess().wait_ready()
    try:
        children = open(f"/proc/{srv.proc.pid}/task/{srv.proc.pid}/children").read().split()
        maps = {pid: open(f"/proc/{pid}/maps").read() for pid in [str(srv.proc.pid), *children]}
        assert any("libtorch" in m for m in maps.values()), "no process of the server has torch: a wrong check"
        assert "libtorch" not in maps[str(srv.proc.pid)], "the front end loaded torch (~1.5 s of every start-up)"
    finally:
        assert srv.stop() == 0

"""Load a GGUF file: metadata -> ModelConfig, tensors dequantized to the target dtype (Llama's Q/K
row permutation undone), tokenizer and chat template converted by transformers.

Parsing a GGUF header with `gguf.GGUFReader` and converting its tokenizer take seconds, so the
first load writes the config and a tensor index under the cache, keyed by the file's sha256, and
the first tokenizer load the converted tokenizer beside them; later loads memory-map the file and
read tensors straight from the index.
"""

from __future__ import annotations

import contextlib
import functools
import json
import shutil
import tempfile
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from tokenmill.errors import ConfigError
from tokenmill.model.loader.cache import build_once, cache_dir, cache_root, file_sha256, publish_dir, remove_stale
from tokenmill.model.model_config import ModelConfig
from tokenmill.model.special_tokens import end_of_generation_ids

if TYPE_CHECKING:  # torch only where weights are read: the front end reads metadata without it
    import torch

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def hf_tensor_name(gguf_name: str) -> str | None:
    parts = gguf_name.split(".")
    if parts[0] == "blk":
        mapped = _LAYER_NAMES.get(parts[2])
        return mapped and f"model.layers.{parts[1]}.{mapped}.{parts[3]}"
    mapped = _TOP_NAMES.get(parts[0])
    return mapped and f"{mapped}.{parts[1]}"


# the cache folder's version: a config read differently takes a new folder (the old one is removed)
_LAYOUT = 2  # 2: every end-of-generation token in the config's eos_token_id


def _cache_dir(path: Path) -> Path:
    return cache_root() / "gguf" / f"{file_sha256(path)[:24]}.{_LAYOUT}"


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _model_config(reader, tensors: dict[str, dict], name: str) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in ARCHITECTURES:
        raise ConfigError(f"GGUF architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}")

    def p(key, default=None):
        return _field(reader, f"{arch}.{key}", default)

    hidden, heads = p("embedding_length"), p("attention.head_count")
    kv_heads = p("attention.head_count_kv", heads)
    scaling = None
    kind = p("rope.scaling.type")
    if kind in ("linear", "yarn"):
        scaling = {"rope_type": kind, "factor": p("rope.scaling.factor"),
                   "original_max_position_embeddings": p("rope.scaling.original_context_length")}
    # every token that ends generation, as llama.cpp counts them: the file names its EOS (and maybe
    # EOT, EOM and FIM separators); the rest are found by their text
    named = [_field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom", "fim_pad", "fim_rep",
                                                                      "fim_sep")]
    tokens = _field(reader, "tokenizer.ggml.tokens", [])
    eos = {t for t in named if t is not None} | end_of_generation_ids(enumerate(tokens))
    return ModelConfig(
        architecture=ARCHITECTURES[arch],
        vocab_size=tensors["token_embd.weight"]["shape"][0],
        hidden_size=hidden,
        intermediate_size=p("feed_forward_length"),
        num_hidden_layers=p("block_count"),
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=p("attention.key_length", hidden // heads),
        rms_norm_eps=p("attention.layer_norm_rms_epsilon", 1e-6),
        rope_theta=float(p("rope.freq_base", 10000.0)),
        rope_scaling=scaling,
        max_position_embeddings=p("context_length", 4096),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias=arch == "qwen2",
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=sorted(set(eos)),
        name=_field(reader, "general.name", name),
    )


def _unreadable(path: Path, why: str) -> ConfigError:
    return ConfigError(f"{path} is not a readable GGUF file: {why}. It may be truncated or corrupt: "
                       "copy or reinstall it again")


@functools.cache
def _header_reader_class():
    import gguf

    class HeaderReader(gguf.GGUFReader):
        """Parses over a plain ndarray view of its memory map: slicing a numpy memmap costs ~3x a plain
        array's, and a 150k-token vocabulary with its merges is ~1.5 M slices (Qwen2.5-Coder: 9-11 s
        -> 3 s on a Zen 3). The same bytes, the same fields."""

        def _build_fields(self, *args, **kwargs):
            self.data = self.data.view(np.ndarray)
            return super()._build_fields(*args, **kwargs)

    return HeaderReader


def _header_reader(path: Path):
    return _header_reader_class()(str(path))


@contextlib.contextmanager
def _fast_reader_in_transformers():
    """transformers finds a llama or qwen2 GGUF's tokenizer class from a config it builds with
    `gguf.GGUFReader` (imported by name at each call): the same slow parse as ours was, ~2/3 of a
    first tokenizer conversion. It gets the fast reader for the conversion (any other caller meanwhile
    gets the same fields; tokenizer_dir's lock keeps conversions apart)."""
    import gguf

    slow = gguf.GGUFReader
    gguf.GGUFReader = _header_reader_class()
    try:
        yield
    finally:
        gguf.GGUFReader = slow


def _read_tensors(path: Path):
    try:
        reader = _header_reader(path)
        tensors = {}
        for t in reader.tensors:
            tensors[t.name] = {"type": int(t.tensor_type), "offset": int(t.data_offset),
                               "data_shape": list(t.data.shape), "data_dtype": str(t.data.dtype),
                               "shape": [int(x) for x in reversed(t.shape.tolist())]}
    except Exception as e:  # gguf raises ValueError, IndexError, struct errors... on a damaged header
        raise _unreadable(path, " ".join(str(e).split()).rstrip(".") or type(e).__name__) from None
    size = path.stat().st_size
    end = max((t["offset"] + int(np.prod(t["data_shape"])) * np.dtype(t["data_dtype"]).itemsize
               for t in tensors.values()), default=0)
    if end > size or "token_embd.weight" not in tensors:
        raise _unreadable(path, f"its tensors need {end} bytes, the file has {size}" if end > size
                          else "it has no token_embd.weight tensor")
    return reader, tensors


def _build_cache(path: Path, target: Path) -> None:
    reader, tensors = _read_tensors(path)
    cfg = _model_config(reader, tensors, path.stem)
    if "rope_freqs.weight" in tensors:
        factors = next(t for t in reader.tensors if t.name == "rope_freqs.weight").data
        cfg.rope_scaling = {"rope_type": "freq_factors", "factors": [float(x) for x in factors]}
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".build-"))
    (tmp / "config.json").write_text(json.dumps(cfg.to_dict()))
    (tmp / "tensors.json").write_text(json.dumps(tensors))
    publish_dir(tmp, target)
    for old in target.parent.glob(f"{target.name.split('.')[0]}*"):
        if old != target and not old.name.startswith("."):
            shutil.rmtree(old, ignore_errors=True)


def is_prepared(path: Path) -> bool:
    """Whether this file's config and tensor index are cached (so reading them is cheap)."""
    return (_cache_dir(path) / "tensors.json").is_file()


def prepare(path: Path) -> Path:
    """The cache folder of this GGUF file (built on first use)."""
    target = _cache_dir(path)
    if not (target / "tensors.json").is_file():
        remove_stale(cache_dir("gguf"), ".build-*")
        _build_cache(path, target)
    return target


def load_config(path: Path) -> ModelConfig:
    return ModelConfig.from_dict(json.loads((prepare(path) / "config.json").read_text()))


def tokenizer_dir(path: Path) -> Path:
    """The tokenizer transformers converts from the file, cached apart from the config and tensor
    index: the conversion (seconds of CPU) then runs beside a cold start's weight loading, not
    before it. A cold start asks for it twice at once (the front end's tokenizer and the calibration
    text of the engine core, maybe in another process): one converts under a file lock (dropped if
    its holder dies), the other waits and reads the result."""
    target = prepare(path) / "tokenizer"
    build_once(target.parent / ".tokenizer.lock", target.is_dir, lambda: _convert_tokenizer(path, target))
    return target


def _convert_tokenizer(path: Path, target: Path) -> None:
    from tokenmill.model.loader.hf_import import load_auto_tokenizer

    remove_stale(target.parent, ".build-*")
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".build-"))
    try:
        try:
            with _fast_reader_in_transformers():
                tokenizer = load_auto_tokenizer(str(path.parent), gguf_file=path.name)
        except Exception as e:  # transformers raises KeyError, ValueError... on what it cannot convert
            raise ConfigError(f"transformers could not build a tokenizer from {path.name} "
                              f"({type(e).__name__}: {e}): it may have no tokenizer metadata; pass "
                              "--tokenizer with a folder holding the model's tokenizer",
                              param="tokenizer") from e
        tokenizer.save_pretrained(str(tmp))
        publish_dir(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # nothing left once published (moved)


def _undo_llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp interleaves the rotary halves of Q/K rows; restore Hugging Face's layout."""
    dim = w.shape[0] // n_head // 2
    return w.reshape(n_head, dim, 2, *w.shape[1:]).swapaxes(2, 1).reshape(w.shape)


def tensor_types(path: Path) -> dict[str, int]:
    """Checkpoint (Hugging Face) tensor name -> ggml type id."""
    index = json.loads((prepare(path) / "tensors.json").read_text())
    return {hf: t["type"] for n, t in index.items() if (hf := hf_tensor_name(n)) is not None}


def _raw(data: np.ndarray, name: str, t: dict) -> np.ndarray:
    count = int(np.prod(t["data_shape"]))
    dt = np.dtype(t["data_dtype"])
    if t["offset"] + count * dt.itemsize > data.size:
        raise ConfigError(f"GGUF tensor {name!r} ends past the end of the file: the file is truncated or corrupt")
    return np.frombuffer(data, dtype=dt, count=count, offset=t["offset"]).reshape(t["data_shape"])


def iter_weights(path: Path, cfg: ModelConfig, dtype: torch.dtype, packed: set[str] = frozenset(),
                 keep=None) -> Iterator[tuple[str, torch.Tensor]]:
    """(hf_name, tensor) pairs: tensors named in `packed` as their raw blocks ([rows, bytes per row]
    uint8, Llama's Q/K rows permuted back whole; a type without a kernel rewritten as Q8_0), the
    others dequantized on a small thread pool (numpy releases the GIL). `keep(hf_name)` False skips
    a tensor unread (another pipeline stage's). Every block's scales are checked first: a corrupt block is an error."""
    import torch
    from gguf.quants import dequantize

    from tokenmill.model.layers.quantization.formats import BY_ID, check_blocks
    from tokenmill.model.layers.quantization.gguf_repack import REPACKED, repack_rows

    index = json.loads((prepare(path) / "tensors.json").read_text())
    # copy-on-write: views of it are writable tensors, and the packed ones go to the repack unread
    # by any copy (a staging copy of Qwen-1.5B's 1 GB cost ~1 s of page faults)
    data = np.memmap(path, dtype=np.uint8, mode="c")
    permute = cfg.architecture in ("LlamaForCausalLM", "MistralForCausalLM")

    def load(item):
        name, t = item
        raw = _raw(data, name, t)
        if t["type"] in BY_ID:
            check_blocks(name, raw, t["type"])
        hf = hf_tensor_name(name)
        if hf in packed and t["type"] in REPACKED:  # a type without a kernel, as Q8_0 blocks (gguf_repack.py)
            arr = repack_rows(raw.reshape(t["shape"][0], -1), t["type"])
            check_blocks(name, arr, REPACKED[t["type"]])
        elif hf in packed:
            arr = raw.reshape(t["shape"][0], -1)
        else:
            arr = dequantize(raw, t["type"]).reshape(t["shape"])
        if permute and hf.endswith("q_proj.weight"):
            arr = _undo_llama_permute(arr, cfg.num_attention_heads)
        elif permute and hf.endswith("k_proj.weight"):
            arr = _undo_llama_permute(arr, cfg.num_key_value_heads)
        if hf in packed:
            return hf, torch.from_numpy(np.ascontiguousarray(arr, dtype=np.uint8))
        return hf, torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32)).to(dtype)

    items = [(n, t) for n, t in index.items()
             if (hf := hf_tensor_name(n)) is not None and (keep is None or keep(hf))]
    with ThreadPoolExecutor(max_workers=2) as pool:
        yield from pool.map(load, items)

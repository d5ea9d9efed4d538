"""Workloads shared by the benchmarks: synthetic prompts of exact token lengths, or a JSONL file."""

from __future__ import annotations

import json
import random
import sys
from dataclasses import dataclass


@dataclass
class BenchRequest:
    prompt: str | list[int]
    prompt_len: int
    output_len: int


def _special_ids(tokenizer) -> set[int]:
    return set(getattr(tokenizer, "all_special_ids", []) or [])


def random_token_prompt(tokenizer, length: int, rng: random.Random, vocab_size: int | None = None) -> list[int]:
    """`length` token ids that decode and re-encode to exactly `length` tokens (so the same prompt
    can be sent as text to any server), avoiding special tokens."""
    vocab = vocab_size or len(tokenizer)
    specials = _special_ids(tokenizer)
    ids = [t for t in (rng.randrange(vocab) for _ in range(length * 2)) if t not in specials][:length]
    for _ in range(8):  # re-tokenization can merge or split pieces; nudge until the length is exact
        text = tokenizer.decode(ids)
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == length:
            return ids
        if len(ids) > length:
            ids = ids[:length]
        else:
            ids += [t for t in (rng.randrange(vocab) for _ in range(length)) if t not in specials][: length - len(ids)]
    return ids


def synthetic(tokenizer, num: int, input_len: int, output_len: int, range_ratio: float = 0.0,
              shared_prefix_len: int = 0, seed: int = 0, as_text: bool = False) -> list[BenchRequest]:
    """`num` requests with input/output lengths uniform in [len*(1-r), len*(1+r)], optionally all
    starting with the same `shared_prefix_len`-token system prompt."""
    rng = random.Random(seed)
    prefix = random_token_prompt(tokenizer, shared_prefix_len, rng) if shared_prefix_len else []
    out = []
    for _ in range(num):
        lo, hi = max(1, int(input_len * (1 - range_ratio))), max(1, int(input_len * (1 + range_ratio)))
        n_in = rng.randint(lo, hi)
        n_out = rng.randint(max(1, int(output_len * (1 - range_ratio))), max(1, int(output_len * (1 + range_ratio))))
        ids = prefix + random_token_prompt(tokenizer, n_in, rng)
        prompt = tokenizer.decode(ids) if as_text else ids
        out.append(BenchRequest(prompt, len(ids), n_out))
    return out


def from_jsonl(path: str, tokenizer, default_output_len: int, num: int | None = None) -> list[BenchRequest]:
    """Lines of {"prompt": "...", "output_len": 128} (output_len optional; also "max_tokens")."""
    out = []
    with open(path) as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            prompt = row["prompt"]
            n_out = int(row.get("output_len") or row.get("max_tokens") or default_output_len)
            out.append(BenchRequest(prompt, len(tokenizer.encode(prompt, add_special_tokens=False)), n_out))
            if num is not None and len(out) >= num:
                break
    return out



# Common English words; the ones the tokenizer encodes as a single token (with their leading space)
# build prompts one token per word, which makes exact lengths cheap to hit with any BPE tokenizer.
_WORDS = """the of and to in is that it for on with as was at by be this from or have an are not but which one
all were they we you he she his her their there been has more will would can about if so what when who up out
no into them some could time than then only other new first also any these may like over such our many most
after before back good well way year day work life world people house water story light night city river field
road stone tree green blue small large long short high old young great little right left early late open hand
head eye face word name place point line book paper table window door room car bus train ship plane music song
game team group family friend child school class market money price cost power energy heat cold rain wind snow
sun moon star sea lake hill forest garden flower bird fish horse dog cat food bread milk tea coffee sugar salt
""".split()


class ServerTokenizer:
    """Counts tokens with the target server's `POST /tokenize`, so prompt lengths are exact for that
    server. Servers speak one of two forms: vLLM's and tokenmill's `{"prompt", "add_special_tokens"}`
    -> `{"tokens", "count"}`, or llama.cpp's `{"content", "add_special"}` -> `{"tokens"}` (llama-server
    answers the other form with an empty list). `detect()` finds which one."""

    FORMS = {"vllm": lambda text, special: {"prompt": text, "add_special_tokens": special},
             "llama.cpp": lambda text, special: {"content": text, "add_special": special}}

    def __init__(self, root_url: str, api_key: str | None = None, timeout: float = 30.0, form: str = "vllm"):
        self.url = root_url.rstrip("/") + "/tokenize"
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"
        self.timeout = timeout
        self.form = form

    def detect(self, probe: str = "Hello world") -> str:
        """Try each form on a probe text; the first that yields tokens is kept. ValueError when none
        does; URLError when the server cannot be reached."""
        import urllib.error

        tried = []
        for form in self.FORMS:
            self.form = form
            try:
                if self.encode(probe):
                    return form
                tried.append(f"{form} form: no tokens")
            except urllib.error.HTTPError as e:
                tried.append(f"{form} form: HTTP {e.code}")
            except (ValueError, KeyError, TypeError):
                tried.append(f"{form} form: unexpected answer")
        raise ValueError("; ".join(tried))

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        import urllib.request

        body = json.dumps(self.FORMS[self.form](text, add_special_tokens)).encode()
        req = urllib.request.Request(self.url, data=body, headers=self.headers, method="POST")
        # direct, like the load itself (aiohttp ignores *_proxy variables by default)
        with urllib.request.build_opener(urllib.request.ProxyHandler({})).open(req, timeout=self.timeout) as resp:
            tokens = json.loads(resp.read())["tokens"]
        # llama.cpp's with_pieces form gives {"id", "piece"} objects; plain ids otherwise
        return [t["id"] if isinstance(t, dict) else int(t) for t in tokens]


def single_token_words(tokenizer) -> list[str]:
    """The words of the built-in pool that are one token both with and without a leading space."""
    pool = [w for w in _WORDS
            if len(tokenizer.encode(" " + w, add_special_tokens=False)) == 1
            and len(tokenizer.encode(w, add_special_tokens=False)) == 1]
    if len(pool) < 16:
        raise ValueError(f"the tokenizer splits too many common English words ({len(pool)} of {len(_WORDS)} are "
                         "single tokens); use a JSONL dataset instead")
    return pool


def text_of_length(tokenizer, length: int, rng: random.Random, pool: list[str], prefix: str = "") -> tuple[str, int]:
    """`prefix` followed by random words, `length` tokens more than the prefix alone would be, checked
    by encoding the whole text (word pieces can merge at the joins). Returns (text, its token count)."""
    base = len(tokenizer.encode(prefix, add_special_tokens=False)) if prefix else 0
    target = base + length
    words = [rng.choice(pool) for _ in range(length)]
    text, count = prefix, base
    for _ in range(8):
        text = (prefix + " " if prefix else "") + " ".join(words)
        count = len(tokenizer.encode(text, add_special_tokens=False))
        if count == target:
            break
        if count > target:  # about one token per word: drop the surplus, keeping at least one word
            del words[max(1, len(words) - (count - target)):]
        else:
            words += [rng.choice(pool) for _ in range(target - count)]
    return text, count


def synthetic_text(tokenizer, num: int, input_len: int, output_len: int, range_ratio: float = 0.0,
                   shared_prefix_len: int = 0, seed: int = 0) -> list[BenchRequest]:
    """Like `synthetic`, but text prompts of random common words, for servers that take text: each
    prompt is `shared_prefix_len` tokens of a text shared by all, then its own input_len +-range tokens.
    `tokenizer` only needs `encode(text, add_special_tokens=False)` (a `ServerTokenizer` works)."""
    rng = random.Random(seed)
    pool = single_token_words(tokenizer)
    prefix = text_of_length(tokenizer, shared_prefix_len, rng, pool)[0] if shared_prefix_len else ""
    out = []
    for _ in range(num):
        n_in = rng.randint(max(1, int(input_len * (1 - range_ratio))), max(1, int(input_len * (1 + range_ratio))))
        n_out = rng.randint(max(1, int(output_len * (1 - range_ratio))), max(1, int(output_len * (1 + range_ratio))))
        text, count = text_of_length(tokenizer, n_in, rng, pool, prefix)
        out.append(BenchRequest(text, count, n_out))
    return out


def load_local_tokenizer(name: str | None):
    """A tokenmill model name, .gguf or model folder (its tokenizer), else a Hugging Face tokenizer path."""
    from tokenmill.errors import ConfigError
    from tokenmill.model.loader import load_tokenizer, resolve_model

    try:
        return load_tokenizer(resolve_model(name))
    except ConfigError:
        if name is None:
            raise
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot load tokenizer {name!r}: {str(e).splitlines()[0]}") from None


def pick_tokenizer(name: str | None, root_url: str, api_key: str | None = None) -> tuple[object, str]:
    """--tokenizer if given, else the server's /tokenize, else tokenmill's default model's tokenizer.
    Returns (tokenizer, a description for the report)."""
    import urllib.error

    if name:
        return load_local_tokenizer(name), f"local tokenizer {name}"
    remote = ServerTokenizer(root_url, api_key)
    try:
        form = remote.detect()
        return remote, "the server's /tokenize" + (f" ({form} form)" if form != "vllm" else "")
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", None) or e
        print(f"note: {root_url}/tokenize is unavailable ({reason}); counting tokens with tokenmill's default "
              "model's tokenizer, which may differ from the server's (give --tokenizer)", file=sys.stderr)
    return load_local_tokenizer(None), "tokenmill's default tokenizer (the server has no /tokenize)"


def build_workload(tokenizer, args, seed: int) -> list[BenchRequest]:
    """`bench serve`'s prompts: the JSONL --dataset, or synthetic text prompts; ConfigError on bad input."""
    import urllib.error

    from tokenmill.errors import ConfigError

    try:
        if args.dataset:
            requests = from_jsonl(args.dataset, tokenizer, args.output_len, args.num_prompts)
            if not requests:
                raise ConfigError(f"{args.dataset} has no prompts")
            if len(requests) < args.num_prompts:
                print(f"note: {args.dataset} has only {len(requests)} prompts", file=sys.stderr)
            return requests
        return synthetic_text(tokenizer, args.num_prompts, args.input_len, args.output_len, args.range_ratio,
                              args.shared_prefix_len, seed)
    except ConfigError:
        raise
    except urllib.error.URLError as e:
        raise ConfigError(f"counting tokens with the server's /tokenize failed: {e.reason}") from None
    except OSError as e:
        raise ConfigError(f"cannot read {e.filename or args.dataset}: {e.strerror or e}") from None
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        if args.dataset:
            raise ConfigError(f"{args.dataset}: expected JSONL lines like {{\"prompt\": \"...\", \"output_len\": "
                              f"128}} ({type(e).__name__}: {e})") from None
        raise ConfigError(str(e)) from None

"""Grammars on xgrammar: built from a GrammarSpec (validated in the front end, with 400s that name
the problem), compiled against the model's vocabulary off the engine thread, cached by spec.

xgrammar releases the GIL while it compiles, so a compile in the pool thread does not stall the
engine thread's Python.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import xgrammar as xgr

from tokenmill.errors import InvalidRequestError
from tokenmill.structured_output.json_schema import parse_json_schema, prepare_json_schema
from tokenmill.structured_output.params import MAX_JSON_WHITESPACE, GrammarSpec

logger = logging.getLogger(__name__)

_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # xgrammar's "[12:00:00] /path/file.cc:123: "
_PARAMS = {"json": "json_schema", "regex": "regex", "grammar": "grammar", "structural_tag": "structural_tag"}


def _clean(e: Exception) -> str:
    return _LOG_PREFIX.sub("", str(e).strip()).splitlines()[0] if str(e).strip() else type(e).__name__


def build_grammar(spec: GrammarSpec, param: str = "structured_outputs") -> xgr.Grammar:
    """The xgrammar Grammar of a spec (no tokenizer needed: cheap, used to validate requests).
    Raises InvalidRequestError naming the problem."""
    try:
        if spec.kind == "json":
            schema = prepare_json_schema(parse_json_schema(spec.text, param), param)
            # free whitespace is bounded per gap, as llama.cpp's JSON grammars bound it: a small
            # model sampling a schema can otherwise spend every token between two keys
            return xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=spec.any_whitespace,
                                                max_whitespace_cnt=MAX_JSON_WHITESPACE if spec.any_whitespace
                                                else None, strict_mode=True)
        if spec.kind == "regex":
            return xgr.Grammar.from_regex(spec.text)
        if spec.kind == "grammar":
            return xgr.Grammar.from_ebnf(spec.text)
        if spec.kind == "structural_tag":
            return xgr.Grammar.from_structural_tag(spec.text)
    except InvalidRequestError:
        raise
    except Exception as e:  # xgrammar raises RuntimeError/ValueError/its own types with the reason
        what = {"json": "JSON schema", "regex": "regex", "grammar": "grammar",
                "structural_tag": "structural tag"}[spec.kind]
        raise InvalidRequestError(f"invalid {what}: {_clean(e)}", param=param) from None
    raise InvalidRequestError(f"unknown grammar kind {spec.kind!r}", param=param)


def validate(spec: GrammarSpec, param: str = "structured_outputs") -> None:
    """Raises InvalidRequestError (with `param`) unless the spec builds; remembers specs that did."""
    try:
        _validated(spec)
    except InvalidRequestError as e:
        raise InvalidRequestError(e.message, param=param) from None


@functools.lru_cache(maxsize=512)
def _validated(spec: GrammarSpec) -> None:
    build_grammar(spec)


class GrammarCompiler:
    """One per model: the tokenizer's vocabulary as xgrammar sees it (built once, on the compile
    thread at first use, so start-up and the engine thread never pay for it), a compile thread,
    and an LRU cache of compiled grammars keyed by spec."""

    def __init__(self, load_tokenizer: Callable[[], object], vocab_size: int, stop_token_ids: list[int],
                 cache_size: int = 1024, num_threads: int = 1):
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self._num_threads = num_threads
        self._compiler: xgr.GrammarCompiler | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tokenmill-grammar")
        self._cache: OrderedDict[GrammarSpec, Future] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()

    @property
    def _xgr(self) -> xgr.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                info = xgr.TokenizerInfo.from_huggingface(self._load_tokenizer(), vocab_size=self.vocab_size,
                                                          stop_token_ids=self.stop_token_ids)
                self._compiler = xgr.GrammarCompiler(info, max_threads=self._num_threads, cache_enabled=False)
            return self._compiler

    def submit(self, spec: GrammarSpec) -> Future:
        """The compiled grammar of `spec`, as a future (done at once on a cache hit)."""
        with self._lock:
            fut = self._cache.get(spec)
            if fut is not None:
                self._cache.move_to_end(spec)
                return fut
            fut = self._pool.submit(self._compile, spec)
            self._cache[spec] = fut
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        fut.add_done_callback(lambda f, s=spec: self._forget_failed(s, f))
        return fut

    def get(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        """Blocking: the compiled grammar (raises InvalidRequestError if it does not compile)."""
        return self.submit(spec).result()

    def _compile(self, spec: GrammarSpec) -> xgr.CompiledGrammar:
        return self._xgr.compile_grammar(build_grammar(spec))

    def _forget_failed(self, spec: GrammarSpec, fut: Future) -> None:
        if fut.cancelled() or fut.exception() is not None:  # do not cache failures: a later identical spec retries
            with self._lock:
                if self._cache.get(spec) is fut:
                    del self._cache[spec]

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

"""The worker owns the device: it loads the model, sizes and allocates the KV cache from the
memory budget, and runs the model through its ModelRunner."""

from __future__ import annotations

import logging
import os
import time
from concurrent.futures import Future
from dataclasses import replace

import torch

from tokenmill import distributed
from tokenmill.config import EngineConfig, available_memory_bytes
from tokenmill.config.engine import SCALED_KV_CACHE_DTYPES
from tokenmill.distributed.partition import attention_heads, total_kv_heads
from tokenmill.errors import ConfigError
from tokenmill.model.attention import get_attention_backend
from tokenmill.model.attention.quant_kv import bytes_per_token_head, storage_dtype
from tokenmill.model.layers.batch_invariance import ROW_TILE, verify_row_invariance
from tokenmill.model.layers.quantization import make_quant_config, resolve_quantization
from tokenmill.model.loader import ModelSource, load_model_config, load_tokenizer, resolve_model
from tokenmill.model.loader.build import build_model
from tokenmill.model.model_config import ModelConfig
from tokenmill.model.quant_kernels import quant_kernels_available
from tokenmill.structured_output.params import GrammarSpec
from tokenmill.utils.cpu import active_isa, has_fast_bf16
from tokenmill.worker.cpu_env import configure_cpu, release_freed_memory, serve_steps_from_heap
from tokenmill.worker.kv_budget import kv_cache_budget, kv_capacity, resolve_max_model_len
from tokenmill.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def make_grammar_compiler(config: EngineConfig, source: ModelSource, model_config: ModelConfig):
    from tokenmill.structured_output.compiler import GrammarCompiler  # xgrammar: only when used

    cfg = config.model
    return GrammarCompiler(lambda: load_tokenizer(source, cfg.tokenizer, cfg.trust_remote_code),
                           model_config.vocab_size, model_config.eos_token_id)


def rss_bytes() -> int:
    """Resident set size of this process (Linux; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class Worker:
    @staticmethod
    def prefetch(config: EngineConfig, load: bool = True) -> None:
        """Start now what is slow and does not need the model: the C++ kernels' builds (25-35 s
        each on a cold 2-core machine), which then overlap each other and reading the GGUF, the
        weights and the tokenizer. The quantized weight kernels are built unless nothing can use
        them (a model that turns out not to be quantized wastes one build, once per machine); the
        quantized KV cache's only for such a cache. `load=False`: build only, for the engine core
        process that will load them (a front end starts the builds while it reads the GGUF)."""
        if config.model.torch_device.type != "cpu":
            return
        if config.kernel.attention_backend in ("auto", "cpu_paged"):
            from tokenmill.model import kernels

            kernels.start_build(load)
        from tokenmill.model import quant_kernels

        if config.quant.quantization != "none":
            quant_kernels.start_build("quant", load)
        if config.cache.kv_cache_dtype in SCALED_KV_CACHE_DTYPES:
            quant_kernels.start_build("quant_kv", load)

    def __init__(self, config: EngineConfig, source: ModelSource, model_config: ModelConfig, progress=True,
                 num_threads: int | None = None):
        self.config = config
        self.source = source
        self.model_config = model_config
        self.device = config.model.torch_device
        self.dtype = config.model.torch_dtype
        if self.device.type == "cpu":
            configure_cpu(num_threads or config.parallel.num_threads)
        self.max_model_len = resolve_max_model_len(config, model_config)
        t0 = time.monotonic()
        self.backend = get_attention_backend(config.kernel.attention_backend, config.cache.block_size, self.device,
                                             model_config.head_dim)
        q = config.quant
        self.quantization = resolve_quantization(q.quantization, source.kind, self.device)
        quant_config = make_quant_config(self.quantization, source, q.quant_group_size, q.quant_dense_min_rows,
                                         q.quant_act_bits, config.model.tokenizer, config.model.trust_remote_code)
        self.model = build_model(source, model_config, self.backend, self.max_model_len, self.dtype,
                                 self.device, progress=progress, quant_config=quant_config)
        self.weight_bytes = self.model.weight_bytes
        quant_desc = quant_config.describe() if quant_config is not None else "none"
        # the CPU attention kernel comes with fused norm / SiLU / rotary kernels from the same build
        self.fused_ops = self.backend.name == "cpu_paged" and self.model.use_cpu_kernels()
        if self.backend.name == "cpu_paged":
            self.backend.enable_paged_prefill(self.dtype)
            self.backend.enable_prefill_kernel(self.dtype)
        if config.kernel.batch_invariant:
            if self.backend.name != "cpu_paged":
                raise ConfigError("batch_invariant needs the cpu_paged attention backend (CPU, C++ kernels)",
                                  param="batch_invariant")
            self.backend.per_row = True
            self.model.set_row_tile(ROW_TILE)
            verify_row_invariance(self.model)
        logger.info("loaded %s (%s, %s, weights %s: %.0f MiB resident, process RSS %.0f MiB, %s attention) in "
                    "%.1fs", source.name, self.dtype, self.device, quant_desc, self.weight_bytes / 2**20,
                    rss_bytes() / 2**20, self.backend.name, time.monotonic() - t0)
        if self.device.type == "cpu" and self.dtype == torch.bfloat16 and not has_fast_bf16():
            logger.warning("bfloat16 on a CPU without AVX512-BF16 or AMX (ISA %s) runs slower than float32, "
                           "the default here (SmolLM2 one stream: ~20%% slower on AVX2)", active_isa())
        self.draft_config: ModelConfig | None = None
        self.proposer = self._build_proposer(progress)
        fail_on = os.environ.get("TOKENMILL_DEBUG_FAIL_ON_TOKEN")
        self.runner = ModelRunner(self.model, self.backend, config.cache.block_size, model_config.vocab_size,
                                  self.device, config.model.seed, fail_on_token=int(fail_on) if fail_on else None,
                                  grammars=self.prepare_grammar, proposer=self.proposer)
        self._grammar_compiler = None
        self.kv_storage = storage_dtype(config.cache.kv_cache_dtype, self.dtype)
        if self.kv_storage is not None and (self.backend.name != "cpu_paged"
                                            or not quant_kernels_available("quant_kv")):
            raise ConfigError(f"kv_cache_dtype={config.cache.kv_cache_dtype} is read by the cpu_paged backend's "
                              f"kernels; the {self.backend.name} backend cannot read it", param="kv_cache_dtype")
        self.num_blocks = self._num_kv_blocks()
        self.runner.allocate_kv_cache(self.num_blocks, self.local_kv_heads,
                                      model_config.head_dim, self.dtype, self.kv_storage)
        if self.draft_config is not None:
            self.proposer.allocate_kv_cache(self.num_blocks, _local_kv_heads(self.draft_config),
                                            self.draft_config.head_dim, self.dtype, self.kv_storage)
        if self.device.type == "cpu":
            serve_steps_from_heap()

    def _build_proposer(self, progress: bool):
        spec = self.config.speculative
        if not spec.enabled or not distributed.state().is_last_stage:
            return None  # earlier pipeline stages run the drafts through their layers; the last verifies
        if spec.method == "ngram":
            from tokenmill.worker.spec_decode.ngram import NgramProposer

            logger.info("speculative decoding: n-gram proposer, up to %d tokens (%s x the match), n-grams of %d..%d",
                        spec.num_speculative_tokens, spec.max_spec_factor, spec.prompt_lookup_min,
                        spec.prompt_lookup_max)
            return NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max,
                                 spec.max_spec_factor)
        return self._build_draft_model(spec, progress)

    def _build_draft_model(self, spec, progress: bool):
        from tokenmill.worker.spec_decode.draft_model import DraftModelProposer

        source = resolve_model(spec.draft_model)
        cfg = load_model_config(source)
        target = self.model_config
        # the same tokenizer, as far as configs tell: the end-of-text sets may differ in how they were
        # found (a GGUF's by text, a folder's from generation_config.json), not in sharing none
        if cfg.vocab_size != target.vocab_size or not set(cfg.eos_token_id) & set(target.eos_token_id):
            raise ConfigError(f"draft model {source.name} has another vocabulary ({cfg.vocab_size} tokens, EOS "
                              f"{cfg.eos_token_id}) than {self.source.name} ({target.vocab_size} tokens, EOS "
                              f"{target.eos_token_id}): a draft must share the target's tokenizer",
                              param="speculative_config")
        t0 = time.monotonic()
        quant_config = self._draft_quant_config(spec, source)
        with distributed.whole_pipeline():  # the last stage drafts with every layer of the draft model
            model = build_model(source, cfg, self.backend, self.max_model_len, self.dtype, self.device,
                                progress=progress, quant_config=quant_config)
        if self.fused_ops:
            model.use_cpu_kernels()
        if self.config.kernel.batch_invariant:
            model.set_row_tile(ROW_TILE)
        self.weight_bytes += model.weight_bytes
        self.draft_config = cfg
        lookup = (f"prompt lookup first (a match of {spec.draft_lookup_min}+ tokens drafts instead)"
                  if spec.draft_lookup_min else "no prompt lookup")
        logger.info("speculative decoding: draft model %s (%s, %.0f MiB of weights) drafts up to %d tokens (while it "
                    "gives them >= %s), %s; loaded in %.1fs", source.name,
                    quant_config.describe() if quant_config else "not quantized", model.weight_bytes / 2**20,
                    spec.num_speculative_tokens, spec.draft_p_min or 0, lookup, time.monotonic() - t0)
        return DraftModelProposer(model, self.backend, self.config.cache.block_size, spec.num_speculative_tokens,
                                  self.device, self.max_model_len, spec.draft_p_min or 0.0,
                                  self._draft_vocab(spec, source, cfg), spec.draft_lookup_min or 0)

    def _draft_vocab(self, spec, source: ModelSource, cfg):
        """The ids the draft's head scores (draft_vocab.py); None: all of them."""
        from tokenmill.config.speculative import DRAFT_VOCAB_MIN, DRAFT_VOCAB_SIZE
        from tokenmill.worker.spec_decode.draft_vocab import draft_vocab_ids

        size = spec.draft_vocab_size
        if size == "auto":
            size = DRAFT_VOCAB_SIZE if cfg.vocab_size > DRAFT_VOCAB_MIN else None
        if size is None or size >= cfg.vocab_size:
            return None

        # --tokenizer stands for the draft's too (the vocabularies were checked to be the same)
        tok = load_tokenizer(source, self.config.model.tokenizer, self.config.model.trust_remote_code)
        special = list(getattr(tok, "added_tokens_decoder", {})) + list(tok.all_special_ids) + cfg.eos_token_id
        ids = draft_vocab_ids(size, cfg.vocab_size, special)
        logger.info("speculative decoding: the draft scores %d of %d tokens", len(ids), cfg.vocab_size)
        return ids

    def _draft_quant_config(self, spec, source: ModelSource):
        """The target's quantization, or int4 at load with the draft's "quantization": "int4" (a GGUF
        draft: requantize.py). An int4 draft also takes 8-bit activations (as llama.cpp does): half the
        packed kernels' integer work per pass; its guesses only have to be likely (the target verifies)."""
        q, m = self.config.quant, self.config.model
        if spec.draft_quantization != "int4":
            return make_quant_config(self.quantization, source, q.quant_group_size, q.quant_dense_min_rows,
                                     q.quant_act_bits, m.tokenizer, m.trust_remote_code)
        if source.kind == "gguf":
            from tokenmill.model.layers.quantization.requantize import RequantizedGGUFConfig
            from tokenmill.model.loader import gguf_loader

            resolve_quantization("gguf", source.kind, self.device)  # a clear error where the kernels are missing
            return RequantizedGGUFConfig(gguf_loader.tensor_types(source.path), q.quant_dense_min_rows, 8)
        return make_quant_config(resolve_quantization("int4", source.kind, self.device), source, q.quant_group_size,
                                 q.quant_dense_min_rows, 8, m.tokenizer, m.trust_remote_code)

    def prepare_grammar(self, spec: GrammarSpec) -> Future:
        """Compiles a structured-output grammar for this model's vocabulary on a background thread
        (cached by spec). The core waits on the future before it schedules the request; the runner
        then finds the compiled grammar done."""
        if self._grammar_compiler is None:
            self._grammar_compiler = make_grammar_compiler(self.config, self.source, self.model_config)
        return self._grammar_compiler.submit(spec)

    def shutdown(self) -> None:
        """Stops the threads the worker started: grammar compilation and the masks' filling."""
        self.runner.close()
        if self._grammar_compiler is not None:
            self._grammar_compiler.shutdown()
            self._grammar_compiler = None
        if self.device.type == "cpu":
            release_freed_memory()

    @property
    def local_kv_heads(self) -> int:
        """KV heads in this rank's cache (all of them without tensor parallelism)."""
        return _local_kv_heads(self.model_config)

    @property
    def kv_bytes_per_token(self) -> int:
        """KV bytes per token over every rank (the budget is the engine's, shared by its ranks), both
        the target's and a draft model's K/V (they share blocks)."""
        return sum(self._kv_bytes(m) for m in (self.model_config, self.draft_config) if m is not None)

    def _kv_bytes(self, m: ModelConfig) -> int:
        heads = total_kv_heads(m.num_attention_heads, m.num_key_value_heads, distributed.state().tp_size)
        return 2 * m.num_hidden_layers * heads * bytes_per_token_head(self.kv_storage, self.dtype, m.head_dim)

    def _kv_budget(self) -> int:
        total = free = None
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
        return kv_cache_budget(self.config.cache, self.weight_bytes, available_memory_bytes(), total, free)

    def _num_kv_blocks(self) -> int:
        kv = kv_capacity(self._kv_budget(), self.kv_bytes_per_token, self.config.cache.block_size,
                         self.max_model_len)
        if torch.distributed.is_initialized():  # ranks may see different free memory: all take the least
            blocks = torch.tensor([kv.num_blocks])
            torch.distributed.all_reduce(blocks, op=torch.distributed.ReduceOp.MIN)
            kv = replace(kv, num_blocks=int(blocks))
        kv_dtype = str(self.kv_storage or self.dtype).removeprefix("torch.")
        draft = f", of which the draft model {self._kv_bytes(self.draft_config)}" if self.draft_config else ""
        logger.info("KV cache: %.1f MiB budget, %s (%d bytes/token%s), %d blocks of %d tokens (%d tokens); "
                    "max concurrency at max_model_len=%d: %.1fx", kv.budget / 2**20, kv_dtype, kv.bytes_per_token,
                    draft,
                    kv.num_blocks, kv.block_size, kv.num_tokens, self.max_model_len,
                    kv.num_tokens / self.max_model_len)
        return kv.num_blocks


def _local_kv_heads(m: ModelConfig) -> int:
    st = distributed.state()
    return attention_heads(m.num_attention_heads, m.num_key_value_heads, st.tp_size, st.tp_rank).num_kv_heads

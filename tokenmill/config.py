"""The one engine configuration: `LLM(**kwargs)`, `LLMEngine` and `tokenmill serve` all take these fields.

Flag names are the field names with dashes (`max_num_seqs` -> `--max-num-seqs`), and every flag can
also come from the environment as `TOKENMILL_<FIELD>` (see entrypoints/cli/args.py).
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field

from tokenmill.errors import ConfigError

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1000, "m": 1000**2, "g": 1000**3, "t": 1000**4,
          "ki": 1024, "mi": 1024**2, "gi": 1024**3, "ti": 1024**4}


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


def _opt(help: str, **kw):
    return field(metadata={"help": help, **kw.pop("meta", {})}, **kw)


@dataclass
class EngineConfig:
    model: str | None = _opt(
        "Model: a Hugging Face folder, a .gguf file, or a known short name "
        "(smollm2-135m, qwen2.5-coder-0.5b, qwen2.5-coder-1.5b). Default: the embedded SmolLM2-135M-Instruct.",
        default=None)
    tokenizer: str | None = _opt("Tokenizer folder, if not the model's own.", default=None)
    chat_template: str | None = _opt("Chat template to use instead of the model's: a Jinja file or the template "
                                     "itself.", default=None)
    served_model_name: str | None = _opt("Model name reported by the API (default: derived from the model).",
                                         default=None)
    dtype: str = _opt("Weights and activations dtype: auto (bf16 on CPUs with AMX/AVX512-BF16 "
                      "or CUDA, else fp32), float32, bfloat16, float16.", default="auto",
                      meta={"choices": ["auto", "float32", "bfloat16", "float16"]})
    device: str = _opt("Device: auto (cuda if available, else cpu), cpu, cuda.", default="auto")
    max_model_len: int | None = _opt("Longest prompt + output in tokens (default: the model's context, "
                                     "capped at 8192).", default=None)
    block_size: int = _opt("Tokens per KV cache block.", default=16)
    kv_cache_memory: int | str | None = _opt(
        "KV cache size in bytes or with a unit (4GiB). Default: 4GiB, capped at half of available memory.",
        default=None)
    memory_utilization: float | None = _opt(
        "Fraction of device memory (on CPU: available RAM) for weights + KV cache, like vLLM's "
        "gpu_memory_utilization. Used instead of --kv-cache-memory when given.", default=None)
    max_num_batched_tokens: int = _opt("Token budget of one engine step (bounds a prefill chunk).",
                                       default=2048)
    max_num_seqs: int = _opt("Most sequences in one engine step.", default=128)
    enable_prefix_caching: bool = _opt("Reuse KV cache blocks of shared prompt prefixes.", default=True)
    seed: int = _opt("Seed of the engine's random generator (unseeded requests).", default=0)
    num_threads: int | None = _opt("Torch intra-op threads (default: all cores).", default=None)
    max_logprobs: int = _opt("Most logprobs a request may ask for.", default=20)
    trust_remote_code: bool = _opt("Allow tokenizers with custom code.", default=False)
    batch_invariant: bool = _opt(
        "Make every result independent of batch composition, chunking, prefix-cache hits and preemption, "
        "in bf16 too (GEMMs in fixed 32-row tiles, attention one query at a time). Slower, notably for long "
        "prompts. Needs the cpu_paged backend.", default=False)
    attention_backend: str = _opt("Attention kernels: auto (cpu_paged on CPU when its C++ kernel builds, else "
                                  "torch_sdpa), cpu_paged, torch_sdpa.", default="auto",
                                  meta={"choices": ["auto", "cpu_paged", "torch_sdpa"]})

    def __post_init__(self):
        self.validate()

    # --- validation -------------------------------------------------------------------------------
    def validate(self) -> None:
        def positive(name: str, allow_none: bool = False):
            v = getattr(self, name)
            if v is None and allow_none:
                return
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ConfigError(f"{name} must be a positive integer, got {v!r}", param=name)

        if self.dtype not in ("auto", "float32", "bfloat16", "float16", "fp32", "bf16", "fp16", "half"):
            raise ConfigError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}",
                              param="dtype")
        if self.device not in ("auto", "cpu", "cuda") and not str(self.device).startswith("cuda:"):
            raise ConfigError(f"device must be auto, cpu or cuda, got {self.device!r}", param="device")
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs", "max_logprobs"):
            positive(name)
        for name in ("max_model_len", "num_threads"):
            positive(name, allow_none=True)
        if self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two, got {self.block_size}", param="block_size")
        if self.kv_cache_memory is not None:
            self.kv_cache_memory = parse_size(self.kv_cache_memory)
            if self.kv_cache_memory <= 0:
                raise ConfigError("kv_cache_memory must be positive", param="kv_cache_memory")
        if self.memory_utilization is not None:
            mu = self.memory_utilization
            if isinstance(mu, bool) or not isinstance(mu, (int, float)) or not 0 < mu <= 1:
                raise ConfigError(f"memory_utilization must be in (0, 1], got {mu!r}",
                                  param="memory_utilization")
            if self.kv_cache_memory is not None:
                raise ConfigError("give either kv_cache_memory or memory_utilization, not both",
                                  param="memory_utilization")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ConfigError("enable_prefix_caching must be a bool", param="enable_prefix_caching")

    # --- derived values ---------------------------------------------------------------------------
    @property
    def torch_device(self):
        import torch  # lazily: commands that never run a model should not pay for importing torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def torch_dtype(self):
        import torch

        names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
                 "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16,
                 "half": torch.float16}
        if self.dtype != "auto":
            return names[self.dtype]
        if self.torch_device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineConfig:
        unknown = set(kwargs) - set(cls.field_names())
        if unknown:
            raise ConfigError(f"unknown engine argument(s): {', '.join(sorted(unknown))}")
        return cls(**kwargs)


def cpu_has_fast_bf16() -> bool:
    """bf16 GEMMs are fast (AMX or AVX512-BF16); otherwise fp32 is the better default."""
    import torch

    try:
        if torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported():
            return True
    except AttributeError:
        pass
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
        return "amx_bf16" in flags or "avx512_bf16" in flags
    except OSError:
        return False


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


@dataclass
class ServerConfig:
    """Settings of `tokenmill serve` beyond the engine's (flags and TOKENMILL_* variables alike)."""

    host: str = field(default="127.0.0.1", metadata={"help": "Address to bind (loopback by default)."})
    port: int = field(default=8000, metadata={"help": "Port to listen on."})
    api_key: str | None = field(default=None, metadata={
        "help": "Require 'Authorization: Bearer KEY' on the API (health, metrics and version stay open)."})
    max_queue_len: int = field(default=512, metadata={
        "help": "Waiting requests beyond which new ones get 429 with Retry-After."})
    request_timeout: float | None = field(default=600.0, metadata={
        "help": "Seconds after which a request is aborted (none: no limit)."})
    shutdown_grace: float = field(default=30.0, metadata={
        "help": "On SIGTERM/SIGINT, seconds to let in-flight requests finish before exiting."})

    def __post_init__(self):
        if not 0 < self.port < 65536:
            raise ConfigError(f"port must be in 1..65535, got {self.port}", param="port")
        if self.max_queue_len < 1:
            raise ConfigError("max_queue_len must be >= 1", param="max_queue_len")
        if self.request_timeout is not None and self.request_timeout <= 0:
            self.request_timeout = None

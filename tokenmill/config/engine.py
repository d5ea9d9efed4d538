"""The engine configuration: one group per concern, validated in one place (`EngineConfig.validate`).

`LLM(**kwargs)`, `LLMEngine` and every command take the groups' fields flat (`max_num_seqs=8`); each
field is also a flag (`--max-num-seqs`) and an environment variable (`TOKENMILL_MAX_NUM_SEQS`),
generated from these dataclasses by entrypoints/cli/args.py. Field names are unique across groups.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from tokenmill.config.fields import check_bool, check_choice, check_positive, opt, parse_size
from tokenmill.config.parallel import ParallelConfig
from tokenmill.config.speculative import SpeculativeConfig
from tokenmill.errors import ConfigError

DTYPES = ("auto", "float32", "bfloat16", "float16")
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}


@dataclass
class ModelOptions:
    """Which model to run, and how to present it."""

    model: str | None = opt("Model: a Hugging Face folder, a .gguf file, or a known short name (smollm2-135m, "
                            "qwen2.5-coder-0.5b, qwen2.5-coder-1.5b). Default: the embedded SmolLM2-135M-Instruct.")
    tokenizer: str | None = opt("Tokenizer folder, if not the model's own.")
    chat_template: str | None = opt("Chat template to use instead of the model's: a Jinja file or the template "
                                    "itself.")
    served_model_name: str | None = opt("Model name reported by the API (default: derived from the model).")
    dtype: str = opt("Weights and activations dtype: auto (bf16 on CPUs with AMX/AVX512-BF16 or CUDA, else "
                     "fp32), float32, bfloat16, float16.", "auto", choices=list(DTYPES))
    device: str = opt("Device: auto (cuda if available, else cpu), cpu, cuda.", "auto")
    max_model_len: int | None = opt("Longest prompt + output in tokens (default: the model's context, capped "
                                    "at 8192).")
    trust_remote_code: bool = opt("Allow tokenizers with custom code.", False)
    seed: int = opt("Seed of the engine's random generator (unseeded requests).", 0)
    max_logprobs: int = opt("Most logprobs a request may ask for.", 20)

    def validate(self) -> None:
        self.dtype = _DTYPE_ALIASES.get(self.dtype, self.dtype)
        check_choice(self, "dtype", DTYPES)
        if self.device not in ("auto", "cpu", "cuda") and not str(self.device).startswith("cuda:"):
            raise ConfigError(f"device must be auto, cpu or cuda, got {self.device!r}", param="device")
        check_positive(self, "max_logprobs")
        check_positive(self, "max_model_len", allow_none=True)
        check_bool(self, "trust_remote_code")

    @property
    def torch_device(self):
        import torch  # lazily: commands that never run a model should not pay for importing torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    @property
    def torch_dtype(self):
        import torch

        from tokenmill.utils.cpu import has_fast_bf16

        if self.dtype != "auto":
            return getattr(torch, self.dtype)
        if self.torch_device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if has_fast_bf16() else torch.float32


KV_CACHE_DTYPES = ("auto", "bfloat16", "int8", "fp8", "fp8_e4m3", "fp8_e5m2")
KV_CACHE_ALIASES = {"fp8": "fp8_e4m3"}  # vLLM's spelling: "fp8" is e4m3
SCALED_KV_CACHE_DTYPES = ("int8", "fp8_e4m3", "fp8_e5m2")  # codes and a scale: only cpu_paged's kernels read them


@dataclass
class CacheConfig:
    """The paged KV cache: its size, block size and prefix caching."""

    block_size: int = opt("Tokens per KV cache block.", 16)
    kv_cache_memory: int | str | None = opt("KV cache size in bytes or with a unit (4GiB). Default: 4GiB, capped "
                                            "at half of available memory.")
    memory_utilization: float | None = opt("Fraction of device memory (on CPU: available RAM) for weights + KV "
                                           "cache, like vLLM's gpu_memory_utilization. Used instead of "
                                           "--kv-cache-memory when given.")
    enable_prefix_caching: bool = opt("Reuse KV cache blocks of shared prompt prefixes.", True)
    kv_cache_dtype: str = opt("KV cache storage: auto (the model dtype), bfloat16, int8, fp8_e4m3 (fp8 for short) or "
                              "fp8_e5m2 (one scale per token and kv head; about half the bytes of bf16, read in place "
                              "by the cpu_paged decode kernel).", "auto", choices=list(KV_CACHE_DTYPES))

    def validate(self) -> None:
        check_choice(self, "kv_cache_dtype", KV_CACHE_DTYPES)
        self.kv_cache_dtype = KV_CACHE_ALIASES.get(self.kv_cache_dtype, self.kv_cache_dtype)
        check_positive(self, "block_size")
        if self.block_size & (self.block_size - 1):
            raise ConfigError(f"block_size must be a power of two, got {self.block_size}", param="block_size")
        if self.kv_cache_memory is not None:
            self.kv_cache_memory = parse_size(self.kv_cache_memory)
            if self.kv_cache_memory <= 0:
                raise ConfigError("kv_cache_memory must be positive", param="kv_cache_memory")
        mu = self.memory_utilization
        if mu is not None:
            if isinstance(mu, bool) or not isinstance(mu, (int, float)) or not 0 < mu <= 1:
                raise ConfigError(f"memory_utilization must be in (0, 1], got {mu!r}", param="memory_utilization")
            if self.kv_cache_memory is not None:
                raise ConfigError("give either kv_cache_memory or memory_utilization, not both",
                                  param="memory_utilization")
        check_bool(self, "enable_prefix_caching")


@dataclass
class SchedulerConfig:
    """Continuous batching: how much one step may hold."""

    max_num_batched_tokens: int = opt("Token budget of one engine step (bounds a prefill chunk).", 2048)
    max_num_seqs: int = opt("Most sequences in one engine step.", 128)
    scheduling_policy: str = opt("Order of the waiting queue: fcfs (arrival order), or priority (the request's "
                                 "`priority`, lower first, then arrival; preemption takes the lowest priority "
                                 "first).", "fcfs", choices=["fcfs", "priority"])
    priority_aging: float = opt("Under --scheduling-policy priority: seconds of waiting that raise a request's "
                                "effective priority by one level (lower its number by 1), so a request of priority p "
                                "is overtaken only by requests of priority q that arrive within (p - q) x this "
                                "after it. 0: strict priorities (a request can starve).", 10.0)
    stream_interval: int = opt("Tokens a streamed request gathers before the next chunk is sent (the first token "
                               "and the last always go at once). 1 sends every token; larger values cut the front "
                               "end's and the client's work per token, for throughput over smoothness.", 1)

    def validate(self) -> None:
        check_positive(self, "max_num_batched_tokens", "max_num_seqs", "stream_interval")
        check_choice(self, "scheduling_policy", ("fcfs", "priority"))
        a = self.priority_aging
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not a >= 0 or a == float("inf"):
            raise ConfigError(f"priority_aging must be a finite number of seconds >= 0, got {a!r}",
                              param="priority_aging")


QUANTIZATIONS = ("auto", "none", "gguf", "int8", "int4")


@dataclass
class QuantizationConfig:
    """How weights are stored and multiplied."""

    quantization: str = opt("Weight quantization: auto (a .gguf runs in its own types on CPU, else none), none "
                            "(dequantize a GGUF at load to --dtype), gguf (keep GGUF blocks packed: Q4_0, Q4_1, "
                            "Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K run natively, Q3_K, IQ4_NL, IQ4_XS as Q8_0, other "
                            "types are dequantized), int8 "
                            "(per-channel) or int4 (per group, see --quant-group-size) weight-only quantization of a "
                            "Hugging Face folder at load.", "auto", choices=list(QUANTIZATIONS))
    quant_group_size: int = opt("Weights per int4 group: 32 or 128.", 128, choices=[32, 128])
    quant_act_bits: int | str = opt("Activation precision of the packed kernels: 16 (int8 plus an int8 rounding "
                                    "residual: products as exact as fp32), 8 (as llama.cpp: half the integer work) "
                                    "or auto (8 for the kinds of layer (qkv, o, gate_up, down, LM head) whose codes "
                                    "together change the expected perplexity (e^KL - 1) by at most 0.15% against "
                                    "16-bit ones on built-in text, some with their outlier channels left out of the "
                                    "codes and added exactly; once per model and cached; 16 for the rest).",
                                    "auto",
                                    choices=["auto", "8", "16"])
    quant_dense_min_rows: int | str | None = opt("Rows from which a quantized layer dequantizes its weight slab by "
                                                 "slab and runs the dense GEMM instead of the packed kernel (default: "
                                                 "the crossover measured for this CPU kind, see BENCHMARKS.md; on a "
                                                 "kind without one, such as AMX, measured at load once and cached), "
                                                 "or `measure` (measure it at load on this CPU whatever its kind).")

    def validate(self) -> None:
        check_choice(self, "quantization", QUANTIZATIONS)
        check_choice(self, "quant_group_size", (32, 128))
        if isinstance(self.quant_act_bits, str) and self.quant_act_bits.isdigit():
            self.quant_act_bits = int(self.quant_act_bits)
        check_choice(self, "quant_act_bits", ("auto", 8, 16))
        if isinstance(self.quant_dense_min_rows, str) and self.quant_dense_min_rows.isdigit():
            self.quant_dense_min_rows = int(self.quant_dense_min_rows)
        rows = self.quant_dense_min_rows
        if rows not in (None, "measure") and (isinstance(rows, bool) or not isinstance(rows, int) or rows <= 0):
            raise ConfigError(f"quant_dense_min_rows must be a positive integer or 'measure', got {rows!r}",
                              param="quant_dense_min_rows")


@dataclass
class KernelConfig:
    """Which kernels run attention, and whether results must be independent of the batch."""

    attention_backend: str = opt("Attention kernels: auto (cpu_paged on CPU when its C++ kernel builds, else "
                                 "torch_sdpa), cpu_paged, torch_sdpa.", "auto",
                                 choices=["auto", "cpu_paged", "torch_sdpa"])
    batch_invariant: bool = opt("Make every result independent of batch composition, chunking, prefix-cache hits "
                                "and preemption, in bf16 too (GEMMs in fixed row tiles, attention one query at a "
                                "time). Slower, notably for long prompts. Needs the cpu_paged backend.", False)

    def validate(self) -> None:
        check_choice(self, "attention_backend", ("auto", "cpu_paged", "torch_sdpa"))
        check_bool(self, "batch_invariant")


@dataclass
class EngineConfig:
    model: ModelOptions = field(default_factory=ModelOptions)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    quant: QuantizationConfig = field(default_factory=QuantizationConfig)
    kernel: KernelConfig = field(default_factory=KernelConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Every check of every group, then the ones across groups."""
        for group in self.groups().values():
            group.validate()
        if self.cache.kv_cache_dtype in SCALED_KV_CACHE_DTYPES and self.kernel.attention_backend == "torch_sdpa":
            raise ConfigError(f"kv_cache_dtype={self.cache.kv_cache_dtype} is read by the cpu_paged attention "
                              f"backend's kernels; the torch_sdpa backend cannot read it", param="kv_cache_dtype")

    def groups(self) -> dict[str, object]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def group_types(cls) -> dict[str, type]:
        hints = {"model": ModelOptions, "cache": CacheConfig, "scheduler": SchedulerConfig,
                 "parallel": ParallelConfig, "quant": QuantizationConfig, "kernel": KernelConfig,
                 "speculative": SpeculativeConfig}
        return {f.name: hints[f.name] for f in dataclasses.fields(cls)}

    @classmethod
    def field_owner(cls) -> dict[str, str]:
        """Flat field name -> the group that holds it."""
        owner = {}
        for group, tp in cls.group_types().items():
            for f in dataclasses.fields(tp):
                assert f.name not in owner, f"config field {f.name!r} is in two groups"
                owner[f.name] = group
        return owner

    @classmethod
    def field_names(cls) -> list[str]:
        return list(cls.field_owner())

    @classmethod
    def from_kwargs(cls, **kwargs) -> EngineConfig:
        """Flat keyword arguments (`max_num_seqs=8`), routed to their groups; a whole group may be
        given by its name (`cache=CacheConfig(...)`)."""
        owner, types = cls.field_owner(), cls.group_types()
        unknown = set(kwargs) - set(owner) - set(types)
        if unknown:
            raise ConfigError(f"unknown engine argument(s): {', '.join(sorted(unknown))}")
        per_group: dict[str, dict] = {g: {} for g in types}
        bases: dict[str, object] = {}
        for name, value in kwargs.items():
            if name in types and isinstance(value, types[name]):  # a whole group ("model" is also a field)
                bases[name] = value
            else:
                per_group[owner[name]][name] = value
        groups = {}
        for g, tp in types.items():
            base = bases.get(g)
            groups[g] = dataclasses.replace(base, **per_group[g]) if base is not None else tp(**per_group[g])
        return cls(**groups)

    def to_kwargs(self) -> dict:
        """The flat form `from_kwargs` takes."""
        return {name: getattr(getattr(self, g), name) for name, g in self.field_owner().items()}

"""tokenmill's quantized-weight and quantized-KV kernels, one library per ISA variant, picked at run time.

The same sources (csrc/quant_*.cpp) are compiled once per variant with that variant's compiler
flags, each registering its ops under its own namespace (`torch.ops.tokenmill_q_avx2`, and
`tokenmill_qkv_avx2` for the KV-cache kernels ...). At run
time `quant_ops()` loads the variant of `utils.cpu.active_isa()` (the hardware's level, capped by
TOKENMILL_CPU_ISA), so one installation runs the fastest correct code on an AVX2 laptop, an AMD
EPYC with AVX-512 + VNNI and an AMX Xeon alike; tests load every variant the machine can run.
AMX machines use the VNNI variant: the packed kernels serve few-row products, where AMX tiles do
not pay off, and many-row products go to oneDNN's GEMM, which uses AMX itself.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import torch

from tokenmill.utils.cpu import ISA_LEVELS, active_isa, cpu_family, cpu_vendor, hardware_isa

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"
# two libraries: the weight kernels, and the KV-cache ones, which are built only when a quantized
# KV cache asks for them (a cold start builds what it uses)
# (one translation unit per source, compiled in parallel: the few-row AVX2 kernel's instances are split by
# weight type over quant_gemm_x8_*.cpp)
LIBRARIES = {"quant": ([_CSRC / f"{name}.cpp" for name in ("quant_gemm", "quant_gemm_rows", "quant_gemm_sb",
                                                            "quant_gemm_x8", "quant_gemm_x8_k", "quant_gemm_x8_legacy",
                                                            "quant_gemm_x8_own", "quant_gemm_x8sb")], "tokenmill_q"),
             "quant_kv": ([_CSRC / "quant_kv.cpp"], "tokenmill_qkv")}
SOURCES = [src for sources, _ in LIBRARIES.values() for src in sources]
# every header of csrc/ counts in the build's hash: a hand-kept list once missed a new one, and its
# edits did not reach the library
HEADERS = tuple(sorted(_CSRC.glob("*.h")))
# variant -> compiler flags; the ISA level each variant needs
VARIANT_FLAGS = {
    "scalar": [],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "avx512": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"],
    "avx512_vnni": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
                    "-mavx512vnni", "-mavx512bf16"],
}
# Bytes the packed GEMV prefetches each weight stream ahead, per CPU vendor (others: 1 KiB, the best
# on a Xeon); with AVX-512 capped at one 8-row group. An AMD EPYC streams Qwen-1.5B's layers from DRAM
# 1.3-1.5x faster at 4 KiB than at 1, and decodes it 1.09x faster again at 16 KiB (a whole group ahead
# for gate_up and the LM head; flat from 12 to 64 KiB) than at 4. The AVX2 kernels' one stream a
# thread, 16 KiB ahead into L2 on a Zen 3: 1.1-1.4x the GB/s of no prefetch, L1 or 4 KiB alike
# (benchmarks/quant_gemv_bandwidth.py; BENCHMARKS.md, issue 8).
PREFETCH_AHEAD = {"AuthenticAMD": 16384}
# The cache level those prefetches fill, per CPU vendor and family (others: 1, L1). An AMD EPYC Zen 4
# (family 25) decoded Qwen-1.5B 1.17-1.40x faster into L2 (2), SmolLM2 1.09-1.26x; a Zen 5 (26)
# measured no better into L2 (BENCHMARKS.md, issue 8).
PREFETCH_LEVEL = {("AuthenticAMD", "25"): 2}
_LEVEL_VARIANT = {"scalar": "scalar", "avx2": "avx2", "avx512": "avx512", "avx512_bf16": "avx512_vnni",
                  "amx": "avx512_vnni"}
_lock = threading.Lock()
_loaded: dict[str, object] = {}


def prefetch_ahead() -> int:
    """The packed GEMV's prefetch distance for this CPU (bytes)."""
    return PREFETCH_AHEAD.get(cpu_vendor(), 1024)


def prefetch_level() -> int:
    """The cache level (1 or 2) the packed GEMV prefetches its weights into on this CPU."""
    return PREFETCH_LEVEL.get((cpu_vendor(), cpu_family()), 1)


def variant_for(level: str) -> str:
    return _LEVEL_VARIANT[level]


def supported_variants() -> list[str]:
    """Every variant this CPU can run, lowest first."""
    hw = ISA_LEVELS.index(hardware_isa())
    return sorted({_LEVEL_VARIANT[lv] for lv in ISA_LEVELS[:hw + 1]}, key=list(VARIANT_FLAGS).index)


def _build(kind: str, variant: str) -> Path:
    from tokenmill.model.kernels import build_library

    sources, prefix = LIBRARIES[kind]
    flags = ["-O3", "-fopenmp", f"-DTM_QUANT_NS={prefix}_{variant}", *VARIANT_FLAGS[variant]]
    return build_library(f"tokenmill_{kind}_{variant}", sources, flags, HEADERS, unity=False)


def library_path(kind: str = "quant", variant: str | None = None) -> Path:
    """The shared library of a kind and variant (default: the active ISA's), built on first use."""
    return _build(kind, variant or variant_for(active_isa()))


def _library(kind: str, variant: str | None):
    from tokenmill.model.kernels import build_error_line

    variant = variant or variant_for(active_isa())
    ns = f"{LIBRARIES[kind][1]}_{variant}"
    with _lock:
        if ns not in _loaded:
            try:
                torch.ops.load_library(str(library_path(kind, variant)))
            except Exception as e:
                raise RuntimeError(f"tokenmill's quantized kernels ({kind}, {variant}) could not be built: "
                                   f"{type(e).__name__}: {build_error_line(e)}") from e
            _loaded[ns] = getattr(torch.ops, ns)
            if kind == "quant":
                _loaded[ns].set_prefetch_ahead(prefetch_ahead(), prefetch_level())
        return _loaded[ns]


def quant_ops(variant: str | None = None):
    """The weight kernels' op namespace of a variant (default: the active ISA's), built on first
    use. Raises RuntimeError when it cannot be built (no compiler)."""
    return _library("quant", variant)


def quant_kv_ops(variant: str | None = None):
    """The quantized KV cache's kernels (write, paged decode attention), like quant_ops()."""
    return _library("quant_kv", variant)


def start_build(kind: str = "quant", load: bool = True) -> None:
    """Build (or load) the active variant of a library on a thread now, to overlap the model's
    loading; `load=False`: only build into the cache, for another process that will load it."""
    def build():
        try:
            _library(kind, None) if load else _build(kind, variant_for(active_isa()))
        except Exception:  # noqa: BLE001 - said again, and handled, where the kernels are used
            pass

    threading.Thread(target=build, name=f"tokenmill-{kind}-kernels", daemon=True).start()


def quant_kernels_available(kind: str = "quant") -> bool:
    try:
        _library(kind, None)
        return True
    except RuntimeError as e:
        logger.warning("%s", e)
        return False

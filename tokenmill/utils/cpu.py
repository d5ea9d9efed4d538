"""What this CPU can do, and the ISA level tokenmill's kernels may use.

Levels, lowest first: `scalar`, `avx2` (AVX2 + FMA), `avx512` (F/BW/VL/DQ), `avx512_bf16` (adds
AVX512-BF16 and VNNI), `amx` (adds AMX tiles). `TOKENMILL_CPU_ISA=<level>` caps the level (to check a
lower path on a bigger machine); the cap also applies to oneDNN's GEMMs through ONEDNN_MAX_CPU_ISA
(see `cap_onednn`), which must be set before torch runs its first GEMM.
"""

from __future__ import annotations

import functools
import os

from tokenmill.errors import ConfigError

ISA_LEVELS = ("scalar", "avx2", "avx512", "avx512_bf16", "amx")
_REQUIRED = {
    "avx2": {"avx2", "fma", "f16c"},
    "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq"},
    "avx512_bf16": {"avx512_bf16", "avx512_vnni"},
    "amx": {"amx_tile", "amx_bf16", "amx_int8"},
}
# oneDNN's names for the same caps (ONEDNN_MAX_CPU_ISA)
_ONEDNN_ISA = {"scalar": "SSE41", "avx2": "AVX2", "avx512": "AVX512_CORE", "avx512_bf16": "AVX512_CORE_BF16",
               "amx": "AVX512_CORE_AMX"}


@functools.cache
def _cpuinfo_field(name: str) -> str:
    """The first value of a /proc/cpuinfo field ("" where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.split(":", 1)[0].strip() == name:
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


@functools.cache
def cpu_flags() -> frozenset[str]:
    return frozenset(_cpuinfo_field("flags").split())


def cpu_vendor() -> str:
    """GenuineIntel, AuthenticAMD, ... (kernels' speeds differ between vendors at one ISA level)."""
    return _cpuinfo_field("vendor_id")


def cpu_family() -> str:
    """The CPU family number ("25": AMD Zen 3/4, "26": Zen 5; "6": Intel's cores), "" where unknown."""
    return _cpuinfo_field("cpu family")


def cpu_model_number() -> str:
    """The model number within the family ("1": a Zen 3 EPYC, "17": a Zen 4 EPYC), "" where unknown."""
    return _cpuinfo_field("model")


def hardware_isa() -> str:
    """The highest level whose features this CPU has (each level needs the ones below it)."""
    flags, level = cpu_flags(), "scalar"
    for name in ISA_LEVELS[1:]:
        if not _REQUIRED[name] <= flags:
            break
        level = name
    return level


def isa_cap() -> str | None:
    cap = os.environ.get("TOKENMILL_CPU_ISA")
    if not cap:
        return None
    cap = cap.lower()
    if cap not in ISA_LEVELS:
        raise ConfigError(f"TOKENMILL_CPU_ISA={cap!r}: choose one of {', '.join(ISA_LEVELS)}")
    return cap


def active_isa() -> str:
    """The level tokenmill's kernels run at: the hardware's, capped by TOKENMILL_CPU_ISA."""
    hw, cap = hardware_isa(), isa_cap()
    if cap is None:
        return hw
    return ISA_LEVELS[min(ISA_LEVELS.index(hw), ISA_LEVELS.index(cap))]


def isa_at_least(level: str) -> bool:
    return ISA_LEVELS.index(active_isa()) >= ISA_LEVELS.index(level)


def cap_onednn() -> None:
    """Keep oneDNN's GEMMs within the active level, unless the user set its own cap."""
    cap = isa_cap()
    if cap is not None:
        os.environ.setdefault("ONEDNN_MAX_CPU_ISA", _ONEDNN_ISA[active_isa()])


def has_fast_bf16() -> bool:
    """bf16 GEMMs are fast (AMX or AVX512-BF16); otherwise fp32 is the better default."""
    return isa_at_least("avx512_bf16")


def describe() -> str:
    """For logs and benchmark records: CPU model (with family and model number: a VM's "AMD EPYC" is a
    Zen 3, 4 or 5) and the ISA level in use."""
    model = _cpuinfo_field("model name") or "unknown CPU"
    model_no = f" model {cpu_model_number()}" if cpu_model_number() else ""
    family = f" (family {cpu_family()}{model_no})" if cpu_family() else ""
    hw, act = hardware_isa(), active_isa()
    return f"{model}{family}, ISA {act}" + ("" if act == hw else f" (capped from {hw})")


def default_num_threads() -> int:
    """$OMP_NUM_THREADS when set (as torch itself reads it), else every core."""
    try:
        return max(1, int(os.environ["OMP_NUM_THREADS"]))
    except (KeyError, ValueError):
        return os.cpu_count() or 1


def thread_share(num_threads: int | None, parts: int) -> int:
    """`num_threads` (None: `default_num_threads()`) shared evenly by `parts` (tensor/pipeline ranks,
    or data-parallel replicas on one machine), at least one each."""
    return max(1, (num_threads or default_num_threads()) // parts)

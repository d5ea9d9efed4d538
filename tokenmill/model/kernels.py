"""Builds and loads tokenmill's C++ CPU kernels (torch ops under `torch.ops.tokenmill`): paged
decode attention, fp32 prompt attention, RMSNorm (+ residual), SiLU-and-mul, rotary embedding, the
fused decode layers, a greedy row argmax and a draft model's passes (sources in csrc/).

Compiled once per machine with torch's cpp_extension (one translation unit including every
source, with torch's lighter headers: ~25 s of one Zen 3 core; concurrent processes wait for one
builder under a file lock), cached under the tokenmill cache keyed by the sources, torch
version and CPU features, and linked to torch's own OpenMP runtime so the kernels share torch's
intra-op threads. Returns False (callers fall back to portable code) when
no compiler is available or the build fails.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import torch

from tokenmill.model.loader.cache import build_once, cache_root
from tokenmill.utils.cpu import active_isa

logger = logging.getLogger(__name__)
_SOURCES = [Path(__file__).parent / "csrc" / name for name in ("paged_attention.cpp", "elementwise.cpp",
                                                                    "decode_layers.cpp", "sampling.cpp",
                                                                    "draft_loop.cpp", "prefill_attention.cpp")]
_HEADERS = tuple(sorted((Path(__file__).parent / "csrc").glob("*.h")))  # all: a hand-kept list can miss one
_NAME = "tokenmill_cpu_kernels"
_OPS = ("paged_decode_attention", "paged_decode_attention_scaled", "rms_norm", "silu_and_mul", "rotary_embedding",
        "argmax_rows", "argmax_prob_rows", "prefill_attention")
_lock = threading.Lock()
_loaded: bool | None = None
unavailable_reason: str | None = None  # why the kernels could not be built or loaded, for error messages


def _isa_flags() -> list[str]:
    """Compiler flags for the active ISA level (utils/cpu.py; TOKENMILL_CPU_ISA caps it): one build
    per level, so a capped run exercises the lower level's code paths."""
    level = active_isa()
    if level in ("avx512", "avx512_bf16", "amx"):
        flags = ["-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512", "-mavx512f", "-mavx512bw", "-mavx512vl",
                 "-mavx512dq", "-mfma"]
        return flags + (["-mavx512bf16", "-mavx512vnni"] if level != "avx512" else [])
    if level == "avx2":
        return ["-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2", "-mavx2", "-mfma", "-mf16c"]
    return []


def _cflags() -> list[str]:
    return ["-O3", "-fopenmp", *_isa_flags()]


def _openmp_ldflags() -> list[str]:
    """Link torch's bundled libgomp, not the system's: one OpenMP runtime, one thread pool."""
    lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    bundled = sorted(glob.glob(os.path.join(lib, "libgomp*.so*")))
    if bundled:
        return [f"-L{lib}", f"-l:{os.path.basename(bundled[0])}", f"-Wl,-rpath,{lib}"]
    return ["-fopenmp"]


def cpu_kernels_loaded() -> bool:
    """Whether the kernels are loaded already (never builds them)."""
    return _loaded is True


def load_cpu_kernels() -> bool:
    global _loaded
    with _lock:
        if _loaded is None:
            _loaded = _build_and_load()
        return _loaded


def start_build(load: bool = True) -> None:
    """Build (or load) the kernels on a thread now, so that a first build (a compiler subprocess)
    overlaps the model's loading; load_cpu_kernels() then waits for its result. `load=False`: only
    build into the cache, for another process (the engine core) that will load it."""
    threading.Thread(target=load_cpu_kernels if load else _build_only, name="tokenmill-kernels", daemon=True).start()


def _build_only() -> None:
    if os.environ.get("TOKENMILL_DISABLE_CPU_KERNELS"):
        return
    try:
        build_library(_NAME, _SOURCES, _cflags(), _HEADERS)
    except Exception:  # noqa: BLE001 - the process that loads the kernels says why
        pass


def _unavailable(reason: str) -> bool:
    global unavailable_reason
    unavailable_reason = reason
    logger.warning("CPU kernels unavailable (%s); using portable PyTorch ops", reason)
    return False


def _build_and_load() -> bool:
    if os.environ.get("TOKENMILL_DISABLE_CPU_KERNELS"):
        return _unavailable("TOKENMILL_DISABLE_CPU_KERNELS is set")
    try:
        torch.ops.load_library(str(build_library(_NAME, _SOURCES, _cflags(), _HEADERS)))
        return all(hasattr(torch.ops.tokenmill, op) for op in _OPS)
    except CompilerNotFound as e:
        return _unavailable(str(e))
    except Exception as e:  # a broken compiler, no ninja, an unwritable cache: portable code still works
        return _unavailable(f"{type(e).__name__}: {build_error_line(e)[:300]}")


class CompilerNotFound(RuntimeError):
    pass


def build_error_line(e: Exception) -> str:
    """The compiler's first error line, for a one-line warning."""
    lines = str(e).splitlines()
    return next((ln for ln in lines if "error" in ln.lower() and ".cpp" in ln), lines[0] if lines else "")


def build_library(name: str, sources: list[Path], cflags: list[str], headers: tuple[Path, ...] = (),
                  unity: bool = True) -> Path:
    """Compile `sources` into a shared library once per machine (keyed by torch's version, the
    flags, the sources and the headers they include); concurrent processes wait for one builder
    under a file lock. `unity`: as one translation unit (torch's headers parsed once: less CPU),
    else one per source, compiled in parallel (a shorter critical path when one source dominates).
    Raises when the build fails."""
    key = hashlib.sha256(("|".join([torch.__version__, *cflags, str(unity)]
                                   + [p.read_text() for p in [*sources, *headers]])).encode()).hexdigest()[:16]
    root = cache_root() / "kernels" / key
    library = root / f"{name}.so"
    if not library.is_file():
        compiler = os.environ.get("CXX", "c++")
        if shutil.which(compiler) is None:
            raise CompilerNotFound(f"no C++ compiler: {compiler!r} is not on PATH; install g++ or set CXX")

        def build() -> None:
            for leftover in root.glob("build-*"):  # a builder killed mid-build (we hold the lock)
                shutil.rmtree(leftover, ignore_errors=True)
            _build(root, library, name, sources, cflags, unity)

        build_once(root / ".lock", library.is_file, build)  # one process builds; the others load its result
    return library


def _build(root: Path, library: Path, name: str, sources: list[Path], cflags: list[str], unity: bool) -> None:
    """Compile in a private folder, in a child process (`kernel_build.py`) that takes its compiler
    down with it if this process dies, even by SIGKILL; then move the library into place atomically."""
    logger.info("building %s (once per machine, ~20-40 s)", name)
    tmp = Path(tempfile.mkdtemp(dir=root, prefix="build-"))
    try:
        job = dict(name=name, sources=[str(p) for p in sources], build_directory=str(tmp), cflags=cflags,
                   ldflags=_openmp_ldflags(), unity=unity, parent=os.getpid())
        done = subprocess.run([sys.executable, "-m", "tokenmill.model.kernel_build", json.dumps(job)],
                              capture_output=True, text=True)
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
            raise RuntimeError(f"building {name} failed: {last}\n{done.stderr[-20000:]}")
        os.replace(done.stdout.strip().splitlines()[-1], library)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

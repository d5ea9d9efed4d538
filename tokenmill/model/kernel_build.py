"""Compiles one kernel library for `kernels.build_library`, in its own process group, and takes
that group (ninja, the compiler driver, cc1plus) down when the process that asked for the build
dies: a killed server otherwise leaves compilers running into a folder its restart deletes.

    python -m tokenmill.model.kernel_build '{"name": ..., "sources": [...], ...}'

Prints the built library's path as its last line."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
from pathlib import Path

_PR_SET_PDEATHSIG = 1


def _die_with(parent: int) -> None:
    """SIGTERM this process when `parent` exits, and then kill the whole group."""
    os.setpgrp()  # ninja and the compilers it starts join this group
    signal.signal(signal.SIGTERM, lambda *_: os.killpg(0, signal.SIGKILL))
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except (OSError, AttributeError):  # not Linux: no orphan protection, the build still works
        return
    if os.getppid() != parent:  # the parent died before prctl took effect
        os.killpg(0, signal.SIGKILL)


def main(job: dict) -> None:
    _die_with(job["parent"])
    try:  # the `ninja` wheel ships its binary outside PATH when the venv is not activated
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    except ImportError:
        pass
    from torch.utils.cpp_extension import load

    tmp, sources = Path(job["build_directory"]), [Path(p) for p in job["sources"]]
    if job["unity"] and len(sources) > 1:  # torch's headers, most of each file's compile time, parsed once
        unit = tmp / f"{job['name']}_unity.cpp"
        unit.write_text("".join(f'#include "{p.resolve()}"\n' for p in sources))
        sources = [unit]
    built = load(name=job["name"], sources=[str(p) for p in sources], is_python_module=False,
                 build_directory=str(tmp), verbose=False, extra_cflags=job["cflags"], extra_ldflags=job["ldflags"])
    print(built)


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))

"""The bf16 accuracy and batch-invariance tests once more on every lower ISA path this CPU can run.

Each level runs in its own process with TOKENMILL_CPU_ISA=<level>, which caps tokenmill's C++
kernels (a build per level) and oneDNN's GEMMs (ONEDNN_MAX_CPU_ISA) alike, so an AMX Xeon also
checks the AVX512-BF16 and AVX2 paths of an EPYC or an older CPU, as far as its hardware allows.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tokenmill.utils.cpu import ISA_LEVELS, hardware_isa

LOWER = [lvl for lvl in ISA_LEVELS[1:ISA_LEVELS.index(hardware_isa())]]
BF16_TESTS = ["tests/test_flat_batch.py::test_batching_adds_no_bf16_error",
              "tests/test_flat_batch.py::test_batch_invariant_flat_batch_is_bitwise_alone",
              # the paged kernel's scores without AVX512-BF16 (its pair products emulated by FMAs)
              "tests/test_kernels.py::test_verification_rows_equal_rows_alone",
              "tests/test_kernels.py::test_paged_decode_attention_key_split",
              # the greedy pick's 16-lane masks are 8 lanes on AVX2
              "tests/test_kernels.py::test_argmax_rows_is_torch_argmax",
              "tests/test_kernels.py::test_argmax_prob_rows_is_max_and_softmax"]


@pytest.mark.slow
@pytest.mark.skipif(bool(os.environ.get("TOKENMILL_CPU_ISA")), reason="already running a capped ISA path")
@pytest.mark.parametrize("level", LOWER or [pytest.param("none", marks=pytest.mark.skip(
    reason=f"no ISA level below this CPU's ({hardware_isa()})"))])
def test_bf16_tests_pass_on_lower_isa_path(level):
    env = {**os.environ, "TOKENMILL_CPU_ISA": level}
    env.pop("ONEDNN_MAX_CPU_ISA", None)
    r = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *BF16_TESTS],
                       env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert f"ISA {level} (capped from {hardware_isa()})" in r.stdout  # the subprocess really ran capped

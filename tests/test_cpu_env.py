"""Once an engine has loaded, a step's big buffers are reused from the heap, not mapped afresh and
page-faulted in each time (a 2048-token prefill step of Qwen2.5-Coder-1.5B allocates a 70 MiB MLP
activation per layer; `bench throughput` of 16 x 512 prompt tokens took 1.2M page faults before,
280k after, and ran 1.08x faster; BENCHMARKS.md)."""

from __future__ import annotations

import resource

import torch

from tokenmill import LLM

BIG = 64 << 20  # over glibc's largest mmap threshold (32 MiB): mapped apart unless told otherwise


def _faults_filling_a_big_buffer() -> int:
    buf = torch.empty(BIG, dtype=torch.uint8)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    buf.fill_(1)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


def test_big_buffers_after_load_are_not_faulted_in_again():
    # its own engine: the setting is the process's, and a load that failed in another test undoes it
    llm = LLM(progress=False, kv_cache_memory="64MiB", max_model_len=256)
    llm.generate(["warm up"], use_tqdm=False)
    _faults_filling_a_big_buffer()  # the heap grows once
    # mapped afresh it takes a fault per page, or per 2 MiB huge page (THP_MEM_ALLOC_ENABLE) and more
    assert _faults_filling_a_big_buffer() < BIG // (2 << 20), "a freed 64 MiB buffer was given back to the OS"


def test_bf16_without_fast_bf16_gemms_is_warned(caplog):
    """--dtype bfloat16 on a CPU whose default is fp32 (no AVX512-BF16 or AMX) says it runs slower;
    where bf16 is fast, or with the default dtype, nothing is said."""
    import logging

    from tokenmill.utils.cpu import has_fast_bf16

    warned = {}
    for dtype in ("bfloat16", "auto"):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="tokenmill.worker.worker"):
            LLM(dtype=dtype, progress=False, kv_cache_memory="64MiB", max_model_len=256)
        warned[dtype] = any("runs slower than float32" in r.getMessage() for r in caplog.records)
    assert warned == {"bfloat16": not has_fast_bf16(), "auto": False}

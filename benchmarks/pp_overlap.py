"""Do pipeline micro-batches overlap? Runs SmolLM2 with --pipeline-parallel-size 2 (one thread per
stage) on a batch of decodes and reads each stage's per-step trace (the runner logs it at DEBUG:
per micro-batch, when the stage started waiting for its input, when its compute started and ended;
perf_counter is one clock for every process on the machine).

    python benchmarks/pp_overlap.py [--batch 64] [--output-len 32] [--dtype float32]

Per decode step: the span (first stage's first compute start to last stage's last compute end),
the time both stages compute at once, the last stage's wait for its inputs, and the first stage's
wait for its sends at the end of the step. Baselines from the same run: PP=1 with one thread and
with two. Prints JSON lines.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import statistics
import sys
import tempfile
import time


@contextlib.contextmanager
def rank_debug_log():
    """While inside, the root logger is at DEBUG and fd 2 (inherited by the worker ranks, which
    follow the root logger's level) goes to a file; yields a function that returns its lines so far."""
    logging.basicConfig(level=logging.WARNING)
    root = logging.getLogger()
    level = root.level
    with tempfile.NamedTemporaryFile("w+") as log:
        saved = os.dup(2)
        os.dup2(log.fileno(), 2)
        root.setLevel(logging.DEBUG)
        try:
            yield lambda: open(log.name).readlines()
        finally:
            root.setLevel(level)
            os.dup2(saved, 2)
            os.close(saved)


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(x1, y1) - max(x0, y0)) for x0, x1 in a for y0, y1 in b)


def analyse(lines: list[str]) -> dict:
    """Pair stage 0's and stage 1's trace lines step by step (both log one per step, in order)."""
    traces = {0: [], 1: []}
    for line in lines:
        if "pipeline trace " in line:
            t = json.loads(line.split("pipeline trace ", 1)[1])
            traces[t["stage"]].append(t)
    steps = []
    for s0, s1 in zip(traces[0], traces[1]):
        if len(s0["micro_batches"]) < 2:
            continue  # a step with one request: nothing to overlap
        c0 = [(t1, t2) for _, t1, t2 in s0["micro_batches"]]
        c1 = [(t1, t2) for _, t1, t2 in s1["micro_batches"]]
        span = c1[-1][1] - c0[0][0]
        steps.append(dict(span=span, both=_overlap(c0, c1), busy0=sum(e - s for s, e in c0),
                          busy1=sum(e - s for s, e in c1),
                          recv_wait1=sum(t1 - t0 for t0, t1, _ in s1["micro_batches"]),
                          send_wait0=s0["end"] - c0[-1][1]))
    steps = steps[len(steps) // 4:]  # past prefill and warm-up
    med = {k: statistics.median(s[k] for s in steps) * 1e3 for k in steps[0]} if steps else {}
    return dict(steps=len(steps), **{f"{k}_ms": round(v, 3) for k, v in med.items()},
                overlap_of_span=round(med["both"] / med["span"], 3) if steps else None)


def decode_ms_per_step(llm, batch: int, output_len: int) -> float:
    from tokenmill import SamplingParams

    prompts = [[100 + i, 200, 300, 400] * 8 for i in range(batch)]
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate(prompts, one, use_tqdm=False)  # warm-up; the prompts are cached from here on
    t0 = time.perf_counter()
    llm.generate(prompts, one, use_tqdm=False)
    prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True),
                        use_tqdm=False)
    decode = time.perf_counter() - t0 - prefill
    return outs, decode / (output_len - 1) * 1e3


def run(pp: int, threads: int, args) -> dict:
    from tokenmill import LLM

    llm = LLM(dtype=args.dtype, quantization="none", pipeline_parallel_size=pp, num_threads=threads,
              kv_cache_memory="512MiB", max_model_len=512, progress=False)
    try:
        outs, ms = decode_ms_per_step(llm, args.batch, args.output_len)
        return dict(pp=pp, threads_per_rank=threads // pp, batch=args.batch, dtype=args.dtype,
                    ms_per_decode_step=round(ms, 2)), [o.outputs[0].token_ids for o in outs]
    finally:
        llm.engine.shutdown()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    from tokenmill.utils.cpu import describe

    print(json.dumps(dict(cpu=describe(), load=os.getloadavg(), date=time.strftime("%Y-%m-%d %H:%M UTC",
                                                                                  time.gmtime()))), flush=True)
    ref = None
    for threads in (1, 2):
        row, tokens = run(1, threads, args)
        ref = ref or tokens
        print(json.dumps(row), flush=True)
    with rank_debug_log() as read:
        row, got = run(2, 2, args)
        row.update(analyse(read()), same_tokens_as_pp1=got == ref)
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    sys.exit(main())

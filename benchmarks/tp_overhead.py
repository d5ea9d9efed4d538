"""Tensor parallelism on this machine: the all-reduce cost per layer, and TP=2 against TP=1 at the
same total number of threads.

    python benchmarks/tp_overhead.py [--threads 2] [--batches 1 64] [--output-len 32]

1. All-reduce: two gloo ranks on loopback sum a [batch, hidden] tensor (SmolLM2: hidden 576) as
   the model does twice per layer (after o_proj and after down_proj); bytes and median time.
2. End to end: decode tokens/s of SmolLM2 (fp32 and the default dtype) with batch B, TP=1 with T
   threads vs TP=2 with T/2 threads per rank.
Prints JSON lines.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

HIDDEN = 576  # SmolLM2-135M
LAYERS = 30


def _allreduce_rank(rank, port, batches, dtypes, reps, queue):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    for dtype in dtypes:
        for b in batches:
            x = torch.randn(b, HIDDEN).to(dtype)
            for _ in range(20):
                dist.all_reduce(x)
            times = []
            for _ in range(reps):
                dist.barrier()
                t0 = time.perf_counter()
                dist.all_reduce(x)
                times.append(time.perf_counter() - t0)
            if rank == 0:
                queue.put(dict(kind="allreduce", dtype=str(dtype).removeprefix("torch."), batch=b,
                               bytes_per_allreduce=x.numel() * x.element_size(),
                               bytes_per_layer=2 * x.numel() * x.element_size(),
                               us_per_allreduce=round(statistics.median(times) * 1e6, 1),
                               us_per_layer=round(2 * statistics.median(times) * 1e6, 1),
                               ms_per_step_30_layers=round(2 * LAYERS * statistics.median(times) * 1e3, 2)))
    dist.destroy_process_group()


def allreduce_costs(batches, dtypes, reps=200):
    from tokenmill.executor.multiproc import free_port

    ctx = tmp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_allreduce_rank, args=(r, port, batches, dtypes, reps, queue)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    return [queue.get() for _ in range(len(batches) * len(dtypes))]


def decode_rate(tp, threads, batch, output_len, dtype):
    from tokenmill import LLM, SamplingParams

    llm = LLM(dtype=dtype, quantization="none", tensor_parallel_size=tp, num_threads=threads,
              kv_cache_memory="512MiB", max_model_len=512, progress=False)
    try:
        prompts = [[100 + i, 200, 300, 400] * 8 for i in range(batch)]
        params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
        t0 = time.perf_counter()
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), use_tqdm=False)
        prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        total = time.perf_counter() - t0
        decode = max(total - prefill, 1e-9)
        return dict(kind="decode", dtype=dtype, tp=tp, threads_per_rank=threads, batch=batch,
                    decode_tok_s=round(batch * (output_len - 1) / decode, 1),
                    ms_per_step=round(decode / (output_len - 1) * 1e3, 2))
    finally:
        llm.engine.shutdown()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    args = ap.parse_args()
    from tokenmill.utils.cpu import describe

    print(json.dumps(dict(cpu=describe(), load=os.getloadavg(), date=time.strftime("%Y-%m-%d %H:%M UTC",
                                                                                  time.gmtime()))))
    for row in allreduce_costs(args.batches, [getattr(torch, d) for d in args.dtypes]):
        print(json.dumps(row), flush=True)
    for dtype in args.dtypes:
        for b in args.batches:
            for tp in (1, 2):
                print(json.dumps(decode_rate(tp, max(1, args.threads // tp), b, args.output_len, dtype)), flush=True)


if __name__ == "__main__":
    main()

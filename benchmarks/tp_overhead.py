"""Tensor and pipeline parallelism on this machine, and a scaling model for bigger ones.

    python benchmarks/tp_overhead.py allreduce                     # gloo all-reduce cost per layer
    python benchmarks/tp_overhead.py decode --dtype float32        # TP=1 / TP=2 / PP=2, equal threads
    python benchmarks/tp_overhead.py model allreduce.jsonl decode.jsonl   # the scaling model

1. allreduce: two gloo ranks on loopback sum a [batch, hidden] tensor (SmolLM2: hidden 576) as the
   model does twice per layer (after o_proj and after down_proj): bytes and median time, and a fit
   time = latency + bytes / bandwidth.
2. decode: SmolLM2's decode step time at batch B for TP=1 (1 and 2 threads), TP=2 and PP=2 (one
   thread per rank: equal total threads); for TP=2 the all-reduce time the ranks spent per step
   (from their DEBUG stats lines, so it includes waiting for the slower rank).
3. model: per-token latency against N from the measured one-thread step time t1(B) and the
   measured all-reduce fit extended to a ring of N ranks, and the batch where TP=N stops beating
   N replicas (data parallel) on throughput. Prints JSON lines.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp

HIDDEN = 576  # SmolLM2-135M
LAYERS = 30


def _allreduce_rank(rank, port, batches, dtypes, reps, queue, transport):
    from tokenmill import distributed

    torch.set_num_threads(1)
    init = f"tcp://127.0.0.1:{port}"
    if transport == "gloo":
        dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
        all_reduce = dist.all_reduce
    else:  # tokenmill's: shared memory up to a slot (the engine's default on one x86 machine), gloo beyond
        assert distributed.init_distributed(rank, 2, 1, init, 60.0).shm is not None
        all_reduce = distributed.tp_all_reduce
    for dtype in dtypes:
        for b in batches:
            x = torch.randn(b, HIDDEN).to(dtype)
            for _ in range(20):
                all_reduce(x)
            times = []
            for _ in range(reps):
                dist.barrier()
                t0 = time.perf_counter()
                all_reduce(x)
                times.append(time.perf_counter() - t0)
            if rank == 0:
                us = statistics.median(times) * 1e6
                queue.put(dict(kind="allreduce", transport=transport, dtype=str(dtype).removeprefix("torch."), batch=b,
                               bytes_per_allreduce=x.numel() * x.element_size(), us_per_allreduce=round(us, 1),
                               us_per_layer=round(2 * us, 1), ms_per_step_30_layers=round(2 * LAYERS * us / 1e3, 2)))
    distributed.destroy_distributed() if transport != "gloo" else dist.destroy_process_group()


def allreduce(args):
    from tokenmill.executor.multiproc import free_port

    dtypes = [getattr(torch, d) for d in args.dtypes]
    ctx = tmp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_allreduce_rank, args=(r, port, args.batches, dtypes, args.reps, queue,
                                                                  args.transport))
             for r in range(2)]
    for p in procs:
        p.start()
    rows = [queue.get() for _ in range(len(args.batches) * len(dtypes))]
    for p in procs:
        p.join()
    for row in rows:
        print(json.dumps(row), flush=True)
    for dtype in args.dtypes:  # least squares: us = latency + bytes / bandwidth
        mine = [r for r in rows if r["dtype"] == dtype]
        slope, intercept = statistics.linear_regression([r["bytes_per_allreduce"] for r in mine],
                                                        [r["us_per_allreduce"] for r in mine])
        print(json.dumps(dict(kind="allreduce_fit", transport=args.transport, dtype=dtype,
                              latency_us=round(intercept, 1),
                              bandwidth_GB_s=round(1e-3 / slope, 2) if slope > 0 else None)), flush=True)


def _decode_steps(llm, batch, output_len):
    """ms per decode step at `batch` (prefill of the same cached prompts subtracted)."""
    from tokenmill import SamplingParams

    prompts = [[100 + i, 200, 300, 400] * 8 for i in range(batch)]
    one = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True), use_tqdm=False)
    t0 = time.perf_counter()
    llm.generate(prompts, one, use_tqdm=False)
    prefill = time.perf_counter() - t0
    t0 = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True), use_tqdm=False)
    return (time.perf_counter() - t0 - prefill) / (output_len - 1) * 1e3


def decode(args):
    from pp_overlap import rank_debug_log

    from tokenmill import LLM

    for tp, pp, threads in [tuple(map(int, c.split(","))) for c in args.configs]:
        with rank_debug_log() as read:
            llm = LLM(dtype=args.dtype, quantization="none", tensor_parallel_size=tp, pipeline_parallel_size=pp,
                      num_threads=threads, kv_cache_memory="512MiB", max_model_len=512, progress=False)
            try:
                for b in args.batches:
                    seen = len(read())
                    ms = _decode_steps(llm, b, args.output_len)
                    row = dict(kind="decode", dtype=args.dtype, tp=tp, pp=pp, threads_total=threads, batch=b,
                               ms_per_step=round(ms, 2))
                    stats = [json.loads(line.split("all-reduce stats ", 1)[1]) for line in read()[seen:]
                             if "[rank 0]" in line and "all-reduce stats " in line]
                    steps = [s for s in stats if s["tokens"] == b]  # the decode steps
                    if steps:
                        row.update(allreduce_ms_per_step=round(statistics.median(s["seconds"] for s in steps) * 1e3, 2),
                                   allreduce_calls_per_step=steps[0]["calls"],
                                   allreduce_bytes_per_step=steps[0]["bytes"])
                    print(json.dumps(row), flush=True)
            finally:
                llm.engine.shutdown()


def ring_allreduce_us(nbytes: float, n: int, latency_us: float, bw_gb_s: float) -> float:
    """Ring all-reduce of n ranks: 2(n - 1) hops, each moving nbytes / n per rank. The fit on 2 ranks
    (latency_us + nbytes / bandwidth) is that formula at n = 2: a hop costs latency_us / 2."""
    if n == 1:
        return 0.0
    return (n - 1) * latency_us + 2 * (n - 1) / n * nbytes / (bw_gb_s * 1e3)


def _fit(points):
    """(latency_us, GB/s) of us = latency + bytes / bandwidth over (bytes, us) points."""
    slope, intercept = statistics.linear_regression([x for x, _ in points], [y for _, y in points])
    return round(intercept, 1), round(1e-3 / slope, 3) if slope > 0 else float("inf")


def model(args):
    rows = [json.loads(line) for path in args.files for line in open(path) if line.startswith("{")]
    dec = [r for r in rows if r.get("kind") == "decode" and r["dtype"] == args.dtype]
    t1 = {r["batch"]: r["ms_per_step"] for r in dec if (r["tp"], r["pp"], r["threads_total"]) == (1, 1, 1)}
    batches = sorted(t1)

    def t1_at(b: float) -> float:  # piecewise linear between the measured batches
        lo = max([x for x in batches if x <= b], default=batches[0])
        hi = min([x for x in batches if x >= b], default=batches[-1])
        return t1[lo] if hi == lo else t1[lo] + (t1[hi] - t1[lo]) * (b - lo) / (hi - lo)

    elem = 4 if args.dtype == "float32" else 2
    links = {}
    for r in rows:
        if r.get("kind") == "allreduce_fit" and r["dtype"] == args.dtype:
            links[f"{r.get('transport', 'gloo')}, isolated"] = (r["latency_us"], r["bandwidth_GB_s"])
    engine = [(r["allreduce_bytes_per_step"] / r["allreduce_calls_per_step"],
               r["allreduce_ms_per_step"] * 1e3 / r["allreduce_calls_per_step"])
              for r in dec if r.get("allreduce_calls_per_step")]
    if len(engine) >= 2:
        links["in the engine (TP=2 decode runs)"] = _fit(engine)
    for spec in args.link or []:  # name=latency_us:GB/s, assumed figures for other interconnects
        name, vals = spec.rsplit("=", 1)
        lat, bw = vals.split(":")
        links[name] = (float(lat), float(bw))
    calls = 2 * LAYERS + 1  # two per layer and the vocabulary-parallel embedding's
    for name, (lat, bw) in links.items():
        print(json.dumps(dict(kind="model_link", link=name, latency_us=lat, bandwidth_GB_s=bw)), flush=True)
        for b in batches:
            per_n = {}
            for n in (1, 2, 4, 8):
                comm_ms = calls * ring_allreduce_us(b * HIDDEN * elem, n, lat, bw) / 1e3
                per_n[n] = dict(ms_per_step=round(t1[b] / n + comm_ms, 2), comm_ms=round(comm_ms, 2))
            print(json.dumps(dict(kind="model", link=name, batch=b, t1_ms=t1[b], tp=per_n)), flush=True)
        # TP=N at batch B against N replicas each running B/N: where the replicas' throughput overtakes
        for n in (2, 4, 8):
            loses = [b for b in range(n, batches[-1] + 1, n) if b // n >= batches[0] and
                     t1_at(b) / n + calls * ring_allreduce_us(b * HIDDEN * elem, n, lat, bw) / 1e3 > t1_at(b / n)]
            print(json.dumps(dict(kind="model_crossover", link=name, n=n,
                                  tp_loses_to_replicas_from_batch=min(loses) if loses else None)), flush=True)


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("allreduce")
    a.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 512, 2048])
    a.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    a.add_argument("--reps", type=int, default=200)
    a.add_argument("--transport", choices=["gloo", "tokenmill"], default="gloo")
    d = sub.add_parser("decode")
    d.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    d.add_argument("--output-len", type=int, default=16)
    d.add_argument("--dtype", default="float32")
    d.add_argument("--configs", nargs="+", default=["1,1,1", "1,1,2", "2,1,2", "1,2,2"],
                   help="tp,pp,total threads")
    m = sub.add_parser("model")
    m.add_argument("files", nargs="+")
    m.add_argument("--dtype", default="float32")
    m.add_argument("--link", action="append", help="name=latency_us:GB/s (e.g. an assumed interconnect)")
    args = ap.parse_args()
    if args.cmd != "model":
        from tokenmill.utils.cpu import describe

        print(json.dumps(dict(cpu=describe(), load=os.getloadavg(), date=time.strftime("%Y-%m-%d %H:%M UTC",
                                                                                      time.gmtime()))), flush=True)
    {"allreduce": allreduce, "decode": decode, "model": model}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())

"""Prompt tokens through the paged decode kernel (each a row over the keys up to itself) against
SDPA's flash attention: one layer's attention alone (`--kernel`), a whole prefill through the
engine with the backend's `paged_prefill` switched on and off in alternation, or (`--accuracy`)
how far each path's bf16 logits land from Hugging Face's fp32 ones (total variation per position,
windows of 256 tokens of the perplexity text), beside Hugging Face's own bf16 run.

    python benchmarks/paged_prefill.py --kernel --lengths 128,646,1024,2048,4096 --heads 9,3,64
    python benchmarks/paged_prefill.py --model qwen2.5-coder-1.5b --lengths 128,512,2000
    python benchmarks/paged_prefill.py --accuracy --tokens 8192   # the embedded SmolLM2
"""

from __future__ import annotations

import argparse
import os
import random
import time
from functools import partial

import torch
import torch.nn.functional as F


def best_ms(fn, runs: int) -> float:
    fn()
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times) * 1e3


def kernel_one(n: int, h: int, hkv: int, d: int, runs: int) -> tuple[float, float]:
    """(paged, SDPA) ms for one layer's attention over a prompt of n tokens."""
    bs, blocks = 16, -(-n // 16)
    k_cache, v_cache = (torch.randn(blocks * 4, bs, hkv, d).to(torch.bfloat16) for _ in range(2))
    tables = torch.randperm(blocks * 4)[:blocks].repeat(n, 1).contiguous()
    q = torch.randn(n, h, d).to(torch.bfloat16)
    out = torch.empty_like(q)
    lens = torch.arange(1, n + 1)
    paged = best_ms(lambda: torch.ops.tokenmill.paged_decode_attention(out, q, k_cache, v_cache, tables, lens, 0.125),
                    runs)
    qs = q.transpose(0, 1)[None]
    ks, vs = (torch.randn(1, hkv, n, d).to(torch.bfloat16) for _ in range(2))
    sdpa = best_ms(lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True), runs)
    return paged, sdpa


def kernel(lengths: list[int], heads: str, runs: int) -> None:
    from tokenmill.model.kernels import load_cpu_kernels
    from tokenmill.worker.cpu_env import configure_cpu

    configure_cpu(None)
    assert load_cpu_kernels(), "the CPU kernels could not be built"
    h, hkv, d = (int(x) for x in heads.split(","))
    for n in lengths:
        paged, sdpa = kernel_one(n, h, hkv, d, runs)
        print(f"{n} tokens, heads {heads}: paged {paged:.2f} ms, SDPA {sdpa:.2f} ms, {sdpa / paged:.2f}x", flush=True)


def engine(model: str | None, lengths: list[int], runs: int) -> None:
    from tokenmill import LLM, SamplingParams

    llm = LLM(model, kv_cache_memory="2GiB", max_model_len=max(lengths) + 16, enable_prefix_caching=False,
              progress=False)
    backend = llm.engine.core.worker.backend
    print(f"paged_prefill by default: {backend.paged_prefill}", flush=True)
    vocab = llm.get_tokenizer().vocab_size
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=1)
    for n in lengths:
        ids = [rng.randrange(100, vocab - 1) for _ in range(n)]
        ms = {True: [], False: []}
        for _ in range(runs):
            for on in (True, False):
                backend.paged_prefill = on
                ms[on].append(best_ms(partial(llm.generate, [ids], params, use_tqdm=False), 1))
        on, off = min(ms[True]), min(ms[False])
        print(f"{n} tokens: paged {on:.1f} ms ({n / on * 1e3:.0f} tok/s), SDPA {off:.1f} ms "
              f"({n / off * 1e3:.0f} tok/s), {off / on:.2f}x", flush=True)


def accuracy(tokens: int) -> None:
    import copy
    import sys
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository, for tests.helpers
    from tests.helpers import FlatBatchDriver
    from tokenmill import LLM
    from tokenmill.bench.perplexity import corpus_text
    from tokenmill.model.loader import resolve_model

    path = resolve_model(None).path
    hf32 = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    hf16 = copy.deepcopy(hf32)
    for param in hf16.parameters():
        param.data = param.data.to(torch.bfloat16)
    llm = LLM(dtype="bfloat16", quantization="none", kv_cache_memory="256MiB", max_model_len=2048, progress=False)
    backend, driver = llm.engine.core.worker.backend, FlatBatchDriver(llm.engine)

    def ours(ids):
        req = driver.new("w", ids)
        (logits,) = driver.step([(req, len(ids))])
        driver.free(req)
        return logits

    def tv(a, b):
        return (a.softmax(-1) - b.softmax(-1)).abs().sum(-1) / 2

    ids_all = llm.get_tokenizer().encode(corpus_text())[:tokens]
    res: dict[str, list] = {"paged": [], "sdpa": [], "hf bf16": []}
    with torch.inference_mode():
        for i in range(0, len(ids_all), 256):
            ids = ids_all[i:i + 256]
            ref = hf32(torch.tensor([ids])).logits[0].float()
            res["hf bf16"].append(tv(hf16(torch.tensor([ids])).logits[0].float(), ref))
            for on in (True, False):
                backend.paged_prefill = on
                res["paged" if on else "sdpa"].append(tv(ours(ids), ref))
    for name, parts in res.items():
        t = torch.cat(parts)
        print(f"{name}: total variation to fp32 over {len(t)} positions: mean {t.mean():.5f}, "
              f"p99 {t.quantile(0.99):.4f}, max {t.max():.4f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kernel", action="store_true", help="one layer's attention alone")
    ap.add_argument("--model", default=None)
    ap.add_argument("--lengths", default="128,646,2000")
    ap.add_argument("--heads", default="9,3,64", help="--kernel: query heads, kv heads, head dim")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--accuracy", action="store_true", help="bf16 logits of both paths against HF fp32")
    ap.add_argument("--tokens", type=int, default=8192, help="--accuracy: tokens of text")
    args = ap.parse_args()
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load {os.getloadavg()[0]:.2f}", flush=True)
    lengths = [int(x) for x in args.lengths.split(",")]
    if args.accuracy:
        accuracy(args.tokens)
    elif args.kernel:
        kernel(lengths, args.heads, max(args.runs, 10))
    else:
        engine(args.model, lengths, args.runs)


if __name__ == "__main__":
    main()

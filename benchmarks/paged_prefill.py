"""Prompt tokens through the paged decode kernel (each a row over the keys up to itself) against
SDPA's flash attention: one layer's attention alone (`--kernel`), a whole prefill through the
engine with the backend's `paged_prefill` switched on and off in alternation (and, in fp32, the
prompt kernel of csrc/prefill_attention.cpp, `prefill_kernel`), or (`--accuracy`)
how far each path's bf16 logits land from Hugging Face's fp32 ones (total variation per position,
windows of 256 tokens of the perplexity text), beside Hugging Face's own bf16 run.

    python benchmarks/paged_prefill.py --kernel --lengths 128,646,1024,2048,4096 --heads 9,3,64
    python benchmarks/paged_prefill.py --kernel --dtype float32 --heads 12,2,128  # with the prompt kernel
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


def kernel_one(n: int, h: int, hkv: int, d: int, runs: int, dtype: torch.dtype) -> dict[str, float]:
    """ms by path for one layer's attention over a fresh prompt of n tokens: the decode kernel (a row
    per token), SDPA, and in fp32 the prompt kernel."""
    bs, blocks = 16, -(-n // 16)
    k_cache, v_cache = (torch.randn(blocks * 4, bs, hkv, d).to(dtype) for _ in range(2))
    table = torch.randperm(blocks * 4)[:blocks]
    tables = table.repeat(n, 1).contiguous()
    q = torch.randn(n, h, d).to(dtype)
    out = torch.empty_like(q)
    lens = torch.arange(1, n + 1)
    ms = {"paged": best_ms(lambda: torch.ops.tokenmill.paged_decode_attention(out, q, k_cache, v_cache, tables, lens,
                                                                              0.125), runs)}
    qs = q.transpose(0, 1)[None]
    ks, vs = (torch.randn(1, hkv, n, d).to(dtype) for _ in range(2))
    ms["sdpa"] = best_ms(lambda: F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True), runs)
    if dtype == torch.float32:
        ms["prompt kernel"] = best_ms(
            lambda: torch.ops.tokenmill.prefill_attention(out, q, k_cache, v_cache, table, n, 0.125), runs)
    return ms


def kernel(lengths: list[int], heads: str, runs: int, dtype: torch.dtype) -> None:
    from tokenmill.model.kernels import load_cpu_kernels
    from tokenmill.worker.cpu_env import configure_cpu

    configure_cpu(None)
    assert load_cpu_kernels(), "the CPU kernels could not be built"
    h, hkv, d = (int(x) for x in heads.split(","))
    for n in lengths:
        ms = kernel_one(n, h, hkv, d, runs, dtype)
        print(f"{n} tokens, heads {heads}, {dtype}: " + ", ".join(
            f"{name} {t:.2f} ms ({ms['sdpa'] / t:.2f}x SDPA)" for name, t in ms.items()), flush=True)


def engine(model: str | None, lengths: list[int], runs: int) -> None:
    """A whole prefill through the engine, by the path its prompts take: SDPA, the decode kernel
    (`paged_prefill`) and, for an fp32 model, the prompt kernel (`prefill_kernel`), in turns."""
    from tokenmill import LLM, SamplingParams

    llm = LLM(model, kv_cache_memory="2GiB", max_model_len=max(lengths) + 16, enable_prefix_caching=False,
              progress=False)
    backend = llm.engine.core.worker.backend
    print(f"by default: paged_prefill {backend.paged_prefill}, prefill_kernel {backend.prefill_kernel}", flush=True)
    paths = {"sdpa": (False, False), "paged": (True, False)}
    if llm.engine.core.worker.dtype == torch.float32:
        paths["kernel"] = (False, True)
    vocab = llm.get_tokenizer().vocab_size
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=1)
    for n in lengths:
        ids = [rng.randrange(100, vocab - 1) for _ in range(n)]
        ms = {name: [] for name in paths}
        for _ in range(runs):
            for name, (paged, kernel) in paths.items():
                backend.paged_prefill, backend.prefill_kernel = paged, kernel
                ms[name].append(best_ms(partial(llm.generate, [ids], params, use_tqdm=False), 1))
        best = {name: min(v) for name, v in ms.items()}
        print(f"{n} tokens: " + ", ".join(f"{name} {t:.1f} ms ({n / t * 1e3:.0f} tok/s, {best['sdpa'] / t:.2f}x)"
                                          for name, t in best.items()), flush=True)


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
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="--kernel: q and K/V")
    ap.add_argument("--accuracy", action="store_true", help="bf16 logits of both paths against HF fp32")
    ap.add_argument("--tokens", type=int, default=8192, help="--accuracy: tokens of text")
    args = ap.parse_args()
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load {os.getloadavg()[0]:.2f}", flush=True)
    lengths = [int(x) for x in args.lengths.split(",")]
    if args.accuracy:
        accuracy(args.tokens)
    elif args.kernel:
        kernel(lengths, args.heads, max(args.runs, 10), getattr(torch, args.dtype))
    else:
        engine(args.model, lengths, args.runs)


if __name__ == "__main__":
    main()

"""The accuracy table of BENCHMARKS.md: perplexity of each quantization against its reference, on
the same text (tokenmill/bench/perplexity.py says which).

    python benchmarks/perplexity.py --models smollm2-135m --tokens 20480 [--only gguf,int]

Rows per model (all through the engine, prompt logprobs of windows of 1024 tokens). Quantized rows
run with --batch-invariant: every token then goes through exactly what decoding runs (the packed
kernels and the paged decode attention over the KV cache), not the many-row prefill path.
- gguf: the GGUF in its own types (fp32 and bf16 activations) vs the same GGUF dequantized to fp32;
- kv: the native GGUF with an int8 / fp8 KV cache vs a bf16 KV cache;
- int: --quantization int8 / int4 (g32, g128) of a Hugging Face folder holding the GGUF's weights
  dequantized to fp32 (made once with transformers), vs that folder in fp32.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from pathlib import Path

from tokenmill import LLM
from tokenmill.bench.perplexity import CORPUS_NAME, corpus_tokens, perplexity
from tokenmill.model.loader import resolve_model
from tokenmill.model.loader.cache import cache_root
from tokenmill.utils.cpu import describe

COMMON = dict(kv_cache_memory="1GiB", max_model_len=1088, max_num_batched_tokens=128, enable_prefix_caching=False,
              progress=False)


def hf_folder(model: str) -> Path:
    """The GGUF's weights dequantized to fp32, saved as a Hugging Face folder (once)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = resolve_model(model).path
    out = cache_root() / "hf-from-gguf" / src.stem
    if not (out / "config.json").is_file():
        from safetensors.torch import save_file

        m = AutoModelForCausalLM.from_pretrained(str(src.parent), gguf_file=src.name, dtype=torch.float32)
        out.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().clone().contiguous() for k, v in m.state_dict().items()}
        if m.config.tie_word_embeddings:
            tensors.pop("lm_head.weight", None)
        save_file(tensors, str(out / "model.safetensors"))
        cfg = m.config.to_dict()
        cfg.pop("quantization_config", None)
        cfg["architectures"] = [type(m).__name__]
        (out / "config.json").write_text(json.dumps(cfg))
        AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name).save_pretrained(str(out))
    return out


def measure(model: str, ids: list[int], **kw) -> float:
    if kw.get("quantization") != "none":
        kw["batch_invariant"] = True
    llm = LLM(model, **COMMON, **kw)
    t = time.perf_counter()
    ppl = perplexity(llm, ids)["perplexity"]
    print(f"  {model} {kw}: ppl {ppl:.4f} ({time.perf_counter() - t:.0f}s)", flush=True)
    del llm
    gc.collect()
    return ppl


def rows_for(model: str, ids: list[int], only: set[str]) -> list[dict]:
    rows = []

    def row(name, ref_name, ref, value, budget):
        rows.append({"model": model, "config": name, "reference": ref_name, "ppl": round(value, 4),
                     "ref_ppl": round(ref, 4), "delta_pct": round(100 * (value / ref - 1), 3), "budget_pct": budget})

    if "gguf" in only:
        ref = measure(model, ids, quantization="none", dtype="float32")
        row("gguf native, fp32 activations", "dequantized fp32", ref,
            measure(model, ids, quantization="gguf", dtype="float32"), 0.5)
        row("gguf native, bf16 activations", "dequantized fp32", ref,
            measure(model, ids, quantization="gguf", dtype="bfloat16"), 0.5)
        row("gguf native, fp32, --quant-act-bits 8", "dequantized fp32", ref,
            measure(model, ids, quantization="gguf", dtype="float32", quant_act_bits=8), 0.5)
    if "kv" in only:
        ref = measure(model, ids, quantization="gguf", dtype="bfloat16", kv_cache_dtype="bfloat16")
        for kv in ("int8", "fp8_e4m3"):
            row(f"gguf native, {kv} KV cache", "bf16 KV cache", ref,
                measure(model, ids, quantization="gguf", dtype="bfloat16", kv_cache_dtype=kv), 1.0)
    if "int" in only:
        folder = str(hf_folder(model))
        ref = measure(folder, ids, quantization="none", dtype="float32")
        row("--quantization int8", "fp32 folder", ref, measure(folder, ids, quantization="int8", dtype="float32"), 1.0)
        for g in (32, 128):
            row(f"--quantization int4 (group {g})", "fp32 folder", ref,
                measure(folder, ids, quantization="int4", quant_group_size=g, dtype="float32"), 5.0)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=20480)
    ap.add_argument("--only", default="gguf,kv,int")
    ap.add_argument("--output-json")
    args = ap.parse_args()
    only = set(args.only.split(","))
    results = []
    for model in args.models.split(","):
        llm = LLM(model, quantization="none", kv_cache_memory="64MiB", max_model_len=1024, progress=False)
        ids = corpus_tokens(llm.get_tokenizer(), args.tokens)
        del llm
        results += rows_for(model, ids, only)
    print(f"\n{CORPUS_NAME}, {args.tokens} tokens; {describe()}; load {os.getloadavg()[0]:.2f}")
    print("| model | configuration | reference | perplexity | reference ppl | change | budget |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['model']} | {r['config']} | {r['reference']} | {r['ppl']:.3f} | {r['ref_ppl']:.3f} | "
              f"{r['delta_pct']:+.2f}% | {r['budget_pct']}% |")
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

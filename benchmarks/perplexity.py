"""The accuracy table of BENCHMARKS.md: perplexity of each quantization against its reference, on
the same text (tokenmill/bench/perplexity.py says which).

    python benchmarks/perplexity.py --models smollm2-135m --tokens 20480 --results ppl.json [--only gguf,kv-int8]

Each row is one measurement (an engine built, the text scored through prompt logprobs of windows
of 1024 tokens, prefilled in chunks of 128). `--only` takes groups (gguf, kv, int) or row names
(`--list` prints them); with `--results`, every measurement is saved as it ends and the table is
made from all saved ones, so a long table can be measured in several short runs.
- gguf: the GGUF in its own types (fp32 and bf16 activations, 16-, 8-bit and auto activation codes) vs
  the same GGUF dequantized to fp32 at load (`--quantization none`);
- kv: the native GGUF with an int8 / fp8 (e4m3, e5m2) KV cache vs a bf16 KV cache;
- int: --quantization int8 / int4 (g32, g128) of a Hugging Face folder holding the GGUF's weights
  dequantized to fp32 (made once with transformers), vs that folder in fp32.
Native-GGUF and KV rows run with --batch-invariant: every token then goes through exactly what
decoding runs (the packed kernels and the paged decode attention over the KV cache), not the
many-row prefill path. The int rows cannot (their LM head is a dense fp32 GEMM, which oneDNN does
not keep row-invariant on every CPU): there `--quant-dense-min-rows` above the chunk size sends
every product of the quantized layers to the packed kernel, and attention is that of the reference.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from datetime import UTC, datetime
from pathlib import Path

from tokenmill import LLM
from tokenmill.bench.perplexity import CORPUS_NAME, corpus_tokens, perplexity
from tokenmill.errors import ConfigError
from tokenmill.model.loader import resolve_model
from tokenmill.model.loader.cache import cache_root
from tokenmill.utils.cpu import describe

CHUNK = 128
COMMON = dict(kv_cache_memory="1GiB", max_model_len=1088, max_num_batched_tokens=CHUNK, enable_prefix_caching=False,
              progress=False)
DECODE_PATH = dict(batch_invariant=True)
PACKED_ONLY = dict(quant_dense_min_rows=CHUNK + 1)
GGUF_REF = ("gguf-ref", "dequantized fp32", 0.5)
KV_REF = ("kv-bf16", "bf16 KV cache", 1.0)
KV_REF_UNBUDGETED = ("kv-bf16", "bf16 KV cache", None)  # e5m2: vLLM's other fp8, for which issue 8 sets no budget
INT_REF = ("int-ref", "fp32 folder", 1.0)

# name -> (group, label, (reference row, its label, budget %) or None, engine arguments)
ROWS = {
    "gguf-ref": ("gguf", "GGUF dequantized to fp32 at load", None, dict(quantization="none", dtype="float32")),
    "gguf-fp32": ("gguf", "gguf native, fp32 activations", GGUF_REF,
                  dict(quantization="gguf", dtype="float32", quant_act_bits=16, **DECODE_PATH)),
    "gguf-bf16": ("gguf", "gguf native, bf16 activations", GGUF_REF,
                  dict(quantization="gguf", dtype="bfloat16", quant_act_bits=16, **DECODE_PATH)),
    "gguf-bf16-auto": ("gguf", "gguf native, bf16, --quant-act-bits auto (the default)", GGUF_REF,
                       dict(quantization="gguf", dtype="bfloat16", **DECODE_PATH)),
    "gguf-fp32-auto": ("gguf", "gguf native, fp32, --quant-act-bits auto (the default)", GGUF_REF,
                       dict(quantization="gguf", dtype="float32", **DECODE_PATH)),
    "gguf-act8": ("gguf", "gguf native, fp32, --quant-act-bits 8", GGUF_REF,
                  dict(quantization="gguf", dtype="float32", quant_act_bits=8, **DECODE_PATH)),
    "gguf-bf16-act8": ("gguf", "gguf native, bf16, --quant-act-bits 8", GGUF_REF,
                       dict(quantization="gguf", dtype="bfloat16", quant_act_bits=8, **DECODE_PATH)),
    "kv-bf16": ("kv", "gguf native, bf16, bf16 KV cache", None,
                dict(quantization="gguf", dtype="bfloat16", kv_cache_dtype="bfloat16", **DECODE_PATH)),
    "kv-int8": ("kv", "gguf native, bf16, int8 KV cache", KV_REF,
                dict(quantization="gguf", dtype="bfloat16", kv_cache_dtype="int8", **DECODE_PATH)),
    "kv-fp8": ("kv", "gguf native, bf16, fp8_e4m3 KV cache", KV_REF,
               dict(quantization="gguf", dtype="bfloat16", kv_cache_dtype="fp8_e4m3", **DECODE_PATH)),
    "kv-fp8-e5m2": ("kv", "gguf native, bf16, fp8_e5m2 KV cache", KV_REF_UNBUDGETED,
                    dict(quantization="gguf", dtype="bfloat16", kv_cache_dtype="fp8_e5m2", **DECODE_PATH)),
    "int-ref": ("int", "HF folder, fp32", None, dict(quantization="none", dtype="float32")),
    "int8": ("int", "--quantization int8", INT_REF, dict(quantization="int8", dtype="float32", **PACKED_ONLY)),
    "int4-g32": ("int", "--quantization int4 (group 32)", (*INT_REF[:2], 5.0),
                 dict(quantization="int4", quant_group_size=32, dtype="float32", **PACKED_ONLY)),
    "int4-g128": ("int", "--quantization int4 (group 128)", (*INT_REF[:2], 5.0),
                  dict(quantization="int4", quant_group_size=128, dtype="float32", **PACKED_ONLY)),
}


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


def measure(model: str, row: str, ids: list[int]) -> dict:
    group, _, _, kw = ROWS[row]
    source = str(hf_folder(model)) if group == "int" else model
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    try:
        llm = LLM(source, **COMMON, **kw)
    except ConfigError as e:  # e.g. int4 groups of 128 on SmolLM2 (hidden size 576)
        print(f"  {model} {row} {kw}: not applicable: {e}", flush=True)
        return {"model": model, "row": row, "tokens": len(ids), "ppl": None, "error": str(e)}
    t1 = time.perf_counter()
    ppl = perplexity(llm, ids)["perplexity"]
    t2 = time.perf_counter()
    del llm
    gc.collect()
    rec = {"model": model, "row": row, "tokens": len(ids), "ppl": ppl, "load_s": round(t1 - t0, 1),
           "score_s": round(t2 - t1, 1), "load_before": round(load, 2), "load_after": round(os.getloadavg()[0], 2),
           "utc": datetime.now(UTC).strftime("%Y-%m-%d %H:%M"), "cpu": describe()}
    print(f"  {model} {row} {kw}: ppl {ppl:.4f} (load {rec['load_s']}s, scoring {rec['score_s']}s, "
          f"load avg {rec['load_before']} -> {rec['load_after']})", flush=True)
    return rec


def _budget(ref: tuple) -> str:
    return "none" if ref[2] is None else f"{ref[2]}%"


def table(results: dict, models: list[str], tokens: int) -> str:
    lines = ["| model | configuration | reference | perplexity | reference ppl | change | budget | pass |",
             "|---|---|---|---|---|---|---|---|"]
    for model in models:
        for row, (_, label, ref, _) in ROWS.items():
            r = results.get(f"{model}|{tokens}|{row}")
            if r is None:
                continue
            if r["ppl"] is None:
                lines.append(f"| {model} | {label} | | n/a: {r['error']} | | | | |")
                continue
            if ref is None:
                lines.append(f"| {model} | {label} | (reference) | {r['ppl']:.3f} | | | | |")
                continue
            base = results.get(f"{model}|{tokens}|{ref[0]}")
            if base is None or base["ppl"] is None:
                lines.append(f"| {model} | {label} | {ref[1]} (not measured) | {r['ppl']:.3f} | | | {_budget(ref)} | |")
                continue
            delta = 100 * (r["ppl"] / base["ppl"] - 1)
            ok = "" if ref[2] is None else "pass" if abs(delta) <= ref[2] else "**FAIL**"
            lines.append(f"| {model} | {label} | {ref[1]} | {r['ppl']:.3f} | {base['ppl']:.3f} | {delta:+.2f}% | "
                         f"{_budget(ref)} | {ok} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="smollm2-135m")
    ap.add_argument("--tokens", type=int, default=20480)
    ap.add_argument("--only", default="gguf,kv,int", help="groups (gguf, kv, int) or row names, comma-separated")
    ap.add_argument("--results", help="JSON file of measurements: read, extended as each row ends")
    ap.add_argument("--list", action="store_true", help="print the row names and exit")
    args = ap.parse_args()
    if args.list:
        for row, (group, label, ref, kw) in ROWS.items():
            against = "" if ref is None else f"  vs {ref[0]}" + ("" if ref[2] is None else f", budget {ref[2]}%")
            print(f"{row:10} {group:5} {label}  {kw}{against}")
        return
    wanted = set(args.only.split(","))
    unknown = wanted - set(ROWS) - {g for g, *_ in ROWS.values()}
    if unknown:
        ap.error(f"unknown rows or groups: {sorted(unknown)} (see --list)")
    rows = [r for r, (g, *_) in ROWS.items() if r in wanted or g in wanted]
    path = Path(args.results) if args.results else None
    results = json.loads(path.read_text()) if path and path.is_file() else {}
    models = args.models.split(",")
    for model in models:
        llm = LLM(model, quantization="none", kv_cache_memory="64MiB", max_model_len=1024, progress=False)
        ids = corpus_tokens(llm.get_tokenizer(), args.tokens)
        del llm
        for row in rows:
            results[f"{model}|{args.tokens}|{row}"] = measure(model, row, ids)
            if path:
                path.write_text(json.dumps(results, indent=1))
    print(f"\n{CORPUS_NAME}, {args.tokens} tokens; {describe()}")
    print(table(results, models, args.tokens))


if __name__ == "__main__":
    main()

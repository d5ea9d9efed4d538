"""A whole model in K-quants without Qwen's download: a tiny random Qwen2 written as a GGUF with
Qwen2.5-Coder's mix of types (Q4_K, Q6_K for v/down/output, Q5_0 for up: q, k and v merge into one
layer of two types), and no tokenizer metadata, so it runs with --tokenizer (SmolLM2's). CI has no
Qwen installed; this covers the K-quant kernels inside a model, the loader's per-tensor types, the
int4 draft requantized from Q6_K/Q5_0, and the activation-code measurement, in every run.
"""

from __future__ import annotations

import gc
import json
import shutil

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.model.loader import gguf_loader, resolve_model
from tokenmill.model.quant_kernels import quant_kernels_available

from .tiny_gguf import assert_greedy_close, tiny_prompts, write_tiny_kquant_gguf

pytestmark = pytest.mark.skipif(not quant_kernels_available(), reason="no C++ toolchain")
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def tiny_kquant(tmp_path_factory):
    path = tmp_path_factory.mktemp("kquant") / "tiny-kquant-qwen2.gguf"
    write_tiny_kquant_gguf(path)
    # the same model under another name, as a draft: its activation codes are measured again (the
    # verdicts are cached per file path)
    shutil.copy(path, path.with_name("tiny-kquant-draft.gguf"))
    tokenizer = str(gguf_loader.tokenizer_dir(resolve_model(None).path))
    return path, tokenizer


def _llm(tiny, **kw) -> LLM:
    path, tokenizer = tiny
    args = dict(kv_cache_memory="64MiB", max_model_len=256, progress=False)
    return LLM(model=str(path), tokenizer=tokenizer, **{**args, **kw})


def test_native_kquants_match_the_dequantized_model(tiny_kquant):
    """Native K-quant products against the same GGUF dequantized to fp32, with 16-bit activation
    codes (measured: logprobs within 0.001; 8-bit codes move this random model's by up to 0.4)."""
    outs = {}
    for q, bits in (("gguf", 16), ("none", "auto")):
        llm = _llm(tiny_kquant, quantization=q, dtype="float32", quant_act_bits=bits)
        outs[q] = llm.generate(tiny_prompts(), GREEDY, use_tqdm=False)
        del llm
        gc.collect()
    assert_greedy_close(outs["gguf"], outs["none"])


@pytest.mark.parametrize("draft_quantization", ["int4", None])
def test_kquant_model_drafting_for_itself(tiny_kquant, draft_quantization):
    """The model drafting for itself: greedy output as without speculation. The target's activation
    codes are measured at load (max_model_len 256 is below the measurement's 512 tokens: they are cut
    to it), with --tokenizer. Requantized to int4 at load from Q4_K/Q5_0/Q6_K, the draft agrees on
    most tokens (55 of 65 measured; a draft whose int4 layers were left in the wrong layout: 0 of 84); as it
    is in the file (its codes measured as well), on nearly all."""
    args = dict(dtype="bfloat16", batch_invariant=True)
    llm = _llm(tiny_kquant, **args)
    ref = llm.generate(tiny_prompts(), GREEDY, use_tqdm=False)
    del llm
    draft = tiny_kquant[0].with_name("tiny-kquant-draft.gguf")
    spec = {"model": str(draft), "num_speculative_tokens": 3, "draft_lookup_min": 0, "adaptive": False}
    if draft_quantization:
        spec["quantization"] = draft_quantization
    llm = _llm(tiny_kquant, speculative_config=json.dumps(spec), **args)
    outs = llm.generate(tiny_prompts(), GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [r.outputs[0].token_ids for r in ref]
    stats = llm.engine.core.stats().spec_decoding
    assert stats.num_draft_tokens > 0 and stats.acceptance_rate > (0.5 if draft_quantization else 0.9), stats
    del llm
    gc.collect()


def test_auto_codes_leave_no_method_unset_with_an_untied_embedding(tiny_kquant, tmp_path, monkeypatch):
    """An untied embedding's packed method only looks rows up, so `auto` measures no codes for it;
    it still gets some (16), since the crossover measurement multiplies by every packed method."""
    from tokenmill.model.layers.quantization import act_bits, crossover
    from tokenmill.model.layers.quantization.packed import PackedLinearMethod
    from tokenmill.model.loader.cache import VerdictFile

    monkeypatch.setattr(act_bits, "VERDICTS", VerdictFile("act_bits.json", tmp_path / "bits.json"))
    monkeypatch.setattr(crossover, "VERDICTS", VerdictFile("dense_crossover.json", tmp_path / "cross.json"))
    llm = _llm(tiny_kquant, quant_dense_min_rows="measure")
    model = llm.engine.core.worker.model
    methods = {n: m.method for n, m in model.named_modules() if isinstance(getattr(m, "method", None),
                                                                            PackedLinearMethod)}
    assert methods["model.embed_tokens"] is not methods["lm_head"]  # untied: Q4_K table, Q6_K head
    assert methods["model.embed_tokens"].act_bits == 16
    assert all(m.act_bits in (8, 16) for m in methods.values())
    assert llm.generate(tiny_prompts(1), GREEDY, use_tqdm=False)[0].outputs[0].token_ids

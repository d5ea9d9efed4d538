"""`--quant-act-bits auto`: the packed kernels' activation precision, measured once per model.

8-bit codes (one int8 per activation and a scale per 32, as llama.cpp's and vLLM's GGUF kernels; for
K-quant weights a power-of-two fraction of a 256-value super-block's, so that their sub-block scales
apply in integers) take half the integer work of 16-bit ones (int8 plus an int8 code of its rounding
residual, as exact as fp32): what bounds many-row products (prefill, verification, batches) on a CPU
without AMX. What they cost in accuracy depends on the model, and within a model on the layer kind:
on Qwen2.5-Coder nothing measurable; on SmolLM2-135M +0.5% perplexity on a 20k-token text with every
product at 8 bits, +0.27% of it from the qkv products alone (BENCHMARKS.md). So the choice is measured
per layer kind (the name a layer has in every decoder layer: qkv_proj, o_proj, gate_up_proj, down_proj,
and lm_head) on 512 tokens of built-in text (calibration.py), as the expected perplexity change against
16-bit codes everywhere, e^KL - 1 with KL the mean divergence of the next-token distributions (llama.cpp's
`llama-perplexity --kl-divergence`; the reference's top 256 tokens and the rest lumped into one), kinds
taking 8 bits, then 8 bits with their layers' outlier channels (outlier_channels.py: a few columns left
out of the codes and added back exactly), while within `MAX_CHANGE` (`choose_kinds`).
Not the perplexity of those 512 tokens: which way each code rounds is a coin toss that moves it by
tenths of a percent. Measured at load and again after the engine had swapped in its fused norm
kernels (a 1e-5 change of the 16-bit perplexity), SmolLM2 with every kind at 8 bits cost +0.69% and
+1.20%; its KL moved 5% (0.0030 and 0.0031). `MAX_CHANGE` is 0.15%: on SmolLM2 the 20k-token text
moved ~1.5x the KL estimate (every kind: e^KL - 1 = 0.30%, measured +0.49%), so this keeps the verdict
under a third of issue 8's 0.5% budget there.
A bf16 model is measured with fp32 activations where it can be (every bf16 tensor it holds is a norm's
or a bias's vector, as with GGUF files run natively): bf16's own rounding would count in the divergence.
The verdict is kept in the cache folder, keyed by the weight files' size and time, the dtype measured in
and the codes (`CODES`), so a model pays the measurement (2 passes over the text where every kind takes 8
bits, ~13 for SmolLM2: ~1 s a pass on 2 cores) once. With tensor or pipeline parallelism no rank
can run the whole model alone: 16 bits without measuring. A model with near-uniform predictions
(random weights) hardly moves its distributions whatever its products do, so tests of the products
themselves pin the bits.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.nn.functional as F

from tokenmill.model.layers.quantization import outlier_channels
from tokenmill.model.layers.quantization.packed import PackedLinearMethod
from tokenmill.model.loader.cache import VerdictFile

logger = logging.getLogger(__name__)
TOKENS = 512
MAX_CHANGE = 0.0015  # expected relative perplexity change (e^KL - 1) allowed for 8-bit codes
TOP = 256  # the reference's most likely tokens kept per position; the rest is one lumped outcome
# what 8-bit codes are and how a verdict reads; one measured on other codes is measured again.
# 2: power-of-two chunk scales under each 256-value super-block for K-quant weights (csrc/quant_act.h),
# per 32 for the rest; 3: the bits chosen per layer kind; 4: measured by KL divergence; 5: 8-bit codes
# with outlier channels (outlier_channels.py).
CODES = 5
VERDICTS = VerdictFile("act_bits.json")


def packed_methods(model: torch.nn.Module) -> list[PackedLinearMethod]:
    return [m for ms in methods_by_kind(model).values() for m in ms]


def methods_by_kind(model: torch.nn.Module) -> dict[str, list[PackedLinearMethod]]:
    """Packed methods by the kind of layer that multiplies by them (the module name's last part).
    An embedding only looks rows up: a tied head's method is the head's kind."""
    from tokenmill.model.layers.embedding import VocabEmbedding

    kinds: dict[str, list[PackedLinearMethod]] = {}
    seen: set[int] = set()
    for name, m in model.named_modules():
        method = getattr(m, "method", None)
        if isinstance(method, PackedLinearMethod) and not isinstance(m, VocabEmbedding) and id(method) not in seen:
            seen.add(id(method))
            kinds.setdefault(kind_of(name), []).append(method)
    return kinds


def kind_of(name: str) -> str:
    """A layer's kind: its module name's last part, the same in every decoder layer."""
    return name.rsplit(".", 1)[-1]


def set_act_bits(model: torch.nn.Module, bits: int | dict[str, int]) -> None:
    """bits: for every kind, or per kind (a kind not named: 16). An untied embedding's own method
    only looks rows up; it takes 16, so that nothing is left "auto" (the crossover reads every
    packed method's codes)."""
    for kind, methods in methods_by_kind(model).items():
        for method in methods:
            method.set_act_bits(bits if isinstance(bits, int) else bits.get(kind, 16))
    for m in model.modules():
        method = getattr(m, "method", None)
        if isinstance(method, PackedLinearMethod) and method.act_bits == "auto":
            method.set_act_bits(16)


def fingerprint(path: Path, dtype: torch.dtype) -> str:
    """The weight files' names, sizes and modification times, the activations' dtype, and the codes."""
    files = [path] if path.is_file() else sorted(p for p in path.iterdir() if p.is_file())
    stats = [f"{p.name}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files]
    return f"{path.resolve()}|{dtype}|codes{CODES}|" + ",".join(stats)


def _log_probs(model: torch.nn.Module, ids: list[int]) -> Iterator[torch.Tensor]:
    """Next-token log-probabilities after each prefix of ids (but the whole), 128 positions at a time:
    one causal pass, no KV cache."""
    from tokenmill.model.layers.quantization.calibration import causal_pass

    hidden = causal_pass(model, ids)
    n = len(ids) - 1
    with torch.inference_mode():
        for i in range(0, n, 128):
            yield F.log_softmax(model.compute_logits(hidden[i:min(i + 128, n)]).float(), -1)


def lumped_kl(ref_top: torch.Tensor, ref_ids: torch.Tensor, log_probs: torch.Tensor) -> torch.Tensor:
    """KL(reference || other) per position over the reference's top tokens (log-probabilities ref_top at
    ref_ids) and one outcome for all the others: a lower bound of the full divergence (lumping outcomes
    never adds to it), equal to it when the top tokens hold all the mass."""
    ref_top, other_top = ref_top.double(), log_probs.gather(-1, ref_ids).double()
    top = (ref_top.exp() * (ref_top - other_top)).sum(-1)
    # the rest's masses, 1 minus sums of float32 probabilities: below 1e-5 they are rounding, counted as none
    rest_p, rest_q = ((1 - t.exp().sum(-1)).clamp(min=1e-5) for t in (ref_top, other_top))
    return top + torch.where(rest_p > 1e-5, rest_p * (rest_p.log() - rest_q.log()), 0.0)


def fp32_measurable(model: torch.nn.Module) -> bool:
    """Whether the model can run with fp32 activations for a while at little memory: it holds no bf16
    tensor of more than one dimension (its products are packed; a dense one's weight would be copied)."""
    tensors = [*model.parameters(), *model.buffers()]
    return all(t.dtype != torch.bfloat16 or t.dim() <= 1 for t in tensors)


def measures_in_fp32(model: torch.nn.Module, dtype: torch.dtype) -> bool:
    """Whether the verdict of a model run in `dtype` is measured with fp32 activations (bf16's own
    rounding would count in the divergence)."""
    return dtype == torch.bfloat16 and fp32_measurable(model)


@contextlib.contextmanager
def fp32_activations(model: torch.nn.Module) -> Iterator[None]:
    """The model's bf16 vectors (norms, biases) in fp32 and its modules' dtype fp32 (the embedding's
    rows), then back to the same bf16 storage."""
    saved = [(t, t.data) for t in (*model.parameters(), *model.buffers()) if t.dtype == torch.bfloat16]
    modules = [m for m in model.modules() if getattr(m, "dtype", None) == torch.bfloat16]
    for t, data in saved:
        t.data = data.float()
    for m in modules:
        m.dtype = torch.float32
    try:
        yield
    finally:
        for t, data in saved:
            t.data = data
        for m in modules:
            m.dtype = torch.bfloat16


class _Trial:
    """Expected perplexity changes of 8-bit codes for sets of kinds against 16-bit codes everywhere (the
    packed kernel every time: the dense path's bf16 weights would add their own rounding to the reference)."""

    def __init__(self, model: torch.nn.Module, ids: list[int]) -> None:
        self.model, self.ids, self.kinds = model, ids, methods_by_kind(model)
        self.layers = outlier_channels.packed_layers(model)
        with self._codes(set(), set()), outlier_channels.scores(model) as found:
            self.reference = [lp.topk(min(TOP, lp.shape[-1]), -1) for lp in _log_probs(model, ids)]
        self.channels = outlier_channels.choose(found)  # per layer name, whichever kind's codes they serve
        self._outliers: dict[str, tuple] | None = None  # their W columns, made on first use

    def layer_channels(self, kinds: set[str]) -> dict[str, list[int]]:
        return {name: cols for name, cols in self.channels.items() if kind_of(name) in kinds}

    def keep_channels(self, kinds: set[str]) -> int:
        """The verdict's channels on the layers, from the W columns the trial made (not made again);
        returns the columns set."""
        kept = self.layer_channels(kinds)
        for name, layer in self.layers.items():
            layer.q_outliers = self._outliers[name] if name in kept else None
        PackedLinearMethod.settings_version += 1
        return sum(map(len, kept.values()))

    @contextlib.contextmanager
    def _codes(self, eight: set[str], channels: set[str]) -> Iterator[None]:
        methods = [(kind, m) for kind, ms in self.kinds.items() for m in ms]
        saved = [(m.dense_min_rows, m.act_bits) for _, m in methods]
        if channels and self._outliers is None:
            outlier_channels.apply_channels(self.model, self.channels)
            self._outliers = {name: layer.q_outliers for name, layer in self.layers.items()}
        saved_outliers = {name: getattr(layer, "q_outliers", None) for name, layer in self.layers.items()}
        try:
            for kind, m in methods:  # the packed kernel at every row count
                m.dense_min_rows, m.act_bits = 0, 8 if kind in eight else 16
            for name, layer in self.layers.items():
                layer.q_outliers = self._outliers.get(name) if kind_of(name) in channels else None
            yield
        finally:
            for (_, m), (rows, bits) in zip(methods, saved):
                m.dense_min_rows, m.act_bits = rows, bits
            for name, layer in self.layers.items():
                layer.q_outliers = saved_outliers[name]

    def change(self, eight: set[str], channels: set[str]) -> float:
        with self._codes(eight, channels):
            kl = sum(lumped_kl(top.values, top.indices, lp).sum().item()
                     for top, lp in zip(self.reference, _log_probs(self.model, self.ids), strict=True))
        return math.expm1(kl / (len(self.ids) - 1))


def choose_kinds(kinds: list[str], change: Callable[[set[str], set[str]], float]) -> dict:
    """The verdict: bits per kind, the kinds whose 8-bit codes take their outlier channels, the chosen
    set's change and the measurements that led there. change(eight, channels): the (expected) perplexity
    change with the kinds `eight` at 8 bits, those in `channels` with their outlier channels.
    Plain 8-bit codes cost the least; channels ~1-15% more (BENCHMARKS.md); 16-bit codes twice:
    - every kind at plain 8 bits when that is within `MAX_CHANGE`;
    - else each kind alone at plain 8 bits, then, from the least harmful, each kind added to those kept
      while the set stays within `MAX_CHANGE`;
    - then each kind left, with its outlier channels, added the same way; the rest keep 16."""
    every = change(set(kinds), set())
    if every <= MAX_CHANGE:
        return {"bits": {k: 8 for k in kinds}, "channels": [], "change": every, "every_kind_change": every}
    alone = {k: change({k}, set()) for k in kinds}
    kept: set[str] = set()
    with_channels: set[str] = set()
    kept_change, steps = 0.0, []
    for kind in sorted(kinds, key=alone.get):
        if alone[kind] > MAX_CHANGE:
            break
        c = alone[kind] if not kept else change(kept | {kind}, set())
        steps.append([kind, c])  # the change of the kinds kept so far with this one
        if c <= MAX_CHANGE:
            kept, kept_change = kept | {kind}, c
    for kind in sorted(set(kinds) - kept, key=alone.get):
        c = change(kept | {kind}, with_channels | {kind})
        steps.append([kind + "+channels", c])
        if c <= MAX_CHANGE:
            kept, with_channels, kept_change = kept | {kind}, with_channels | {kind}, c
    return {"bits": {k: 8 if k in kept else 16 for k in kinds}, "channels": sorted(with_channels),
            "change": kept_change, "every_kind_change": every, "alone": alone, "steps": steps}


def _valid(entry) -> bool:
    bits = entry.get("bits") if isinstance(entry, dict) else None
    channels = entry.get("channels", {}) if isinstance(entry, dict) else None
    return (bits in (8, 16) or (isinstance(bits, dict) and all(b in (8, 16) for b in bits.values()))) and (
        isinstance(channels, dict) and all(
            isinstance(c, list) and len(c) <= outlier_channels.MAX_CHANNELS and len(set(c)) == len(c)
            and all(isinstance(i, int) and i >= 0 for i in c) for c in channels.values()))


def choose_act_bits(model: torch.nn.Module, source, dtype: torch.dtype, calibration_ids) -> dict[str, int]:
    """The codes per layer kind for a model whose packed layers were built with act_bits "auto"; sets
    them on the layers. calibration_ids(source, n): the first n tokens of the built-in text
    (QuantConfig.calibration_ids)."""
    from tokenmill import distributed

    st = distributed.state()
    kinds = methods_by_kind(model)
    if not kinds:
        return {}
    if st.tp_size > 1 or st.pp_size > 1:
        set_act_bits(model, 16)
        logger.info("activation codes: 16-bit (auto is not measured with tensor or pipeline parallelism)")
        return {k: 16 for k in kinds}
    in_fp32 = measures_in_fp32(model, dtype)
    key = fingerprint(Path(source.path), torch.float32 if in_fp32 else dtype)
    entry = VERDICTS.read().get(key)
    cached = _valid(entry)  # else (hand-edited, older): measured
    if not cached:
        from tokenmill.model.layers.quantization.calibration import max_positions

        t0 = time.perf_counter()
        ids = calibration_ids(source, min(TOKENS, max_positions(model)))
        with fp32_activations(model) if in_fp32 else contextlib.nullcontext():
            trial = _Trial(model, ids)
            verdict = choose_kinds(sorted(kinds), trial.change)
        channel_kinds = set(verdict["channels"])
        verdict["channels"] = trial.layer_channels(channel_kinds)  # by layer name
        entry = {**verdict, "tokens": len(ids), "seconds": round(time.perf_counter() - t0, 2)}
        # gone models, and older verdicts of this model and dtype: dropped
        prefix = key.split("|codes", 1)[0] + "|"
        VERDICTS.put(key, entry, keep=lambda k: Path(k.split("|", 1)[0]).exists() and not k.startswith(prefix))
    bits = entry["bits"] if isinstance(entry["bits"], dict) else {k: entry["bits"] for k in kinds}
    bits = {k: bits.get(k, 16) for k in kinds}
    set_act_bits(model, bits)
    channels = (outlier_channels.apply_channels(model, entry.get("channels", {})) if cached
                else trial.keep_channels(channel_kinds))
    eight = sorted(k for k, b in bits.items() if b == 8)
    what = ("8-bit" if len(eight) == len(bits) else "16-bit" if not eight else
            f"8-bit for {', '.join(eight)}, 16-bit for {', '.join(sorted(set(bits) - set(eight)))}")
    logger.info("activation codes: %s, %d outlier channels left out of 8-bit codes (expected perplexity change "
                "against 16-bit codes, e^KL - 1 on %d tokens of built-in text: %+.3f%% with these, %+.3f%% with 8 bits "
                "everywhere; limit %+.2f%%%s%s)", what, channels,
                entry["tokens"], 100 * entry["change"], 100 * entry.get("every_kind_change", entry["change"]),
                100 * MAX_CHANGE,
                "; cached" if cached else f"; {entry['seconds']}s",
                "; measured with fp32 activations" if in_fp32 else "")
    return bits

"""The packed kernel / dense GEMM crossover measured at load, on CPU kinds with no measured entry.

packed.py's tables hold crossovers measured per CPU kind (benchmarks/quant_crossover.py,
BENCHMARKS.md). A kind without one (an AMX Xeon: its entry predated the packed kernels it would
choose between) gets a guess that can cost several times a product's time either way: dequantizing
for 16 rows where the packed kernel is 4x faster, or forgoing AMX tiles for a 2048-token prefill.
So there, and wherever `--quant-dense-min-rows measure` asks, each weight format's crossover is
measured once on the model's own largest layer of that format (its first 1024 output rows, random
activations): both paths at 16, 32, ... rows, dense from the smallest row count from which it is
at least 5% faster at every larger count measured. The verdict is kept in the cache folder, keyed by
the CPU model, the ISA level in use, the kernels' build, the format, the activation codes and dtype.
With tensor or pipeline parallelism several ranks share the cores: no measurement, the table's value.
"""

from __future__ import annotations

import logging
import time

import torch

from tokenmill.model.layers.quantization.formats import BY_ID
from tokenmill.model.layers.quantization.packed import PackedLinearMethod
from tokenmill.model.loader.cache import VerdictFile
from tokenmill.utils.cpu import active_isa, describe
from tokenmill.utils.timing import best_of

logger = logging.getLogger(__name__)
MEASURED_AT_LOAD = {"amx"}  # ISA levels whose table entry is a fallback, not a measurement
ROWS = (16, 32, 64, 128, 256, 512, 1024, 2048)
MAX_MACS = 2e9  # per timed product: bounds the measurement to ~0.1-0.3 s a format on 2 cores
SLICE_ROWS = 1024
MARGIN = 0.95  # dense must take under 95% of the packed kernel's time
VERDICTS = VerdictFile("dense_crossover.json")


def wants_measurement(setting) -> bool:
    """setting: a method's --quant-dense-min-rows (None: the policy; "measure"; or fixed rows)."""
    return setting == "measure" or (setting is None and active_isa() in MEASURED_AT_LOAD)


def crossover_from(timings: dict[int, tuple[float, float]]) -> int:
    """timings: rows -> (packed, dense) seconds. The smallest row count from which dense wins by the
    margin at every larger one measured; 0 (never dequantize) where it does not win at the largest."""
    rows = 0
    for m in sorted(timings, reverse=True):
        packed, dense = timings[m]
        if dense >= MARGIN * packed:
            break
        rows = m
    return rows


def measure(ops, weight: torch.Tensor, qtype: int, n: int, k: int, act_bits: int,
            dtype: torch.dtype) -> dict[int, tuple[float, float]]:
    """Seconds of the packed kernel and of dequantize + dense GEMM for x[M, k] . W^T (W: n packed rows)."""
    timings = {}
    gen = torch.Generator().manual_seed(0)
    for m in ROWS:
        if m * n * k > MAX_MACS:
            break
        x = torch.randn(m, k, generator=gen).to(dtype)
        out = torch.empty(m, n, dtype=dtype)
        timings[m] = tuple(best_of(lambda x=x, out=out, dense=dense: ops.qlinear(
            out, x, [weight], [qtype], [n], None, dense, act_bits)) for dense in (0, 1))
    return timings


def _largest_layers(model: torch.nn.Module) -> dict[tuple[int, int], tuple]:
    """Per main format and activation codes of the packed layers that follow the policy: (their
    methods, the layer with the most weights, the shard of that format)."""
    found: dict[tuple[int, int], tuple] = {}
    for layer in model.modules():
        method = getattr(layer, "method", None)
        if not isinstance(method, PackedLinearMethod) or getattr(layer, "q_views", None) is None:
            continue
        if not wants_measurement(method.fixed_dense_min_rows):
            continue
        qt = method.main_qtype
        methods, best, shard = found.get((qt, method.act_bits), (set(), None, None))
        methods.add(method)
        i = max((j for j, t in enumerate(method.qtypes) if t == qt), key=lambda j: layer.q_rows[j])
        if best is None or layer.q_rows[i] * layer.q_in > best.q_rows[shard] * best.q_in:
            best, shard = layer, i
        found[qt, method.act_bits] = (methods, best, shard)
    return found


def cache_key(qtype: int, act_bits: int, dtype: torch.dtype) -> str:
    from tokenmill.model.quant_kernels import library_path

    return f"{describe()}|{library_path().parent.name}|{BY_ID[qtype].name}|codes{act_bits}|{dtype}"


def choose_crossovers(model: torch.nn.Module, dtype: torch.dtype) -> dict[str, int]:
    """Measures (or reads back) the crossover of each format whose layers want it and sets it on
    them; returns "format, codes" (e.g. "Q4_K, 8-bit") -> rows (0: the packed kernel at every row count)."""
    from tokenmill import distributed
    from tokenmill.model.quant_kernels import quant_ops

    found = _largest_layers(model)
    st = distributed.state()
    if not found or st.tp_size > 1 or st.pp_size > 1:
        return {}
    ops = quant_ops()
    chosen = {}
    for (qt, bits), (methods, layer, shard) in found.items():
        name = BY_ID[qt].name
        key = cache_key(qt, bits, dtype)
        entry = VERDICTS.read().get(key)
        cached = isinstance(entry, dict) and isinstance(entry.get("rows"), int)
        if not cached:
            n = min(layer.q_rows[shard], SLICE_ROWS)  # whole 8-row groups: a valid weight on its own
            weight = layer.q_views[shard][: ops.x8_bytes(qt, n, layer.q_in)]
            t0 = time.perf_counter()
            timings = measure(ops, weight, qt, n, layer.q_in, bits, dtype)
            entry = {"rows": crossover_from(timings), "shape": [n, layer.q_in],
                     "ms": {m: [round(p * 1e3, 3), round(d * 1e3, 3)] for m, (p, d) in timings.items()},
                     "seconds": round(time.perf_counter() - t0, 2)}
            VERDICTS.put(key, entry)
        for method in methods:
            method.dense_min_rows = entry["rows"]
        chosen[f"{name}, {bits}-bit"] = entry["rows"]
        logger.info("%s products: %s (measured on this CPU, %d-bit codes, packed / dequantize + GEMM ms at %s%s)",
                    name, f"dequantize + GEMM from {entry['rows']} rows" if entry["rows"] else
                    "the packed kernel at every row count", bits,
                    ", ".join(f"{m} rows {p} / {d}" for m, (p, d) in entry["ms"].items()),
                    "; cached" if cached else f"; {entry['seconds']}s")
    return chosen

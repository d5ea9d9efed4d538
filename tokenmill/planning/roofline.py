"""The fallback cost model when no calibration profile fits: each term from the bytes it must move
and the FLOPs it must do, at the machine's measured bandwidth and GEMM FLOP/s.

It is optimistic by construction (kernels rarely reach the stream bandwidth, and the Python work
of an engine step is a guess: ~40 us per layer of op dispatch, ~50 us per sequence), so a
calibrated profile (`tokenmill calibrate`) should be preferred; `estimate` says which one it used.
"""

from __future__ import annotations

from tokenmill.planning.cost_model import KNOTS, StepCostModel
from tokenmill.planning.machine import MachineMeasurements
from tokenmill.planning.model_spec import ModelSpec

_SAMPLER_PASSES = 8  # full-vocabulary passes of temperature sampling (softmax, cumsum, compare, ...)
_ELEMENTWISE_PASSES = 4  # activation passes per layer and token outside the GEMMs (norms, rotary, SiLU)


def roofline_model(spec: ModelSpec, m: MachineMeasurements) -> StepCostModel:
    c = spec.config
    bw = m.bandwidth
    flops = m.flops.get(spec.dtype) or max(m.flops.values())
    lm_head_bytes = c.vocab_size * c.hidden_size * spec.dtype_bytes
    weights_read = (spec.linear_weight_bytes + lm_head_bytes) / bw
    elementwise = _ELEMENTWISE_PASSES * (c.hidden_size + c.intermediate_size) * spec.dtype_bytes * c.num_hidden_layers
    gemm = [max(weights_read, 2 * spec.linear_params * t / flops) + t * elementwise / bw for t in KNOTS]
    return StepCostModel(
        knots=list(KNOTS), gemm=gemm,
        per_seq=20e-6,
        per_decode_context=spec.kv_bytes_per_token / bw,
        per_prefill_pair=4 * c.num_attention_heads * c.head_dim * c.num_hidden_layers / flops,
        per_prefill_context=spec.kv_bytes_per_token / bw,
        per_sampled=2 * c.hidden_size * c.vocab_size / flops + _SAMPLER_PASSES * c.vocab_size * 4 / bw,
        per_sampled_greedy=2 * c.hidden_size * c.vocab_size / flops + c.vocab_size * 4 / bw,
        step_overhead=0.3e-3 + 40e-6 * c.num_hidden_layers,
        seq_overhead=50e-6,
        source="roofline",
    )

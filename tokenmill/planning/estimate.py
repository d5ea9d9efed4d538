"""The capacity planner behind `tokenmill estimate`: memory arithmetic, then closed-loop simulations
(the real scheduler in virtual time, steps timed by the cost model) at each concurrency.

Its per-concurrency numbers answer what `tokenmill bench serve --concurrency C` would measure with the
same workload flags, on this machine, with these engine flags.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tokenmill.config import EngineConfig, available_memory_bytes
from tokenmill.errors import ConfigError
from tokenmill.planning.profile import CostModelChoice
from tokenmill.planning.simulator import SimSettings
from tokenmill.planning.sweep import Workload, run_point
from tokenmill.worker.kv_budget import KVCapacity, kv_cache_budget, kv_capacity, resolve_max_model_len

SLO_ATTAINMENT = 0.99  # an SLO "holds" at a load when this share of requests meets every bound


@dataclass
class MemoryPlan:
    weight_bytes: int
    kv: KVCapacity
    max_model_len: int
    context_len: int  # the context max concurrency is computed at

    def to_dict(self) -> dict:
        return {"weight_bytes": self.weight_bytes, "kv_bytes_per_token": self.kv.bytes_per_token,
                "kv_budget_bytes": self.kv.budget, "block_size": self.kv.block_size,
                "num_blocks": self.kv.num_blocks, "kv_tokens": self.kv.num_tokens,
                "max_model_len": self.max_model_len, "context_len": self.context_len,
                "max_concurrency": self.kv.max_concurrency(self.context_len)}


def _physical_memory() -> int:
    import os

    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


def plan_memory(config: EngineConfig, spec, context_len: int | None = None, memory_budget: int | None = None
                ) -> MemoryPlan:
    """Weights, KV bytes per token and the blocks that fit, as the engine would size them. With
    `memory_budget` (weights + KV), the KV cache gets what the weights leave."""
    max_len = resolve_max_model_len(config, spec.config)
    if memory_budget is not None:
        budget = memory_budget - spec.weight_bytes
        if budget <= 0:
            raise ConfigError(f"impossible memory budget: {memory_budget / 2**30:.2f} GiB does not even hold the "
                              f"weights ({spec.weight_bytes / 2**30:.2f} GiB in {spec.dtype}, quantization "
                              f"{spec.quantization})")
    else:
        budget = kv_cache_budget(config.cache, spec.weight_bytes, available_memory_bytes())
    kv = kv_capacity(budget, spec.kv_bytes_per_token, config.cache.block_size, max_len)
    physical = _physical_memory()
    if physical and spec.weight_bytes + kv.budget > physical:
        raise ConfigError(f"impossible memory budget: weights ({spec.weight_bytes / 2**30:.2f} GiB) + KV cache "
                          f"({kv.budget / 2**30:.2f} GiB) exceed this machine's {physical / 2**30:.1f} GiB")
    ctx = min(context_len or max_len, max_len)
    return MemoryPlan(spec.weight_bytes, kv, max_len, ctx)


def sim_settings(config: EngineConfig, plan: MemoryPlan) -> SimSettings:
    return SimSettings(num_blocks=plan.kv.num_blocks, block_size=config.cache.block_size,
                       max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
                       max_num_seqs=config.scheduler.max_num_seqs,
                       enable_prefix_caching=config.cache.enable_prefix_caching, max_model_len=plan.max_model_len,
                       scheduling_policy=config.scheduler.scheduling_policy,
                       priority_aging=config.scheduler.priority_aging)


def point(cost: CostModelChoice, settings: SimSettings, workload: Workload, concurrency: int,
          slo: dict[str, float], price_per_hour: float | None) -> dict:
    """The numbers `bench serve --concurrency C` would report, predicted."""
    n = workload.num_prompts or max(100, 4 * concurrency)
    w = dataclasses.replace(workload, num_prompts=n)
    s = run_point(cost.model, settings, w, "concurrency", concurrency, workload.seed, slo)
    out = {"concurrency": concurrency, "output_tok_per_s": s["output_token_throughput"],
           "request_per_s": s["request_throughput"],
           "ttft_ms_p50": s["ttft_ms"]["median"], "ttft_ms_p99": s["ttft_ms"]["p99"],
           "tpot_ms_p50": s["tpot_ms"]["median"], "tpot_ms_p99": s["tpot_ms"]["p99"],
           "e2e_ms_p50": s["e2e_ms"]["median"], "num_preemptions": s["num_preemptions"]}
    if slo:
        out["goodput"] = s["goodput"]
        out["slo_attainment"] = s["slo_attainment"]
        out["meets_slo"] = s["slo_attainment"] >= SLO_ATTAINMENT
    if price_per_hour is not None:
        tok = s["output_token_throughput"]
        out["usd_per_1m_output_tokens"] = price_per_hour / (tok * 3600) * 1e6 if tok else None
    return out

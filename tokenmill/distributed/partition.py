"""How a layer's rows, heads and vocabulary are split over tensor-parallel ranks (no torch here).

Splits are contiguous and as even as possible; when sizes do not divide, the first ranks get one
more. Attention is split along whole KV-head groups so that each rank's query heads read only its own
KV heads; with fewer KV heads than ranks, every KV head is replicated on N / kv_heads ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.errors import ConfigError


def split_evenly(n: int, parts: int, index: int) -> tuple[int, int]:
    """(start, size) of part `index` of `n` items in `parts` contiguous parts."""
    base, extra = divmod(n, parts)
    start = index * base + min(index, extra)
    return start, base + (1 if index < extra else 0)


@dataclass(frozen=True)
class HeadShard:
    q_start: int
    num_heads: int
    kv_start: int
    num_kv_heads: int


def attention_heads(num_heads: int, num_kv_heads: int, tp_size: int, tp_rank: int) -> HeadShard:
    if num_heads % num_kv_heads:
        raise ConfigError(f"{num_heads} attention heads are not a multiple of {num_kv_heads} KV heads")
    group = num_heads // num_kv_heads
    if num_kv_heads >= tp_size:  # whole KV groups per rank (uneven when tp_size does not divide them)
        kv_start, kv_count = split_evenly(num_kv_heads, tp_size, tp_rank)
        return HeadShard(kv_start * group, kv_count * group, kv_start, kv_count)
    if tp_size % num_kv_heads or num_heads % tp_size:
        raise ConfigError(f"tensor_parallel_size={tp_size} cannot split {num_heads} heads with {num_kv_heads} KV "
                          f"heads: with fewer KV heads than ranks, the ranks must be a multiple of the KV heads and "
                          f"divide the heads", param="tensor_parallel_size")
    per_rank = num_heads // tp_size
    q_start = tp_rank * per_rank
    return HeadShard(q_start, per_rank, q_start // group, 1)


def total_kv_heads(num_heads: int, num_kv_heads: int, tp_size: int) -> int:
    """KV heads held over all ranks (more than the model's when they are replicated)."""
    return sum(attention_heads(num_heads, num_kv_heads, tp_size, r).num_kv_heads for r in range(tp_size))


def layer_stages(num_layers: int, pp_size: int, pp_rank: int) -> range:
    """Layers of pipeline stage `pp_rank`."""
    if pp_size > num_layers:
        raise ConfigError(f"pipeline_parallel_size={pp_size} exceeds the model's {num_layers} layers",
                          param="pipeline_parallel_size")
    start, size = split_evenly(num_layers, pp_size, pp_rank)
    return range(start, start + size)

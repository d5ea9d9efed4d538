"""How much memory the KV cache gets, and how many blocks that makes.

The worker sizes its cache with these after loading the weights; the capacity planner calls the same
functions with the weight bytes it computes, so both agree on blocks and concurrency. No torch here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from tokenmill.config import CacheConfig, EngineConfig
from tokenmill.errors import ConfigError
from tokenmill.model.model_config import ModelConfig

logger = logging.getLogger(__name__)

DEFAULT_KV_BYTES = 4 * 2**30
_MAX_DEFAULT_MODEL_LEN = 8192


def resolve_max_model_len(config: EngineConfig, model_config: ModelConfig) -> int:
    requested = config.model.max_model_len
    if requested is None:
        return min(model_config.max_position_embeddings, _MAX_DEFAULT_MODEL_LEN)
    if requested > model_config.max_position_embeddings and not model_config.rope_scaling:
        logger.warning("max_model_len %d exceeds the model's context %d", requested,
                       model_config.max_position_embeddings)
    return requested


def kv_cache_budget(cache: CacheConfig, weight_bytes: int, available: int,
                    device_total: int | None = None, device_free: int | None = None) -> int:
    """Bytes for the KV cache: --kv-cache-memory, else --memory-utilization of (on CPU) the available
    RAM plus the resident weights, else 4 GiB capped at half the available RAM. On a GPU, pass its
    total and free memory."""
    if cache.kv_cache_memory is not None:
        return cache.kv_cache_memory
    if device_total is not None:
        util = cache.memory_utilization or 0.9
        return int(device_total * util) - (device_total - device_free)
    if cache.memory_utilization is not None:
        # the fraction covers weights + KV; the weights are already resident
        return int((available + weight_bytes) * cache.memory_utilization) - weight_bytes
    return min(DEFAULT_KV_BYTES, available // 2)


@dataclass(frozen=True)
class KVCapacity:
    budget: int  # bytes
    bytes_per_token: int
    block_size: int
    num_blocks: int

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def max_concurrency(self, context_len: int) -> int:
        """Sequences of `context_len` tokens whose blocks fit at once."""
        return self.num_blocks // -(-context_len // self.block_size)


def kv_capacity(budget: int, bytes_per_token: int, block_size: int, max_model_len: int) -> KVCapacity:
    """Blocks that fit in `budget`; a ConfigError when not even one max_model_len sequence does."""
    num_blocks = max(budget, 0) // (block_size * bytes_per_token)
    capacity = KVCapacity(budget, bytes_per_token, block_size, num_blocks)
    if capacity.num_tokens < max_model_len:
        raise ConfigError(
            f"the KV cache budget ({budget / 2**20:.1f} MiB) holds {capacity.num_tokens} tokens, fewer than "
            f"max_model_len={max_model_len} ({bytes_per_token} bytes per token): raise "
            f"--kv-cache-memory / --memory-utilization or lower --max-model-len")
    return capacity

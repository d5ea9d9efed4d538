"""Configuration: the engine's groups (engine.py) and the server's settings (server.py)."""

from tokenmill.config.engine import (
    CacheConfig,
    EngineConfig,
    KernelConfig,
    ModelOptions,
    ParallelConfig,
    QuantizationConfig,
    SchedulerConfig,
)
from tokenmill.config.fields import available_memory_bytes, parse_size
from tokenmill.config.server import ServerConfig

__all__ = ["EngineConfig", "ModelOptions", "CacheConfig", "SchedulerConfig", "ParallelConfig", "QuantizationConfig",
           "KernelConfig", "ServerConfig", "parse_size", "available_memory_bytes"]

"""This machine: a fingerprint a calibration profile is tied to, and its measured memory bandwidth and
FLOP/s (what the roofline fallback needs). Measuring takes about a second; results are cached per
fingerprint under ~/.cache/tokenmill/profiles, unless other processes (or the hypervisor) used the
CPUs meanwhile: a figure measured on a busy machine is used once, not kept (a model loading beside
the measurement halved its FLOP/s, and `serve --slo` then refused every request)."""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass

from tokenmill.model.loader.cache import cache_root
from tokenmill.utils.timing import best_of

logger = logging.getLogger(__name__)


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def machine_fingerprint(device: str, num_threads: int) -> dict:
    """What a step's cost depends on besides the model: the CPU (its model, the ISA level tokenmill
    uses, its cores), the memory, the device and the threads the engine runs."""
    from tokenmill.utils.cpu import active_isa

    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        mem = 0
    return {"cpu": cpu_model(), "isa": active_isa(), "cores": os.cpu_count() or 1,
            "memory_gib": round(mem / 2**30), "device": device, "num_threads": num_threads}


def machine_of(config) -> dict:
    """The fingerprint of this machine as an engine of `config` runs on it (threads and ranks)."""
    from tokenmill.utils.cpu import default_num_threads

    p = config.parallel
    fingerprint = machine_fingerprint(config.model.torch_device.type, p.num_threads or default_num_threads())
    if p.world_size > 1:  # absent for one rank, as in profiles written before ranks were recorded
        fingerprint["ranks"] = f"tp{p.tensor_parallel_size}-pp{p.pipeline_parallel_size}"
    return fingerprint


@dataclass
class MachineMeasurements:
    bandwidth: float  # bytes/s, streaming reads with the engine's threads
    flops: dict[str, float]  # FLOP/s of a mid-sized GEMM per dtype name

    def to_dict(self) -> dict:
        return asdict(self)


def measure(dtypes=("float32", "bfloat16")) -> MachineMeasurements:
    import torch

    x = torch.ones(64 * 2**20, dtype=torch.float32)  # 256 MiB, far beyond the caches
    bandwidth = x.numel() * 4 / best_of(x.sum, 5)
    del x
    flops = {}
    m, k, n = 256, 2048, 2048
    for name in dtypes:
        dt = getattr(torch, name)
        a, b = torch.randn(m, k).to(dt), torch.randn(n, k).to(dt)
        flops[name] = 2 * m * k * n / best_of(lambda a=a, b=b: torch.nn.functional.linear(a, b), 5)
    return MachineMeasurements(bandwidth, flops)


def machine_measurements(fingerprint: dict) -> MachineMeasurements:
    """Measured once per machine fingerprint, then read from the cache."""
    import hashlib

    key = hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()[:16]
    path = cache_root() / "profiles" / f"machine-{key}.json"
    try:
        d = json.loads(path.read_text())
        if d.get("format") == _FORMAT:
            return MachineMeasurements(float(d["bandwidth"]), {k: float(v) for k, v in d["flops"].items()})
    except (OSError, ValueError, KeyError, TypeError):
        pass
    import torch

    torch.set_num_threads(fingerprint["num_threads"])
    before, own, t0 = _cpu_busy_seconds(), os.times(), time.monotonic()
    m = measure()
    others = _cpu_busy_seconds() - before - (sum(os.times()[:2]) - sum(own[:2]))
    if others > _BUSY_FRACTION * (time.monotonic() - t0):
        logger.warning("other processes used %.1f s of CPU during the %.1f s of measuring this machine: using "
                       "the figures now, not caching them", others, time.monotonic() - t0)
        return m
    logger.info("measured this machine: %.1f GB/s read bandwidth, %s", m.bandwidth / 1e9,
                ", ".join(f"{k} {v / 1e12:.2f} TFLOP/s" for k, v in m.flops.items()))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**m.to_dict(), "machine": fingerprint, "format": _FORMAT}, indent=1))
    return m


_FORMAT = 2  # 2: cached only when measured on an idle machine (older files are measured again)
_BUSY_FRACTION = 0.25  # of one core, over the measurement: more from others and it is not cached


def _cpu_busy_seconds() -> float:
    """CPU seconds every process (and the hypervisor's steal) has used since boot, from /proc/stat;
    0 where it cannot be read (then nothing counts as busy)."""
    try:
        with open("/proc/stat") as f:
            user, nice, system, _idle, _iowait, irq, softirq, steal = (
                [int(v) for v in f.readline().split()[1:9]] + [0] * 8)[:8]
    except (OSError, ValueError):
        return 0.0
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")

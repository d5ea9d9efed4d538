"""Weight formats the quantized kernels read (see csrc/quant_blocks.h): GGUF's block types, kept
as they are in the file, and tokenmill's own for `--quantization int8|int4` (quantized at load,
round-to-nearest). Also: corrupt-block checks, and random blocks for tests."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tokenmill.errors import ConfigError
from tokenmill.model.layers.quantization.int4_search import fit_groups


@dataclass(frozen=True)
class Format:
    name: str
    id: int  # ggml's type id (tokenmill's own: 100+)
    block: int  # weights per block
    bytes: int  # bytes per block
    fp16_fields: tuple[int, ...]  # byte offsets of fp16 scales inside a block
    row_head: int = 0  # bytes before a row's first block (I8_ROW: its float32 scale)


FORMATS = {f.name: f for f in [
    Format("Q4_0", 2, 32, 18, (0,)),
    Format("Q4_1", 3, 32, 20, (0, 2)),
    Format("Q5_0", 6, 32, 22, (0,)),
    Format("Q5_1", 7, 32, 24, (0, 2)),
    Format("Q8_0", 8, 32, 34, (0,)),
    Format("Q4_K", 12, 256, 144, (0, 2)),
    Format("Q5_K", 13, 256, 176, (0, 2)),
    Format("Q6_K", 14, 256, 210, (208,)),
    Format("I8_ROW", 100, 32, 32, (), row_head=4),
    Format("I4_G128", 101, 128, 68, (0, 2)),
]}
BY_ID = {f.id: f for f in FORMATS.values()}


def row_bytes(qtype: int, k: int) -> int:
    f = BY_ID[qtype]
    return f.row_head + k // f.block * f.bytes


def check_blocks(name: str, data: np.ndarray, qtype: int) -> None:
    """Raise ConfigError when a block's scale is not a finite number (a corrupt or truncated file)."""
    f = BY_ID[qtype]
    blocks = data.reshape(-1)[: data.size // f.bytes * f.bytes].reshape(-1, f.bytes) if not f.row_head else None
    for off in f.fp16_fields:
        scales = np.ascontiguousarray(blocks[:, off:off + 2]).view(np.float16).reshape(-1)
        bad = ~np.isfinite(scales)
        if bad.any():
            raise ConfigError(f"GGUF tensor {name!r} is corrupt: block {int(np.argmax(bad))} of {len(scales)} has a "
                              f"non-finite scale ({scales[bad][0]}); re-download or re-convert the file")


def _fp16_bytes(values: np.ndarray) -> np.ndarray:
    return values.astype(np.float16).view(np.uint8).reshape(*values.shape, 2)


def quantize_i8_row(w: torch.Tensor) -> torch.Tensor:
    """Per-output-channel symmetric int8: each row is [float32 scale][K int8]."""
    w = w.float()
    scale = w.abs().amax(1, keepdim=True) / 127.0
    q = torch.where(scale > 0, torch.round(w / scale.clamp_min(1e-30)), torch.zeros(())).clamp(-127, 127)
    out = torch.empty(w.shape[0], 4 + w.shape[1], dtype=torch.uint8)
    out[:, :4] = scale.view(torch.uint8).view(-1, 4)
    out[:, 4:] = q.to(torch.int8).view(torch.uint8)
    return out


def quantize_q4_groups(w: torch.Tensor, group: int, round_to_nearest: bool = False,
                       input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Asymmetric int4 per group of 32 (exactly GGUF's Q4_1) or 128 (I4_G128): fp16 scale d and
    minimum m per group, w ~ d * q + m with q in 0..15: HQQ's zero-point optimisation,
    weighted by input_scale (one per input column) if given (int4_search.py), or min/max
    round-to-nearest."""
    n, k = w.shape
    g = w.float().view(n, k // group, group)
    if not round_to_nearest:
        d, m, q = fit_groups(g, input_scale)
        d, m = d.half(), m.half()
    else:
        lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
        d = ((hi - lo) / 15.0).half()
        m = lo.half()
        df = d.float()
        q = torch.where(df > 0, torch.round((g - m.float()) / df.clamp_min(1e-30)), torch.zeros(())).clamp(0, 15)
    q = q.to(torch.uint8).view(n, k // group, group // 32, 2, 16)  # chunks of 32: [lo 16 | hi 16]
    nibbles = (q[:, :, :, 0] | (q[:, :, :, 1] << 4)).reshape(n, k // group, group // 2)
    head = torch.cat([d.view(torch.uint8).view(n, k // group, 2), m.view(torch.uint8).view(n, k // group, 2)], -1)
    return torch.cat([head, nibbles], -1).reshape(n, -1).contiguous()


def dequantize_own(name: str, data: np.ndarray, k: int) -> torch.Tensor:
    """Reference dequantization of tokenmill's own formats (rows of packed bytes -> float32)."""
    rows = data.shape[0]
    if name == "I8_ROW":
        scale = data[:, :4].copy().view(np.float32)
        return torch.from_numpy(data[:, 4:].copy().view(np.int8).astype(np.float32) * scale)
    blocks = data.reshape(rows, k // 128, 68)
    d = blocks[..., 0:2].copy().view(np.float16).astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16).astype(np.float32)
    nib = blocks[..., 4:].reshape(rows, k // 128, 4, 16)
    q = np.concatenate([nib & 0xF, nib >> 4], -1).reshape(rows, k // 128, 128).astype(np.float32)
    return torch.from_numpy((q * d + m).reshape(rows, k))


def random_blocks(name: str, rows: int, k: int, rng: np.random.Generator, scale: float = 0.01,
                  extremes: bool = True) -> np.ndarray:
    """Random packed rows of a format, for tests: random quant bits, scales of ordinary size (normal,
    times `scale`) plus, with `extremes`, the extremes (fp16 max, a subnormal, zero) and an all-zero
    row; without them, rows a model can run on."""
    f = FORMATS[name]
    data = rng.integers(0, 256, size=(rows, row_bytes(f.id, k)), dtype=np.uint8)
    special = np.array([65504.0, 6e-8, 0.0, -3.0] if extremes else [], dtype=np.float32)
    if f.row_head:
        scales = (rng.standard_normal(rows) * scale).astype(np.float32)
        scales[: len(special)] = special[: rows]
        data[:, :4] = scales.view(np.uint8).reshape(rows, 4)
    else:
        blocks = data.reshape(rows, -1, f.bytes)
        for off in f.fp16_fields:
            vals = (rng.standard_normal(blocks.shape[:2]) * scale).astype(np.float32)
            vals.reshape(-1)[: len(special)] = special
            blocks[..., off:off + 2] = _fp16_bytes(vals)
    if extremes:
        data[min(1, rows - 1)] = 0
    return data


def to_tensor(data: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(data))


def require_divisible(k: int, block: int, what: str) -> None:
    if k % block:
        raise ConfigError(f"{what}: input size {k} is not a multiple of the block size {block}")

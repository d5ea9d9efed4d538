"""GGUF types without a kernel of their own, rewritten at load as Q8_0 blocks (a scale and 32 int8
codes), which every ISA path reads: the weights stay packed (8.5 bits each) instead of being
dequantized to the model dtype (16 or 32 bits).

- Q3_K: weight = d * (s - 32) * (q - 4), a super-block scale d, a 6-bit scale s per 16 weights and
  3-bit q. The code (s - 32)(q - 4) lies in -124..128, so a Q8_0 block of two sub-blocks holds it
  with d as its scale, negated (d -> -d, codes -> -codes) where a code reaches +128: exactly the
  same weights.
- IQ4_NL: weight = d * table[q] with table entries in -127..113: the table's entry is the code,
  exactly.
- IQ4_XS: weight = d * (s - 32) * table[q] per 32 weights: the code is the table's entry and the
  scale d * (s - 32) is rounded to fp16 (relative error at most 2^-11, against the 4-bit format's
  own error of several percent). Not bit-exact, so it is logged as such.
Q2_K (two scales a sub-block, d and dmin) and the grid-based IQ types fit no existing format and
are dequantized at load."""

from __future__ import annotations

import numpy as np

Q8_0, Q3_K, IQ4_NL, IQ4_XS = 8, 11, 20, 23
REPACKED = {Q3_K: Q8_0, IQ4_NL: Q8_0, IQ4_XS: Q8_0}  # ggml type in the file -> the kernels' type
EXACT = {Q3_K, IQ4_NL}
IQ4_TABLE = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)
_BLOCK = {Q3_K: (256, 110), IQ4_NL: (32, 18), IQ4_XS: (256, 136)}  # weights, bytes


def kernel_type(qtype: int | None) -> int | None:
    return REPACKED.get(qtype, qtype)


def _fp16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16)[..., 0].astype(np.float32)


def _q8_0_rows(rows: int, scales: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """scales [rows, blocks] (float32, exact in fp16 or rounded to it), codes [rows, blocks, 32]."""
    out = np.empty((rows, scales.shape[1], 34), dtype=np.uint8)
    out[..., :2] = scales.astype(np.float16)[..., None].view(np.uint8)
    out[..., 2:] = codes.astype(np.int8).view(np.uint8)
    return out.reshape(rows, -1)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., 16] bytes -> [..., 32] indices: low nibbles first, then high (ggml's order)."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=-1)


def _q3_k(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    n = blocks.shape[0]
    hmask, qs, sc, d = blocks[:, :32], blocks[:, 32:96], blocks[:, 96:108], _fp16(blocks[:, 108:110])
    # 16 six-bit scales: low nibbles of bytes 0..7 then their high nibbles; 2 high bits from bytes 8..11
    low = np.concatenate([sc[:, :8] & 0x0F, sc[:, :8] >> 4], axis=1)
    high = (sc[:, 8:12][:, None, :] >> (2 * np.arange(4, dtype=np.uint8))[None, :, None]).reshape(n, 16) & 3
    s = (low | (high << 4)).astype(np.int16) - 32
    # weight (half h, pair j, lane i) = 2 bits of qs[h*32 + i] at 2j, the high bit of hmask[i] at h*4 + j
    lo = (qs.reshape(n, 2, 1, 32) >> (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]) & 3
    hi = (hmask.reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8)[None, :, None]).reshape(n, 2, 4, 32) & 1
    q = (lo.astype(np.int16) - 4 * (1 - hi.astype(np.int16))).reshape(n, 16, 16)
    codes = (s[:, :, None] * q).reshape(n, 8, 32)  # one Q8_0 block per two 16-weight sub-blocks
    flip = (codes > 127).any(-1)
    codes = np.where(flip[..., None], -codes, codes)
    scales = np.where(flip, -d[:, None], d[:, None])
    return scales, codes


def _iq4_nl(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return _fp16(blocks[:, :2])[:, None], IQ4_TABLE[_nibbles(blocks[:, 2:18])][:, None, :]


def _iq4_xs(blocks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    n = blocks.shape[0]
    d = _fp16(blocks[:, :2])
    high = np.ascontiguousarray(blocks[:, 2:4]).view(np.uint16)[:, 0]
    low = np.stack([blocks[:, 4:8] & 0x0F, blocks[:, 4:8] >> 4], axis=-1).reshape(n, 8)
    s = (low | (((high[:, None] >> (2 * np.arange(8, dtype=np.uint16))) & 3) << 4)).astype(np.int16) - 32
    codes = IQ4_TABLE[_nibbles(blocks[:, 8:].reshape(n, 8, 16))]
    return d[:, None] * s, codes


_REPACK = {Q3_K: _q3_k, IQ4_NL: _iq4_nl, IQ4_XS: _iq4_xs}


def repack_rows(raw: np.ndarray, qtype: int, chunk_weights: int = 1 << 22) -> np.ndarray:
    """Rows of a file's blocks ([rows, bytes]) -> the same rows as Q8_0 blocks, a few million
    weights at a time (the int16 intermediates of a whole embedding would take gigabytes)."""
    (weights, size), rows = _BLOCK[qtype], raw.shape[0]
    weights_per_row = raw.shape[1] // size * weights
    out = np.empty((rows, weights_per_row // 32 * 34), dtype=np.uint8)
    step = max(1, chunk_weights // weights_per_row)
    for r in range(0, rows, step):
        part = raw[r:r + step]
        scales, codes = _REPACK[qtype](np.ascontiguousarray(part).reshape(-1, size))
        out[r:r + step] = _q8_0_rows(part.shape[0], scales.reshape(part.shape[0], -1),
                                     codes.reshape(part.shape[0], -1, 32))
    return out

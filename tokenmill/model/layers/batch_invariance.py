"""Batch-invariant GEMMs: every row of a result computed as if it were alone in the batch.

oneDNN picks its GEMM kernel (and so the order of a row's sums) by the shape. Measured: on AMX
every row of a <= 32-row bf16 GEMM comes out as if computed alone; on AVX512-BF16 without AMX a
single row takes another kernel than 2..64 rows. So batch-invariant mode runs GEMMs in tiles of
at most 32 rows and never a single row (a lone row is run as two). Whether that holds for a given
weight on this machine is checked at start-up (`verify_row_invariance`), not assumed.
"""

from __future__ import annotations

import torch

from tokenmill.errors import ConfigError

ROW_TILE = 32


def in_row_tiles(fn, x: torch.Tensor, tile: int | None) -> torch.Tensor:
    """fn(x), computed `tile` rows at a time, a lone row as two equal rows."""
    if tile is None:
        return fn(x)
    outs = []
    for i in range(0, x.shape[0], tile):
        part = x[i:i + tile]
        outs.append(fn(part.repeat(2, 1))[:1] if part.shape[0] == 1 else fn(part))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


@torch.inference_mode()
def verify_row_invariance(model: torch.nn.Module, tile: int = ROW_TILE) -> None:
    """Run each distinct GEMM shape of the model on random rows in every tile size it can meet
    (1..tile rows) and check each row equals the row computed alone. Kernel choice depends on
    shapes, not values, so this covers every input. Raises ConfigError where it does not hold."""
    seen = set()
    for name, module in model.named_modules():
        if getattr(module, "row_tile", None) is None or not hasattr(module, "_matmul"):
            continue
        method = getattr(module, "method", None)  # a quantized weight's kernel depends on its formats
        key = (module.in_features, module.out_features, type(module).__name__, type(method).__name__,
               tuple(getattr(method, "qtypes", ())))
        if key in seen:
            continue
        seen.add(key)
        dtype = module.dtype  # of activations (a quantized weight is stored in bytes)
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(tile + 1, module.in_features, generator=gen).to(dtype)
        alone = torch.cat([in_row_tiles(module._matmul, x[i:i + 1], tile) for i in range(tile + 1)])
        for m in range(2, tile + 2):
            if not torch.equal(in_row_tiles(module._matmul, x[:m], tile), alone[:m]):
                raise ConfigError(
                    f"batch_invariant is not available on this CPU: the {dtype} GEMM of {name} "
                    f"({module.in_features}x{module.out_features}) gives a row a different result among {m} "
                    f"rows than alone (oneDNN picks another kernel). Run without --batch-invariant"
                    f"{'' if dtype == torch.float32 else ', or in float32'}.", param="batch_invariant")

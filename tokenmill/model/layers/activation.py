from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """SwiGLU: the first half of the last dim is the gate, the second half the up projection."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up

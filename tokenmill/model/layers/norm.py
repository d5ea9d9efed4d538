"""RMSNorm with an optional fused residual add (the residual stream is carried in the model dtype)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.model.layers.linear import default_weight_loader


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype, device=device), requires_grad=False)
        self.weight.weight_loader = default_weight_loader

    fused = False  # set by the model when tokenmill's CPU kernels are in use

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if self.fused:
            out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
            torch.ops.tokenmill.rms_norm(out, x, residual, self.weight, self.eps)  # residual += x, in place
            return out if residual is None else (out, residual)
        if residual is not None:
            x = x + residual
            residual = x
        if x.dtype == torch.float32:
            out = F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        else:
            # Normalize in fp32, round, then scale: the order Hugging Face uses.
            xf = x.float()
            xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
            out = self.weight * xf.to(x.dtype)
        return out if residual is None else (out, residual)

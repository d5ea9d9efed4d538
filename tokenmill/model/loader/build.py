"""Building a model from its source and streaming the weights into it (the worker's side of loading;
the package's own functions read only metadata and stay free of torch, for the server's front end)."""

from __future__ import annotations

import torch
from tqdm import tqdm

from tokenmill.model.layers.quantization.base import QuantConfig
from tokenmill.model.loader import gguf_loader, hf_loader
from tokenmill.model.loader.source import ModelSource
from tokenmill.model.model_config import ModelConfig
from tokenmill.model.registry import get_model_class


def build_model(source: ModelSource, cfg: ModelConfig, attn_backend, max_position: int,
                dtype: torch.dtype, device: torch.device, progress: bool = True,
                quant_config: QuantConfig | None = None) -> torch.nn.Module:
    model_cls = get_model_class(cfg.architecture)
    with torch.device(device):
        model = model_cls(cfg, attn_backend, max_position, dtype=dtype, device=device, quant_config=quant_config)
    if source.kind == "gguf":
        packed = quant_config.packed_tensors() if quant_config is not None else set()
        keep = getattr(model, "loads_tensor", None)  # pipeline stages skip the others' tensors unread
        weights = gguf_loader.iter_weights(source.path, cfg, dtype, packed, keep)
        total = None
    else:
        weights = hf_loader.iter_weights(source.path, dtype)
        total = hf_loader.count_tensors(source.path)
    bar = tqdm(weights, total=total, desc=f"Loading {source.name}", unit=" tensors",
               disable=not progress, leave=False)
    model.load_weights(bar)  # each parameter's loader reads its rank's part and copies it to the device
    if quant_config is not None:
        quant_config.before_processing(model, source)
    for module in model.modules():
        if hasattr(module, "process_weights_after_loading"):
            module.process_weights_after_loading()
    if quant_config is not None:
        quant_config.after_processing(model, source, dtype)
    model.weight_bytes = resident_weight_bytes(model)
    return model.eval()


def resident_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of every weight the model keeps: parameters (shared ones once) and oneDNN-packed copies."""
    seen, total = set(), 0
    for t in [*model.parameters(), *(m.packed_weight for m in model.modules()
                                     if getattr(m, "packed_weight", None) is not None)]:
        key = (t.data_ptr(), t.numel()) if t.layout == torch.strided else id(t)
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    for m in model.modules():
        method = getattr(m, "method", None)
        if method is not None:
            total += method.extra_bytes(m)
    return total

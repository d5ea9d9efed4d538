"""The Hugging Face transformers baseline model, with dense weights.

transformers >= 5 keeps GGUF weights quantized and dequantizes inside every matmul (in fp32), which
is slower than what a user with a plain checkpoint gets. So the baseline builds the model from the
GGUF's config and loads the same dequantized tensors tokenmill uses, as ordinary dense weights:
transformers' own modeling code at its best, on the same numbers.
"""

from __future__ import annotations

import torch


def load_hf_model(dtype: torch.dtype, model: str | None = None):
    from transformers import AutoConfig, AutoModelForCausalLM

    from tokenmill.model.loader import load_model_config, resolve_model
    from tokenmill.model.loader.gguf_loader import iter_weights

    source = resolve_model(model)
    if source.kind != "gguf":
        return AutoModelForCausalLM.from_pretrained(str(source.path), dtype=dtype).eval()
    config = AutoConfig.from_pretrained(str(source.path.parent), gguf_file=source.path.name)
    config.quantization_config = None
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    hf = AutoModelForCausalLM.from_config(config, dtype=dtype)
    state = dict(iter_weights(source.path, load_model_config(source), dtype))
    missing, unexpected = hf.load_state_dict(state, strict=False)
    if unexpected or [m for m in missing if "lm_head" not in m]:
        raise RuntimeError(f"weights do not fit the HF model: missing {missing[:4]}, unexpected {unexpected[:4]}")
    hf.tie_weights()
    return hf.eval()

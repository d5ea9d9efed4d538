"""Rotary scaling variants match transformers' own inverse-frequency computations."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from tokenmill.errors import ConfigError
from tokenmill.model.layers.rotary import compute_inv_freq

SCALINGS = [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096},
    {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 2048, "beta_fast": 16, "beta_slow": 2},
]


@pytest.mark.parametrize("scaling", SCALINGS, ids=lambda s: f"{s['rope_type']}-{s['factor']}")
def test_inv_freq_matches_transformers(scaling):
    cfg = LlamaConfig(hidden_size=512, num_attention_heads=4, max_position_embeddings=32768,
                      rope_parameters={"rope_theta": 500000.0, **scaling})
    ref, ref_scale = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](cfg, torch.device("cpu"))
    ours, scale = compute_inv_freq(128, 500000.0, scaling)
    torch.testing.assert_close(ours, ref.float(), rtol=1e-6, atol=0)
    assert scale == pytest.approx(ref_scale)


def test_unknown_scaling_is_a_clear_error():
    with pytest.raises(ConfigError, match="longrope"):
        compute_inv_freq(64, 10000.0, {"rope_type": "longrope", "factor": 2.0})

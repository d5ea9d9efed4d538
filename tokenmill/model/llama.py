"""Llama-family decoder (SmolLM2, Llama 2/3, Mistral-style) over a flat, paged batch.

Also the base of Qwen2, which differs only in a bias on the q/k/v projections.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from tokenmill import distributed
from tokenmill.distributed.partition import attention_heads, layer_stages, split_evenly
from tokenmill.errors import ConfigError
from tokenmill.model.attention import AttentionBackend, AttentionMetadata
from tokenmill.model.fused_decode import FusedDecode
from tokenmill.model.layers.activation import silu_and_mul
from tokenmill.model.layers.embedding import LMHead, VocabEmbedding
from tokenmill.model.layers.linear import Linear, MergedLinear, QKVLinear, default_weight_loader
from tokenmill.model.layers.norm import RMSNorm
from tokenmill.model.layers.quantization.base import QuantConfig
from tokenmill.model.layers.rotary import RotaryEmbedding, apply_rotary
from tokenmill.model.model_config import ModelConfig


class Attention(nn.Module):
    """This rank's heads (all of them without tensor parallelism): qkv column-parallel, o_proj
    row-parallel (its all-reduce is the block's one)."""

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, dtype, device, quant=None, prefix=""):
        super().__init__()
        st = distributed.state()
        heads = attention_heads(cfg.num_attention_heads, cfg.num_key_value_heads, st.tp_size, st.tp_rank)
        self.num_heads, self.num_kv_heads, self.head_dim = heads.num_heads, heads.num_kv_heads, cfg.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = QKVLinear(cfg.hidden_size, self.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads,
                                  bias=cfg.attention_bias, dtype=dtype, device=device, quant_config=quant,
                                  prefix=prefix, heads=heads)
        self.o_proj = Linear(cfg.num_attention_heads * self.head_dim, cfg.hidden_size, dtype=dtype, device=device,
                             quant_config=quant, prefix=f"{prefix}.o_proj", parallel="row",
                             in_range=(heads.q_start * self.head_dim, heads.num_heads * self.head_dim))
        self.backend = backend
        self.kv_cache: torch.Tensor | None = None  # bound by the model runner
        self.fused = False  # tokenmill's CPU kernels in use

    def forward(self, x, rope, meta: AttentionMetadata):
        t = x.shape[0]
        qkv = self.qkv_proj(x)
        q_size, kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        q = qkv[:, :q_size].view(t, self.num_heads, self.head_dim)
        k = qkv[:, q_size:q_size + kv_size].view(t, self.num_kv_heads, self.head_dim)
        v = qkv[:, q_size + kv_size:].view(t, self.num_kv_heads, self.head_dim)
        if self.fused:  # rotate q and k in place, inside the qkv buffer
            torch.ops.tokenmill.rotary_embedding(q, k, *rope)
        else:
            q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        out = self.backend.forward(q, k, v, self.kv_cache, meta, self.scale)
        return self.o_proj(out)


class MLP(nn.Module):
    """gate+up column-parallel, down row-parallel (its all-reduce is the MLP's one)."""

    def __init__(self, cfg: ModelConfig, dtype, device, quant=None, prefix=""):
        super().__init__()
        st = distributed.state()
        start, i = split_evenly(cfg.intermediate_size, st.tp_size, st.tp_rank)
        self.intermediate_size = i
        self.gate_up_proj = MergedLinear(cfg.hidden_size, {0: i, 1: i}, dtype=dtype, device=device, quant_config=quant,
                                         shard_names={0: f"{prefix}.gate_proj", 1: f"{prefix}.up_proj"},
                                         row_ranges={0: (start, i), 1: (start, i)})
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, dtype=dtype, device=device,
                                quant_config=quant, prefix=f"{prefix}.down_proj", parallel="row", in_range=(start, i))
        self.fused = False  # tokenmill's CPU kernels in use

    def forward(self, x):
        gate_up = self.gate_up_proj(x)
        if self.fused:
            out = torch.empty(gate_up.shape[0], gate_up.shape[1] // 2, dtype=x.dtype, device=x.device)
            torch.ops.tokenmill.silu_and_mul(out, gate_up)
            return self.down_proj(out)
        return self.down_proj(silu_and_mul(gate_up))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend, dtype, device, quant=None, prefix=""):
        super().__init__()
        self.self_attn = Attention(cfg, backend, dtype, device, quant, f"{prefix}.self_attn")
        self.mlp = MLP(cfg, dtype, device, quant, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)

    def forward(self, x, residual, rope, meta):
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, rope, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class StageMissingLayer(nn.Module):
    """A layer another pipeline stage holds (keeps the checkpoint's layer numbering)."""


class LlamaModel(nn.Module):
    """This pipeline stage's layers (all of them with one stage); the first stage embeds, the last
    one normalizes. Between stages travel the hidden states and the residual."""

    def __init__(self, cfg: ModelConfig, backend, max_position: int, dtype, device, quant=None):
        super().__init__()
        st = distributed.state()
        self.stage_layers = layer_stages(cfg.num_hidden_layers, st.pp_size, st.pp_rank)
        self.is_first, self.is_last = st.is_first_stage, st.is_last_stage
        self.embed_tokens = VocabEmbedding(cfg.vocab_size, cfg.hidden_size, dtype, device, quant) if self.is_first \
            else None
        self.layers = nn.ModuleList(DecoderLayer(cfg, backend, dtype, device, quant, f"model.layers.{i}")
                                    if i in self.stage_layers else StageMissingLayer()
                                    for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device) if self.is_last else None
        self.rotary = RotaryEmbedding(cfg.head_dim, max_position, cfg.rope_theta, cfg.rope_scaling, device)
        self.fused = False
        self.fused_decode: FusedDecode | None = None

    def forward(self, input_ids, positions, meta, intermediate=None):
        """`intermediate`: (hidden, residual) from the previous stage. Returns the final hidden
        states on the last stage, else (hidden, residual) for the next."""
        x, residual = (self.embed_tokens(input_ids), None) if intermediate is None else intermediate
        # the fused kernel reads the fp32 tables by position; the portable path gets per-token rows
        rope = (self.rotary.cos, self.rotary.sin, positions) if self.fused else self.rotary.lookup(positions, x.dtype)
        fused = self.fused_layers() if self.fused else None
        if fused is not None and fused.applies(x, meta):
            x, residual = fused(x, residual, rope, meta)
        else:
            for i in self.stage_layers:
                x, residual = self.layers[i](x, residual, rope, meta)
        if not self.is_last:
            return x, residual
        x, _ = self.norm(x, residual)
        return x

    def fused_layers(self) -> FusedDecode:
        """Decode-only steps in one C++ call (fused_decode.py), set up at first use."""
        if self.fused_decode is None or self.fused_decode.stale():
            layers = [self.layers[i] for i in self.stage_layers]
            self.fused_decode = FusedDecode(layers, layers[0].self_attn.backend if layers else None)
        return self.fused_decode


class LlamaForCausalLM(nn.Module):
    # checkpoint projection name -> (our merged parameter, shard id)
    stacked_params = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
                      "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, cfg: ModelConfig, backend: AttentionBackend, max_position: int,
                 dtype: torch.dtype = torch.float32, device=None, quant_config: QuantConfig | None = None):
        super().__init__()
        self.config, self.dtype = cfg, dtype
        self.model = LlamaModel(cfg, backend, max_position, dtype, device, quant_config)
        # a tied head on another stage than the embedding reads the embedding's tensor (and format)
        head_name = "model.embed_tokens" if cfg.tie_word_embeddings and not self.model.is_first else "lm_head"
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, dtype, device, quant_config, head_name) \
            if self.model.is_last else None
        if cfg.tie_word_embeddings and self.model.is_first and self.model.is_last:
            self.lm_head.tie(self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                intermediate=None):
        return self.model(input_ids, positions, meta, intermediate)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def kv_caches(self) -> list:
        return [self.model.layers[i].self_attn for i in self.model.stage_layers]

    def set_row_tile(self, tile: int) -> None:
        """Batch-invariant GEMMs (see layers.batch_invariance)."""
        for module in self.modules():
            if hasattr(module, "row_tile"):
                module.row_tile = tile

    def use_cpu_kernels(self) -> bool:
        """Switch norms, SiLU-and-mul and rotary to tokenmill's fused CPU kernels where the shapes
        allow (row sizes a multiple of 32, head_dim a multiple of 64). Returns whether it did."""
        cfg = self.config
        local_mlp = [m.intermediate_size for m in self.modules() if isinstance(m, MLP)]
        if cfg.hidden_size % 32 or any(i % 32 for i in local_mlp) or cfg.head_dim % 64:
            return False
        for module in self.modules():
            if hasattr(module, "fused"):
                module.fused = True
        return True

    def _stage_name(self, name: str) -> str | None:
        """The parameter a checkpoint tensor loads into on this stage (None: another stage's)."""
        parts, m = name.split("."), self.model
        if name.startswith("model.layers."):
            return name if int(parts[2]) in m.stage_layers else None
        if name.startswith("model.embed_tokens."):
            if m.is_first:
                return name
            # a tied head on another stage than the embedding loads its own copy of the table
            return "lm_head." + parts[-1] if m.is_last and self.config.tie_word_embeddings else None
        if name.startswith("model.norm.") or name.startswith("lm_head."):
            return name if m.is_last else None
        return name

    def loads_tensor(self, name: str) -> bool:
        return self._stage_name(name) is not None

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or (self.config.tie_word_embeddings and name == "lm_head.weight"):
                continue
            name = self._stage_name(name)
            if name is None:
                continue
            shard = None
            parts = name.split(".")
            if len(parts) >= 2 and parts[-2] in self.stacked_params:
                merged, shard = self.stacked_params[parts[-2]]
                parts[-2] = merged
                name = ".".join(parts)
            param = params.get(name)
            if param is None:
                raise ConfigError(f"checkpoint tensor {name!r} has no parameter in {type(self).__name__}")
            loader = getattr(param, "weight_loader", default_weight_loader)
            loader(param, tensor, shard)  # the loader takes its rank's part, then converts
            loaded.add(name)
        missing = set(params) - loaded
        if self.config.tie_word_embeddings and self.model.is_first:
            missing.discard("lm_head.weight")
        if missing:
            raise ConfigError(f"checkpoint lacks weights for: {', '.join(sorted(missing)[:8])}")

"""Qwen3_5ForCausalLM: Qwen3.5's text model (qwen3_5_text; the text tower of qwen3_5):
Gated DeltaNet layers (model/gated_deltanet.py) beside gated full attention
(`layer_types`: linear_attention / full_attention; three of every four are linear).

Where its full attention departs from Qwen3's: q_proj also yields a per-head output gate
(interleaved per head: q then gate), the output is multiplied by sigmoid(gate); RoPE turns
only the first partial_rotary_factor of each head (text positions: the same angles on all
three mRoPE sections). Every RMSNorm but the DeltaNet's gated one multiplies by (1 + weight)
(held here as 1 + weight, added once at load). The linear layers' per-request state lives in
the runner's state pool (execution/recurrent_state.py).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from radixserve.attention.backend import AttentionBackend, AttentionPlan, plan_for
from radixserve.attention.kv_pool import KVPool
from radixserve.kernels.key_basis import rotate_heads
from radixserve.kernels.quant_linear import QuantWeight
from radixserve.model.causal_lm import CausalLM
from radixserve.model.gated_deltanet import GatedDeltaNet
from radixserve.model.layers import Embedding, Linear, RMSNorm, RotaryEmbedding, apply_rotary
from radixserve.model.llama import MLP
from radixserve.model.recurrent_step import RecurrentLayers, RecurrentStep
from radixserve.model.spec import ModelSpec

def rotary_dim(config) -> int:
    params = getattr(config, "rope_parameters", None) or {}
    factor = params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0))
    return int(config.head_dim * factor)


class GatedAttention(nn.Module):
    def __init__(self, spec: ModelSpec, layer_index: int):
        super().__init__()
        self.layer_index = layer_index
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.q_size, self.kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        self.rotary_dim = rotary_dim(spec.hf_config)
        self.qkv_proj = Linear(spec.hidden_size, self.q_size + 2 * self.kv_size, bias=spec.qkv_bias)
        self.output_gate = Linear(spec.hidden_size, self.q_size, bias=spec.qkv_bias)  # q_proj's gate half
        self.o_proj = Linear(self.q_size, spec.hidden_size, bias=spec.o_bias)
        self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)
        self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps)

    def forward(self, x, rope, backend: AttentionBackend, pool: KVPool, plan: AttentionPlan) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(t, self.num_heads, self.head_dim))
        k = self.k_norm(k.reshape(t, self.num_kv_heads, self.head_dim))
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        r = self.rotary_dim
        q_rot, k_rot = apply_rotary(q[..., :r].contiguous(), k[..., :r].contiguous(), *rope)
        q, k = torch.cat((q_rot, q[..., r:]), dim=-1), torch.cat((k_rot, k[..., r:]), dim=-1)
        if pool.rotate_keys:
            q, k = rotate_heads(q), rotate_heads(k)
        k_cache, v_cache = pool.layer(self.layer_index)
        out = backend.forward(q.contiguous(), k.contiguous(), v.contiguous(), k_cache, v_cache, plan_for(plan, 0),
                              window=0)
        return self.o_proj(out.reshape(t, self.q_size) * torch.sigmoid(self.output_gate(x)))


class Qwen3_5DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer_index: int):
        super().__init__()
        config = spec.hf_config
        self.is_linear = layer_index in spec.recurrent_layers
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(
                spec.hidden_size, config.linear_num_key_heads, config.linear_num_value_heads,
                config.linear_key_head_dim, config.linear_value_head_dim, config.linear_conv_kernel_dim,
                spec.rms_norm_eps, layer_index)
        else:
            self.self_attn = GatedAttention(spec, layer_index)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec)

    def forward(self, x, rope, backend: AttentionBackend, pool: KVPool, plan: AttentionPlan,
                step: RecurrentStep) -> torch.Tensor:
        h = self.input_layernorm(x)
        h = self.linear_attn(h, step) if self.is_linear else self.self_attn(h, rope, backend, pool, plan)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3_5ForCausalLM(RecurrentLayers, CausalLM):
    @classmethod
    def text_config(cls, config):
        """Qwen3_5ForConditionalGeneration's text tower (its vision tower is not run)."""
        text = getattr(config, "text_config", None)
        return text if getattr(config, "model_type", None) == "qwen3_5" and text is not None else config

    recurrent_layer_types = ("linear_attention",)  # layer_types' recurrent kind (its others: full_attention)

    @classmethod
    def spec_fields(cls, config) -> dict:
        return {"qk_norm": True}

    def __init__(self, spec: ModelSpec, max_positions: int):
        super().__init__(spec)
        self.embed_tokens = Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(Qwen3_5DecoderLayer(spec, i) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.rotary = RotaryEmbedding(replace(spec, head_dim=rotary_dim(spec.hf_config)), max_positions)
        self.lm_head = None if spec.tie_word_embeddings else Linear(spec.hidden_size, spec.vocab_size, bias=False)

    # ---- weights -------------------------------------------------------------------------

    def from_hf_checkpoint(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """As transformers names them (an image-text checkpoint's text tower too; its vision tower
        and multi-token-prediction head left out): q_proj split into q and its output gate, every
        zero-centered norm's weight w held as 1 + w (float32)."""
        out: dict[str, torch.Tensor] = {}
        for name, t in tensors.items():
            name = _text_tower_name(name)
            if name is None:
                continue
            if name.endswith("self_attn.q_proj.weight") or name.endswith("self_attn.q_proj.bias"):
                q, gate = _split_q_gate(t, self.spec.num_heads, self.spec.head_dim)
                out[name] = q
                out[name.replace(".q_proj.", ".output_gate.")] = gate
            elif name.endswith("norm.weight") and ".linear_attn." not in name:
                out[name] = t.float() + 1.0
            else:
                out[name] = t
        return out

    def load_quantized(self, weights: dict[str, QuantWeight]) -> None:
        if any(name.endswith("q_proj.weight") for name in weights):
            raise ValueError("Qwen3.5's gated q_proj cannot be loaded quantized yet: use weight_dtype float32")
        super().load_quantized(weights)


def _split_q_gate(t: torch.Tensor, heads: int, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q_proj's rows are per head [q (head_dim), gate (head_dim)]: the q rows and the gate rows."""
    per_head = t.reshape(heads, 2 * head_dim, *t.shape[1:])
    return (per_head[:, :head_dim].reshape(heads * head_dim, *t.shape[1:]).contiguous(),
            per_head[:, head_dim:].reshape(heads * head_dim, *t.shape[1:]).contiguous())


_SKIPPED = ("model.visual.", "visual.", "mtp.", "model.mtp.")


def _text_tower_name(name: str) -> str | None:
    """model.language_model.X (Qwen3_5ForConditionalGeneration) -> model.X; None: not the text model."""
    if name.startswith(_SKIPPED):
        return None
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model."):]
    return name


"""GraniteHybridForCausalLM: IBM's Granite 4.0-H (model_type granitemoehybrid): Mamba2 layers
(model/mamba2.py) beside full-attention layers (`layer_types`: linear_attention /
full_attention; "mamba" / "attention" in older configs, as transformers reads them).

Each layer: x + r * op(input_layernorm(x)), then x + r * (shared MLP + experts)(post norm),
with r the residual_multiplier; the experts (model/moe.py's SparseMoE: top k of the router's
logits, softmax over those k) only where the config has num_local_experts. The embeddings are
scaled by embedding_multiplier, the attention's q.k by attention_multiplier (not head_dim ** -0.5),
the logits divided by logits_scaling. Its attention has no RoPE unless position_embedding_type
is "rope" (Granite 4.0-H's is "nope"). The Mamba2 layers' per-request state lives in the
runner's state pool (execution/recurrent_state.py).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.attention.backend import AttentionBackend, AttentionPlan, plan_for
from radixserve.attention.kv_pool import KVPool
from radixserve.kernels.key_basis import rotate_heads
from radixserve.kernels.native_ops import silu_mul
from radixserve.kernels.quant_linear import QuantWeight
from radixserve.model.causal_lm import CausalLM
from radixserve.model.layers import Embedding, Linear, RMSNorm, RotaryEmbedding, apply_rotary
from radixserve.model.mamba2 import Mamba2Mixer
from radixserve.model.moe import SparseMoE, expert_weights
from radixserve.model.recurrent_step import RecurrentStep
from radixserve.model.spec import ModelSpec


def check_config(config) -> None:
    """Refuse, naming what runs, what this module does not run (transformers would run it)."""
    kind = getattr(config, "position_embedding_type", None)
    if kind not in (None, "nope", "rope"):
        raise ValueError(f"Granite position_embedding_type {kind!r}: radixserve runs 'rope' and none ('nope')")
    limit = getattr(config, "time_step_limit", None)
    if limit is not None and (float(limit[0]), float(limit[1])) != (0.0, math.inf):
        raise ValueError(f"Granite time_step_limit {tuple(limit)}: radixserve's Mamba2 runs (0.0, inf) only "
                         "(transformers clamps dt in prompts but not in decodes)")


class GraniteAttention(nn.Module):
    """Llama's attention without q/k norms; RoPE only when the model has it (rope None)."""

    def __init__(self, spec: ModelSpec, layer_index: int):
        super().__init__()
        self.layer_index = layer_index
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        self.q_size, self.kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        self.qkv_proj = Linear(spec.hidden_size, self.q_size + 2 * self.kv_size, bias=spec.qkv_bias)
        self.o_proj = Linear(self.q_size, spec.hidden_size, bias=spec.o_bias)

    def forward(self, x, rope, backend: AttentionBackend, pool: KVPool, plan: AttentionPlan) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(t, self.num_heads, self.head_dim).contiguous()
        k = k.reshape(t, self.num_kv_heads, self.head_dim).contiguous()
        v = v.reshape(t, self.num_kv_heads, self.head_dim).contiguous()
        if rope is not None:
            q, k = apply_rotary(q, k, *rope)
        if pool.rotate_keys:
            q, k = rotate_heads(q), rotate_heads(k)
        k_cache, v_cache = pool.layer(self.layer_index)
        out = backend.forward(q.contiguous(), k.contiguous(), v, k_cache, v_cache, plan_for(plan, 0), window=0)
        return self.o_proj(out.reshape(t, self.q_size))


class SharedMLP(nn.Module):
    """The dense SwiGLU MLP beside the experts, named as Granite names it (input_linear: [gate; up])."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.input_linear = Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.output_linear = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.input_linear(x)
        hidden = silu_mul(gate_up)  # float32 on CPU, in C
        if hidden is None:
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            hidden = F.silu(gate).mul_(up)
        return self.output_linear(hidden)


class GraniteHybridDecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer_index: int):
        super().__init__()
        config = spec.hf_config
        self.is_mamba = layer_index in spec.recurrent_layers
        self.residual_multiplier = float(config.residual_multiplier)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        if self.is_mamba:
            self.mamba = Mamba2Mixer(
                spec.hidden_size, config.mamba_n_heads, config.mamba_d_head, config.mamba_n_groups,
                config.mamba_d_state, config.mamba_d_conv, bool(config.mamba_conv_bias),
                bool(config.mamba_proj_bias), spec.rms_norm_eps, layer_index)
        else:
            self.self_attn = GraniteAttention(spec, layer_index)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.shared_mlp = SharedMLP(spec.hidden_size, config.shared_intermediate_size)
        experts = int(getattr(config, "num_local_experts", 0) or 0)
        # top k of the logits, softmax over those k: softmax over all, top k, renormalized
        self.mlp = SparseMoE(spec.hidden_size, spec.intermediate_size, experts, config.num_experts_per_tok,
                             normalize=True) if experts > 0 else None

    def forward(self, x, rope, backend: AttentionBackend, pool: KVPool, plan: AttentionPlan,
                step: RecurrentStep) -> torch.Tensor:
        h = self.input_layernorm(x)
        h = self.mamba(h, step) if self.is_mamba else self.self_attn(h, rope, backend, pool, plan)
        x = x + h * self.residual_multiplier
        h = self.post_attention_layernorm(x)
        out = self.shared_mlp(h)
        if self.mlp is not None:
            out = self.mlp(h) + out
        return x + out * self.residual_multiplier


class GraniteHybridForCausalLM(CausalLM):
    recurrent_layer_types = ("linear_attention",)  # layer_types' recurrent kind: the Mamba2 layers

    @classmethod
    def spec_fields(cls, config) -> dict:
        check_config(config)
        return {"attention_scale": float(config.attention_multiplier)}

    def __init__(self, spec: ModelSpec, max_positions: int):
        super().__init__(spec)
        config = spec.hf_config
        self.embedding_multiplier = float(config.embedding_multiplier)
        self.logits_scaling = float(config.logits_scaling)
        self.embed_tokens = Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(GraniteHybridDecoderLayer(spec, i) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        use_rope = getattr(config, "position_embedding_type", None) == "rope"
        self.rotary = RotaryEmbedding(spec, max_positions) if use_rope else None
        self.lm_head = None if spec.tie_word_embeddings else Linear(spec.hidden_size, spec.vocab_size, bias=False)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embedding_multiplier

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return super().logits(x) / self.logits_scaling

    def build_rotary(self, max_positions: int, device: torch.device) -> None:
        if self.rotary is not None:
            self.rotary.build(max_positions, device)

    def run_layers(self, x: torch.Tensor, positions: torch.Tensor, backend, pool, plan) -> torch.Tensor:
        step = self.recurrent_step
        if step is None:
            raise RuntimeError("a Granite hybrid step needs its requests' recurrent states (the runner's "
                               "RecurrentStatePool)")
        rope = None if self.rotary is None else self.rotary.lookup(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, rope, backend, pool, plan, step)
        return x

    # ---- weights: Granite's names onto the modules here (fused q/k/v; experts as moe.py takes them) ----

    def from_hf_checkpoint(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {_rename(name): t for name, t in tensors.items()}

    def load_quantized(self, weights: dict[str, QuantWeight]) -> None:
        if weights:
            raise ValueError("Granite hybrids load float weights only so far: use weight_dtype float32")

    def load_hf_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        """The experts go into each layer's SparseMoE; the rest as CausalLM loads them."""
        found, rest = expert_weights(tensors)
        for layer, parts in found.items():
            moe = self.layers[layer].mlp if 0 <= layer < len(self.layers) else None
            if moe is None or set(parts) != {"gate", "up", "down"}:
                raise ValueError(f"the checkpoint's experts of layer {layer} ({sorted(parts)}) do not fit the model")
            moe.load_experts(parts["gate"], parts["up"], parts["down"])
            moe.loaded = True
        unloaded = [i for i, layer in enumerate(self.layers) if layer.mlp is not None and not layer.mlp.loaded]
        if unloaded:
            raise ValueError(f"checkpoint lacks experts of layers {unloaded}")
        super().load_hf_state_dict(rest)

    def weight_bytes(self) -> int:
        return super().weight_bytes() + sum(layer.mlp.weight_bytes() for layer in self.layers if layer.mlp is not None)


_RENAMES = (
    (".block_sparse_moe.input_linear.weight", ".mlp.experts.gate_up_proj"),  # [E, 2I, H]
    (".block_sparse_moe.output_linear.weight", ".mlp.experts.down_proj"),  # [E, H, I]
    (".block_sparse_moe.experts.", ".mlp.experts."),  # transformers' in-memory names
    (".block_sparse_moe.router.layer.", ".mlp.gate."),
    (".block_sparse_moe.router.", ".mlp.gate."),
)


def _rename(name: str) -> str:
    """A Granite checkpoint's weight name as the modules here name it."""
    for theirs, ours in _RENAMES:
        if theirs in name:
            return name.replace(theirs, ours)
    return name

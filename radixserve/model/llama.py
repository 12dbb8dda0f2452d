"""LlamaForCausalLM: Llama, Mistral (sliding window), Qwen2 (qkv bias), Qwen3 (q/k norm)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.attention.backend import AttentionBackend, AttentionPlan, plan_for
from radixserve.attention.kv_pool import KVPool
from radixserve.kernels.key_basis import rotate_heads
from radixserve.kernels.native_ops import rms_norm_heads_, silu_mul
from radixserve.model.causal_lm import CausalLM
from radixserve.model.layers import Embedding, Linear, RMSNorm, RotaryEmbedding, apply_rotary
from radixserve.model.native_decoder import RopeTables
from radixserve.model.spec import ModelSpec


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, layer_index: int):
        super().__init__()
        self.layer_index = layer_index
        self.window = spec.layer_windows[layer_index]
        self.num_heads = spec.num_heads
        self.num_kv_heads = spec.num_kv_heads
        self.head_dim = spec.head_dim
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        self.qkv_proj = Linear(spec.hidden_size, self.q_size + 2 * self.kv_size, bias=spec.qkv_bias)
        self.o_proj = Linear(self.q_size, spec.hidden_size, bias=spec.o_bias)
        self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.sinks = nn.Parameter(torch.empty(spec.num_heads)) if spec.attention_sinks else None

    def forward(self, x, rope, backend: AttentionBackend, pool: KVPool, plan: AttentionPlan):
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:  # in place, in C (the native decoder's kernel) where it applies
            q = q if rms_norm_heads_(q, self.q_norm.weight, self.q_norm.eps) else self.q_norm(q)
            k = k if rms_norm_heads_(k, self.k_norm.weight, self.k_norm.eps) else self.k_norm(k)
        q, k = apply_rotary(q, k, *rope)
        if pool.rotate_keys:
            q, k = rotate_heads(q), rotate_heads(k)
        if not backend.takes_strided_rows:
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        k_cache, v_cache = pool.layer(self.layer_index)
        out = backend.forward(q, k, v, k_cache, v_cache, plan_for(plan, self.window), window=self.window,
                              sinks=self.sinks)
        return self.o_proj(out.reshape(t, self.q_size))


class MLP(nn.Module):
    native_activation = 0  # the native decoder's code for its gate: SiLU

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.intermediate_size = spec.intermediate_size
        self.gate_up_proj = Linear(spec.hidden_size, 2 * spec.intermediate_size, bias=spec.mlp_bias)
        self.down_proj = Linear(spec.intermediate_size, spec.hidden_size, bias=spec.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        hidden = silu_mul(gate_up)  # float32 on CPU, in C
        if hidden is None:
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            hidden = F.silu(gate).mul_(up)
        return self.down_proj(hidden)


class DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer_index: int, mlp: nn.Module | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec, layer_index)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec) if mlp is None else mlp

    def forward(self, x, rope, backend: AttentionBackend, pool: KVPool, plan: AttentionPlan):
        x = x + self.self_attn(self.input_layernorm(x), rope, backend, pool, plan)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(CausalLM):
    gguf_interleaved_qk = ("llama", "mistral")

    @classmethod
    def spec_fields(cls, config) -> dict:
        model_type = getattr(config, "model_type", None)
        return {"qkv_bias": model_type == "qwen2" or bool(getattr(config, "attention_bias", False)),
                "qk_norm": model_type == "qwen3"}

    def __init__(self, spec: ModelSpec, max_positions: int):
        super().__init__(spec)
        self.embed_tokens = Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec, i, self.make_mlp(spec, i)) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.rotary = RotaryEmbedding(spec, max_positions)
        self.lm_head = None if spec.tie_word_embeddings else Linear(spec.hidden_size, spec.vocab_size, bias=False)

    def make_mlp(self, spec: ModelSpec, layer_index: int) -> nn.Module:
        """Layer `layer_index`'s MLP: Llama's dense one (a family of experts makes its own)."""
        return MLP(spec)

    def native_rope(self, positions: torch.Tensor) -> tuple[RopeTables, None]:
        return self.rotary.tables(positions), None

    def run_layers(self, x: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend, pool: KVPool,
                   plan: AttentionPlan) -> torch.Tensor:
        rope = self.rotary.lookup(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, rope, backend, pool, plan)
        return x

"""GptOssForCausalLM: OpenAI's gpt-oss (gpt-oss-20b, gpt-oss-120b).

Llama's frame with four differences: q/k/v/o have biases; each attention layer has a learned
sink logit per query head, one more term in each head's softmax denominator with no value row
(`ModelSpec.attention_sinks`: every attention backend takes them); layers alternate a 128-token
sliding window and full attention (`layer_types`: window layers keep their KV on the hybrid
KV's window pages, as Gemma 3's do); and every MLP is a mixture of experts (`GptOssMoE`): a
router with a bias picks the top k experts by their logits and weighs them by a softmax over
those k; each expert's gate/up and down have biases and its activation is a clamped SwiGLU,
(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g) with g = min(gate, limit). RoPE is YaRN
(layers.RotaryEmbedding through transformers' parameters).

A transformers checkpoint holds each layer's experts as gate_up_proj [E, H, 2I] (x @ w, gate
and up interleaved column by column) and down_proj [E, I, H], with their biases; they are held
here as the other MoE families hold them ([E, 2I, H] gate rows then up rows, [E, H, I]), made
so once at load (`from_hf_checkpoint`).
"""

from __future__ import annotations

import torch
from torch import nn

from radixserve.attention.backend import AttentionBackend, AttentionPlan
from radixserve.attention.kv_pool import KVPool
from radixserve.model.causal_lm import CausalLM
from radixserve.model.layers import Embedding, Linear, RMSNorm, RotaryEmbedding, linear
from radixserve.model.llama import DecoderLayer
from radixserve.model.moe import SparseMoE
from radixserve.model.spec import ModelSpec

_EXPERT_PARTS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")


class GptOssMoE(SparseMoE):
    """SparseMoE with gpt-oss's routing (top k of the biased logits, softmax over those k) and
    experts (biases, the clamped SwiGLU). Float experts: the checkpoint's bf16 or float32 ones."""

    def __init__(self, hidden: int, intermediate: int, num_experts: int, top_k: int, alpha: float, limit: float):
        super().__init__(hidden, intermediate, num_experts, top_k, normalize=False)
        self.gate = Linear(hidden, num_experts, bias=True)
        self.alpha, self.limit = float(alpha), float(limit)
        self.register_buffer("gate_up_bias", torch.empty(num_experts, 2 * intermediate), persistent=False)
        self.register_buffer("down_bias", torch.empty(num_experts, hidden), persistent=False)

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        top, experts = torch.topk(logits, self.top_k, dim=-1)
        return torch.softmax(top, dim=-1, dtype=top.dtype), experts

    def expert(self, e: int, h: torch.Tensor) -> torch.Tensor:
        gate, up = linear(h, self.gate_up[e], self.gate_up_bias[e]).split(self.intermediate, dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return linear((up + 1) * (gate * torch.sigmoid(gate * self.alpha)), self.down[e], self.down_bias[e])

    def load_checkpoint_experts(self, parts: dict[str, torch.Tensor]) -> None:
        """A transformers checkpoint's four expert tensors of this layer (_EXPERT_PARTS)."""
        gate_up, gate_up_bias = parts["gate_up_proj"].transpose(1, 2), parts["gate_up_proj_bias"]
        down = parts["down_proj"].transpose(1, 2)
        e, i, h = self.num_experts, self.intermediate, self.gate.in_features
        for name, got, want in (("gate_up_proj", gate_up, (e, 2 * i, h)), ("gate_up_proj_bias", gate_up_bias, (e, 2 * i)),
                                ("down_proj", down, (e, h, i)), ("down_proj_bias", parts["down_proj_bias"], (e, h))):
            if tuple(got.shape) != want:
                raise ValueError(f"expert {name} is {tuple(got.shape)} as held, the model needs {want}")
        # interleaved (gate 0, up 0, gate 1, ...) -> gate rows, then up rows
        self.gate_up.copy_(torch.cat([gate_up[:, 0::2], gate_up[:, 1::2]], dim=1))
        self.gate_up_bias.copy_(torch.cat([gate_up_bias[:, 0::2], gate_up_bias[:, 1::2]], dim=1))
        self.down.copy_(down)
        self.down_bias.copy_(parts["down_proj_bias"])
        self.loaded = True

    def weight_bytes(self) -> int:
        return super().weight_bytes() + sum(t.numel() * t.element_size() for t in (self.gate_up_bias, self.down_bias))


class GptOssForCausalLM(CausalLM):
    @classmethod
    def spec_fields(cls, config) -> dict:
        return {"attention_sinks": True, "qkv_bias": bool(getattr(config, "attention_bias", True)),
                "o_bias": bool(getattr(config, "attention_bias", True))}

    def __init__(self, spec: ModelSpec, max_positions: int):
        super().__init__(spec)
        config = spec.hf_config
        experts = int(getattr(config, "num_local_experts", None) or getattr(config, "num_experts", 0))
        self.embed_tokens = Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(spec, i, GptOssMoE(spec.hidden_size, spec.intermediate_size, experts,
                                            config.num_experts_per_tok, config.swiglu_alpha, config.swiglu_limit))
            for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.rotary = RotaryEmbedding(spec, max_positions)
        self.lm_head = None if spec.tie_word_embeddings else Linear(spec.hidden_size, spec.vocab_size, bias=False)

    def run_layers(self, x: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend, pool: KVPool,
                   plan: AttentionPlan) -> torch.Tensor:
        rope = self.rotary.lookup(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, rope, backend, pool, plan)
        return x

    def from_hf_checkpoint(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The router as the MoE's gate (mlp.router.* -> mlp.gate.*); the experts as they are
        (load_hf_state_dict takes them). OpenAI's MXFP4 experts (..._blocks, ..._scales) are refused."""
        packed = [name for name in tensors if name.endswith(("_blocks", "_scales"))]
        if packed:
            raise ValueError(f"MXFP4-packed gpt-oss experts ({packed[0]}, ...) are not supported from a Hugging Face "
                             "directory; use a checkpoint with float (bf16) experts")
        return {name.replace(".mlp.router.", ".mlp.gate."): t for name, t in tensors.items()}

    def load_hf_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        experts: dict[int, dict[str, torch.Tensor]] = {}
        rest = {}
        for name, t in tensors.items():
            stem, _, part = name.rpartition(".mlp.experts.")
            if stem and part in _EXPERT_PARTS:
                experts.setdefault(int(stem.rsplit(".", 1)[-1]), {})[part] = t
            else:
                rest[name] = t
        for layer, parts in experts.items():
            if not 0 <= layer < len(self.layers) or set(parts) != set(_EXPERT_PARTS):
                raise ValueError(f"layer {layer}'s experts are {sorted(parts)}, the model needs {list(_EXPERT_PARTS)}")
            self.layers[layer].mlp.load_checkpoint_experts(parts)
        super().load_hf_state_dict(rest)
        unloaded = [i for i, layer in enumerate(self.layers) if not layer.mlp.loaded]
        if unloaded:
            raise ValueError(f"checkpoint lacks experts of layers {unloaded}")

    def weight_bytes(self) -> int:
        return super().weight_bytes() + sum(layer.mlp.weight_bytes() for layer in self.layers)

"""Gemma3ForCausalLM: Gemma 3's text model (gemma3_text).

Where it departs from Llama: the embeddings are scaled by sqrt(hidden); every RMSNorm
multiplies by (1 + weight) (held here as 1 + weight: as a GGUF stores it, and added once to a
transformers checkpoint's w); each layer has
four norms (before and after attention, before and after the MLP) and q/k norms; the MLP
is GELU-tanh gated; attention scales by query_pre_attn_scalar ** -0.5; and five of every
six layers attend to a sliding window with their own RoPE base (`layer_types`).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from radixserve.attention.backend import AttentionBackend, AttentionPlan
from radixserve.attention.kv_pool import KVPool
from radixserve.kernels.native_ops import gelu_tanh_mul, rms_norm_add_
from radixserve.model.causal_lm import CausalLM
from radixserve.model.layers import Embedding, Linear, RMSNorm, RotaryEmbedding
from radixserve.model.llama import Attention
from radixserve.model.native_decoder import EmbeddingRows, RopeTables
from radixserve.model.spec import ModelSpec

Rope = tuple[torch.Tensor, torch.Tensor]


class Gemma3MLP(nn.Module):
    native_activation = 1  # the native decoder's code for its gate: GELU-tanh

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.intermediate_size = spec.intermediate_size
        self.gate_up_proj = Linear(spec.hidden_size, 2 * spec.intermediate_size, bias=spec.mlp_bias)
        self.down_proj = Linear(spec.intermediate_size, spec.hidden_size, bias=spec.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        hidden = gelu_tanh_mul(gate_up)  # float32 on CPU, in C (the native decoder's kernel)
        if hidden is None:
            gate, up = gate_up.split(self.intermediate_size, dim=-1)
            hidden = F.gelu(gate, approximate="tanh").mul_(up)
        return self.down_proj(hidden)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer_index: int):
        super().__init__()
        size, eps = spec.hidden_size, spec.rms_norm_eps
        self.input_layernorm = RMSNorm(size, eps)
        self.self_attn = Attention(spec, layer_index)  # q/k norms: spec.qk_norm
        self.post_attention_layernorm = RMSNorm(size, eps)
        self.pre_feedforward_layernorm = RMSNorm(size, eps)
        self.mlp = Gemma3MLP(spec)
        self.post_feedforward_layernorm = RMSNorm(size, eps)

    def forward(self, x, rope: Rope, backend: AttentionBackend, pool: KVPool, plan: AttentionPlan):
        """x is updated in place where the C kernels apply (the residual stream is the layer's own)."""
        attended = self.self_attn(self.input_layernorm(x), rope, backend, pool, plan)
        x = _add_normed(x, attended, self.post_attention_layernorm)
        return _add_normed(x, self.mlp(self.pre_feedforward_layernorm(x)), self.post_feedforward_layernorm)


def _add_normed(x: torch.Tensor, y: torch.Tensor, norm: RMSNorm) -> torch.Tensor:
    """x + norm(y): in place in one C pass (the same bits) where it applies."""
    return x if rms_norm_add_(x, y, norm.weight, norm.eps) else x + norm(y)


class Gemma3ForCausalLM(CausalLM):
    # llama.cpp names Gemma 3's four norms its own way (its ffn_norm comes before the MLP, not after attention)
    gguf_layer_names = {**CausalLM.gguf_layer_names, "post_attention_norm": "post_attention_layernorm",
                        "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}

    @classmethod
    def spec_fields(cls, config) -> dict:
        return {"qk_norm": True}

    @classmethod
    def text_config(cls, config):
        """Gemma3ForConditionalGeneration's text tower (its tie_word_embeddings is the outer config's)."""
        text = getattr(config, "text_config", None)
        if getattr(config, "model_type", None) != "gemma3" or text is None:
            return config
        if not hasattr(text, "tie_word_embeddings") or getattr(config, "tie_word_embeddings", None) is not None:
            text.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", True))
        return text

    def __init__(self, spec: ModelSpec, max_positions: int):
        super().__init__(spec)
        config = spec.hf_config
        _refuse_unsupported(config)
        self.embed_tokens = Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(spec, i) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = None if spec.tie_word_embeddings else Linear(spec.hidden_size, spec.vocab_size, bias=False)
        per_kind = isinstance(getattr(config, "rope_parameters", None), dict) and "full_attention" in config.rope_parameters
        self.rotary = RotaryEmbedding(spec, max_positions, "full_attention" if per_kind else None)
        self.rotary_local = RotaryEmbedding(spec, max_positions, "sliding_attention" if per_kind else None)
        self.embed_scale = float(np.float32(spec.hidden_size**0.5))  # transformers' scale is a float32 tensor
        self.final_softcap = getattr(config, "final_logit_softcapping", None)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids) * self.embed_scale

    def run_layers(self, x: torch.Tensor, positions: torch.Tensor, backend: AttentionBackend, pool: KVPool,
                   plan: AttentionPlan) -> torch.Tensor:
        full = self.rotary.lookup(positions, x.dtype)
        local = self.rotary_local.lookup(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, local if layer.self_attn.window else full, backend, pool, plan)
        return x

    def native_rope(self, positions: torch.Tensor) -> tuple[RopeTables, RopeTables]:
        return self.rotary.tables(positions), self.rotary_local.tables(positions)

    def native_embedding(self) -> EmbeddingRows:
        return self._embedding_rows(), self.embed_scale

    def native_head(self):
        return None if self.final_softcap else self._plain_head()

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        logits = super().logits(x)
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    def build_rotary(self, max_positions: int, device: torch.device) -> None:
        self.rotary.build(max_positions, device)
        self.rotary_local.build(max_positions, device)

    def from_hf_checkpoint(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """As transformers names them (an image-text checkpoint's text tower too, its vision
        tower left out): every norm's weight w held as 1 + w (float32)."""
        text = {_text_tower_name(name): t for name, t in tensors.items() if not name.startswith(_VISION_PREFIXES)}
        return {name: t.float() + 1.0 if name.endswith("norm.weight") else t for name, t in text.items()}


_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def _text_tower_name(name: str) -> str:
    """language_model.model.X / model.language_model.X (Gemma3ForConditionalGeneration) -> model.X."""
    for prefix in ("language_model.model.", "model.language_model."):
        if name.startswith(prefix):
            return "model." + name[len(prefix):]
    return name.removeprefix("language_model.")  # language_model.lm_head.weight


def _refuse_unsupported(config) -> None:
    """What this forward does not run, refused rather than computed wrong."""
    if getattr(config, "attn_logit_softcapping", None):
        raise ValueError("attention logit soft-capping (Gemma 2) is not supported")
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError("bidirectional attention (EmbeddingGemma) is not supported")

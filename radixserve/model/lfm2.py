"""Lfm2ForCausalLM: Liquid AI's LFM2 (model_type lfm2): gated short convolutions
(model/short_conv.py) beside full-attention layers (`layer_types`: conv / full_attention).

Each layer: x + op(operator_norm(x)), then + a SwiGLU MLP of ffn_norm; the attention is
Llama's with q/k norms (q_layernorm, k_layernorm) and no biases; the final norm is
`embedding_norm`. The conv layers' per-request state lives in the runner's state pool
(execution/recurrent_state.py), which hands every step a RecurrentStep; only the attention
layers write the KV pool (the conv layers' pool layers stay unused).
"""

from __future__ import annotations

import torch
from torch import nn

from radixserve.attention.backend import AttentionBackend, AttentionPlan
from radixserve.attention.kv_pool import KVPool
from radixserve.kernels.quant_linear import QuantWeight
from radixserve.model.causal_lm import CausalLM, _map_weight_name
from radixserve.model.layers import Embedding, Linear, RMSNorm, RotaryEmbedding
from radixserve.model.llama import MLP, Attention
from radixserve.model.recurrent_step import RecurrentLayers, RecurrentStep
from radixserve.model.short_conv import ShortConv
from radixserve.model.spec import ModelSpec


def _mlp_width(config) -> int:
    """Lfm2MLP's width: 2/3 of intermediate_size, times the multiplier, rounded up to block_multiple_of."""
    width = config.intermediate_size
    if getattr(config, "block_auto_adjust_ff_dim", False):
        width = int(2 * width / 3)
        multiplier = getattr(config, "block_ffn_dim_multiplier", None)
        if multiplier is not None:
            multiple = config.block_multiple_of
            width = multiple * ((int(multiplier * width) + multiple - 1) // multiple)
    return width


class Lfm2DecoderLayer(nn.Module):
    def __init__(self, spec: ModelSpec, layer_index: int):
        super().__init__()
        config = spec.hf_config
        self.is_conv = layer_index in spec.recurrent_layers
        self.operator_norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        if self.is_conv:
            self.conv = ShortConv(spec.hidden_size, config.conv_L_cache, bool(config.conv_bias), layer_index)
        else:
            self.self_attn = Attention(spec, layer_index)
        self.ffn_norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec)

    def forward(self, x, rope, backend: AttentionBackend, pool: KVPool, plan: AttentionPlan,
                step: RecurrentStep) -> torch.Tensor:
        h = self.operator_norm(x)
        h = self.conv(h, step) if self.is_conv else self.self_attn(h, rope, backend, pool, plan)
        x = x + h
        return x + self.mlp(self.ffn_norm(x))


class Lfm2ForCausalLM(RecurrentLayers, CausalLM):
    recurrent_layer_types = ("conv",)  # layer_types' recurrent kind (its others: full_attention)
    # llama.cpp's lfm2 block tensors -> transformers' LFM2 names (renamed onto the modules at load)
    gguf_layer_names = {
        "attn_norm": "operator_norm", "ffn_norm": "ffn_norm",
        "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.out_proj", "attn_q_norm": "self_attn.q_layernorm",
        "attn_k_norm": "self_attn.k_layernorm", "ffn_gate": "feed_forward.w1", "ffn_up": "feed_forward.w3",
        "ffn_down": "feed_forward.w2", "shortconv.in_proj": "conv.in_proj", "shortconv.conv": "conv.conv",
        "shortconv.out_proj": "conv.out_proj",
    }

    @classmethod
    def spec_fields(cls, config) -> dict:
        """Its MLP width as transformers computes it from intermediate_size
        (block_auto_adjust_ff_dim), its norm's eps (norm_eps), q/k norms."""
        return {"intermediate_size": _mlp_width(config), "rms_norm_eps": config.norm_eps, "qk_norm": True}

    def __init__(self, spec: ModelSpec, max_positions: int):
        super().__init__(spec)
        self.embed_tokens = Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(Lfm2DecoderLayer(spec, i) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.rotary = RotaryEmbedding(spec, max_positions)
        self.lm_head = None if spec.tie_word_embeddings else Linear(spec.hidden_size, spec.vocab_size, bias=False)

    # ---- weights: LFM2's names onto the Llama-style modules (fused q/k/v and gate/up) ----

    def from_hf_checkpoint(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {_rename(name): _conv_weight(name, t) for name, t in tensors.items()}

    def load_weights(self, tensors: dict[str, torch.Tensor], source: str) -> None:
        """A GGUF's tensors come named as transformers names LFM2's (gguf_layer_names): renamed too."""
        super().load_weights(self.from_hf_checkpoint(tensors) if source == "gguf" else tensors, source)

    def load_quantized(self, weights: dict[str, QuantWeight]) -> None:
        super().load_quantized({_rename(name): w for name, w in weights.items()})

    def drop_float_weights(self, names: set[str]) -> None:
        super().drop_float_weights({_map_weight_name(_rename(name))[0] for name in names})


_RENAMES = (
    (".self_attn.out_proj.", ".self_attn.o_proj."),
    (".self_attn.q_layernorm.", ".self_attn.q_norm."),
    (".self_attn.k_layernorm.", ".self_attn.k_norm."),
    (".feed_forward.w1.", ".mlp.gate_proj."),
    (".feed_forward.w3.", ".mlp.up_proj."),
    (".feed_forward.w2.", ".mlp.down_proj."),
)


def _conv_weight(name: str, t: torch.Tensor) -> torch.Tensor:
    """llama.cpp stores the depthwise conv's weight squeezed, [C, L]: back to nn.Conv1d's [C, 1, L]."""
    return t.unsqueeze(1) if name.endswith(".conv.conv.weight") and t.dim() == 2 else t


def _rename(name: str) -> str:
    """An LFM2 checkpoint's weight name as the Llama-style modules here name it."""
    for theirs, ours in _RENAMES:
        name = name.replace(theirs, ours)
    if name.endswith("embedding_norm.weight"):  # the final norm
        return name.replace("embedding_norm", "norm")
    return name

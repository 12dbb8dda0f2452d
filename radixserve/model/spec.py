"""ModelSpec: the shape of a Llama-family model, read from a transformers config."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
SUPPORTED_MODEL_TYPES = set(SUPPORTED_ARCHITECTURES.values())


@dataclass(frozen=True)
class ModelSpec:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    hidden_act: str
    hf_config: Any  # the transformers config, for RoPE variants

    @classmethod
    def from_hf_config(cls, config: Any) -> "ModelSpec":
        model_type = getattr(config, "model_type", None)
        archs = getattr(config, "architectures", None) or []
        if model_type not in SUPPORTED_MODEL_TYPES and not any(a in SUPPORTED_ARCHITECTURES for a in archs):
            raise ValueError(
                f"unsupported model type {model_type!r} (architectures {archs}); radixserve runs the "
                f"Llama family: {', '.join(sorted(SUPPORTED_MODEL_TYPES))}"
            )
        hidden = config.hidden_size
        heads = config.num_attention_heads
        act = getattr(config, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"unsupported activation {act!r}; radixserve's Llama MLP runs silu")
        window = getattr(config, "sliding_window", None)
        max_pos = config.max_position_embeddings
        use_window = getattr(config, "use_sliding_window", model_type == "mistral")
        if window and use_window:
            max_pos = min(max_pos, window)  # no sliding-window attention: cap the context instead
        return cls(
            model_type=model_type,
            vocab_size=config.vocab_size,
            hidden_size=hidden,
            intermediate_size=config.intermediate_size,
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or hidden // heads,
            rms_norm_eps=config.rms_norm_eps,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or bool(getattr(config, "attention_bias", False)),
            o_bias=bool(getattr(config, "attention_bias", False)),
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            hidden_act=act,
            hf_config=config,
        )

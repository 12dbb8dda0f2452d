"""ModelSpec: the shape of a model, read from a transformers config, that the runner, the
KV pool and the scheduler size themselves by."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from radixserve.model.registry import ModelFamily, family_for_config, model_class


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
    family: str = "llama"
    # Per layer: 0 attends to the whole context, W > 0 to the last W tokens (sliding window).
    layer_windows: tuple[int, ...] = field(default=())
    attention_scale: float = 0.0  # multiplies q.k; 0: head_dim ** -0.5
    # Layers that keep a per-request recurrent state instead of KV (LFM2's short convolutions):
    # a prefix of another request's KV cannot rebuild their state.
    recurrent_layers: tuple[int, ...] = field(default=())
    # gpt-oss: each attention layer has a learned sink logit per query head (AttentionBackend.forward's sinks)
    attention_sinks: bool = False

    def __post_init__(self):
        if not self.layer_windows:
            object.__setattr__(self, "layer_windows", (0,) * self.num_layers)
        if not self.attention_scale:
            object.__setattr__(self, "attention_scale", self.head_dim**-0.5)

    @property
    def windowed(self) -> bool:
        return any(self.layer_windows)

    @property
    def recurrent(self) -> bool:
        return bool(self.recurrent_layers)

    @classmethod
    def from_hf_config(cls, config: Any, family: ModelFamily | None = None) -> "ModelSpec":
        """The spec of `config` (of `family`, where the caller has looked it up already): the
        fields every family shares, then the family's own (its class's `spec_fields`)."""
        family = family or family_for_config(config)
        family_class = model_class(family)
        config = family_class.text_config(config)
        model_type = getattr(config, "model_type", None)
        hidden = config.hidden_size
        heads = config.num_attention_heads
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")
        if act not in family.activations:
            raise ValueError(f"unsupported activation {act!r}; radixserve's {family.name} MLP runs "
                             f"{' or '.join(family.activations)}")
        head_dim = getattr(config, "head_dim", None) or hidden // heads
        scalar = getattr(config, "query_pre_attn_scalar", None)
        recurrent_types = getattr(family_class, "recurrent_layer_types", ())
        fields = dict(
            model_type=model_type,
            vocab_size=config.vocab_size,
            hidden_size=hidden,
            intermediate_size=getattr(config, "intermediate_size", 0),  # an MoE may have none (its spec_fields)
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            rms_norm_eps=getattr(config, "rms_norm_eps", None),  # LFM2 names it norm_eps (its spec_fields)
            max_position_embeddings=config.max_position_embeddings,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            qkv_bias=bool(getattr(config, "attention_bias", False)),
            o_bias=bool(getattr(config, "attention_bias", False)),
            mlp_bias=bool(getattr(config, "mlp_bias", False)),
            qk_norm=False,
            hidden_act=act,
            hf_config=config,
            family=family.name,
            layer_windows=_layer_windows(config, model_type, recurrent_types),
            recurrent_layers=_recurrent_layers(config, recurrent_types),
            attention_scale=float(scalar) ** -0.5 if scalar else head_dim**-0.5,
        )
        fields.update(family_class.spec_fields(config))
        return cls(**fields)


def _recurrent_layers(config: Any, recurrent_types: tuple[str, ...]) -> tuple[int, ...]:
    """The layers whose `layer_types` entry is one of the family's recurrent kinds (its class's
    `recurrent_layer_types`: LFM2's conv, Qwen3.5's linear_attention)."""
    layer_types = getattr(config, "layer_types", None) or ()
    return tuple(i for i, t in enumerate(layer_types) if t in recurrent_types)


def _layer_windows(config: Any, model_type: str | None, recurrent_types: tuple[str, ...] = ()) -> tuple[int, ...]:
    """Each layer's window as transformers runs it: by `layer_types` where the config has
    them (Gemma 3, Qwen 2 with use_sliding_window), else Mistral's one window for all layers;
    a recurrent layer (of `recurrent_types`) has none."""
    window = getattr(config, "sliding_window", None) or 0
    layers = config.num_hidden_layers
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        if len(layer_types) != layers:
            raise ValueError(f"config has {len(layer_types)} layer_types for {layers} layers")
        unknown = set(layer_types) - {"full_attention", "sliding_attention", *recurrent_types}
        if unknown:
            raise ValueError(f"unsupported layer types {sorted(unknown)}")
        if "sliding_attention" in layer_types and window <= 0:
            raise ValueError("config has sliding_attention layers but no sliding_window")
        return tuple(window if t == "sliding_attention" else 0 for t in layer_types)
    if model_type == "mistral" and window and getattr(config, "use_sliding_window", True):
        return (int(window),) * layers
    return (0,) * layers

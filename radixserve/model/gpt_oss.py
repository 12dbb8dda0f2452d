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

A llama.cpp `gpt-oss` GGUF is read as the file holds it (`gguf_config`: the config from the
header, YaRN included): its experts stacked per projection, gate and up apart, with their biases
(ffn_{gate,up,down}_exps.bias), quantized as stored; OpenAI's MXFP4 experts are repacked exactly
into 8-bit codes (model/gguf_repack.py). Quantized experts run an expert at a time through the
quantized kernels (`GptOssMoE.expert`): the MoE's one C call (kernels/moe_experts.py) runs a
plain SwiGLU without biases, so it is not used here.
"""

from __future__ import annotations

import functools
import re

import torch
from torch import nn

from radixserve.attention.backend import AttentionBackend, AttentionPlan
from radixserve.attention.kv_pool import KVPool
from radixserve.model.causal_lm import CausalLM
from radixserve.kernels.quant_linear import QuantWeight
from radixserve.model.gguf_file import header_field, refuse_rope_scaling
from radixserve.model.layers import Embedding, Linear, RMSNorm, RotaryEmbedding, linear, quantized_linear
from radixserve.model.llama import DecoderLayer
from radixserve.model.moe import SparseMoE, Weight
from radixserve.model.spec import ModelSpec

_EXPERT_PARTS = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
# a GGUF's stacked experts, as gguf_layer_names names them: weights [E, out, in] (quantized [E * out, in]),
# biases [E, out]
_GGUF_EXPERT = re.compile(r"^(?:model\.)?layers\.(\d+)\.mlp\.experts\.(gate|up|down)_proj\.(weight|bias)$")
_GGUF_PARTS = {f"{proj}.{kind}" for proj in ("gate", "up", "down") for kind in ("weight", "bias")}
SWIGLU_LIMIT = 7.0  # gpt-oss's clamp, which a GGUF header does not carry (llama.cpp runs the same constant)


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
        gate, up = self._product(h, self.gate_up, self.quant_gate_up, self.gate_up_bias, e).split(self.intermediate,
                                                                                                   dim=-1)
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return self._product((up + 1) * (gate * torch.sigmoid(gate * self.alpha)), self.down, self.quant_down,
                             self.down_bias, e)

    @staticmethod
    def _product(h: torch.Tensor, floats: torch.Tensor | None, quant: list[QuantWeight] | None, bias: torch.Tensor,
                 e: int) -> torch.Tensor:
        if quant is not None:
            return quantized_linear(h, quant[e], bias[e])
        return linear(h, floats[e], bias[e])

    def load_stacked_experts(self, parts: dict[str, Weight | torch.Tensor]) -> None:
        """A GGUF's experts of this layer (_GGUF_PARTS): each projection's weights stacked, float
        [E, out, in] or quantized [E * out, in], and its biases [E, out]."""
        self.load_experts(parts["gate.weight"], parts["up.weight"], parts["down.weight"])
        self.native = None  # the one C call runs a plain SwiGLU without biases: an expert at a time here
        e, i, h = self.num_experts, self.intermediate, self.gate.in_features
        for name, want in (("gate.bias", (e, i)), ("up.bias", (e, i)), ("down.bias", (e, h))):
            if tuple(parts[name].shape) != want:
                raise ValueError(f"expert {name} is {tuple(parts[name].shape)}, the model needs {want}")
        self.gate_up_bias.copy_(torch.cat([parts["gate.bias"], parts["up.bias"]], dim=1))
        self.down_bias.copy_(parts["down.bias"])
        self.loaded = True

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
    # llama.cpp's gpt-oss block tensors -> the names held under model.layers.N (attn_sinks.weight a
    # whole name: the sinks are a parameter of their own; the router and the experts' biases included)
    gguf_layer_names = {
        "attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
        "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj", "attn_sinks.weight": "self_attn.sinks", "ffn_gate_inp": "mlp.gate",
        "ffn_gate_exps": "mlp.experts.gate_proj", "ffn_up_exps": "mlp.experts.up_proj",
        "ffn_down_exps": "mlp.experts.down_proj",
    }

    @classmethod
    def gguf_config(cls, header) -> dict:
        """config.json's fields from a gpt-oss GGUF header, as llama.cpp's converter writes them
        (transformers' reading of it drops head_dim and YaRN's betas)."""
        return gpt_oss_gguf_config(header)

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
        self._gguf_experts: dict[int, dict[str, Weight]] = {}  # a GGUF's expert tensors by layer, until all came

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
                             "directory; use a checkpoint with float (bf16) experts, or llama.cpp's gpt-oss GGUF "
                             "(its MXFP4 experts served as stored)")
        return {name.replace(".mlp.router.", ".mlp.gate."): t for name, t in tensors.items()}

    def drop_float_weights(self, names: set[str]) -> None:
        """A GGUF's quantized experts: a layer whose gate/up and down both come quantized holds no
        float experts."""
        experts = {n for n in names if ".mlp.experts." in n}
        for layer in {int(n.split(".")[1]) for n in experts}:
            parts = {n.rsplit(".", 2)[-2] for n in experts if n.split(".")[1] == str(layer)}
            if parts >= {"gate_up_proj", "down_proj"} and 0 <= layer < len(self.layers):
                self.layers[layer].mlp.drop_float_experts()
        super().drop_float_weights(names - experts)

    def load_hf_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        """A transformers checkpoint's experts (_EXPERT_PARTS), or a GGUF's float ones and biases
        (their quantized weights come to load_quantized, which loads the GGUF's experts)."""
        experts: dict[int, dict[str, torch.Tensor]] = {}
        rest = {}
        for name, t in self._take_gguf_experts(tensors).items():
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
        if not self._gguf_experts:
            self._check_experts_loaded()

    def load_quantized(self, weights: dict[str, QuantWeight]) -> None:
        """Quantized weights, a GGUF's experts among them; loads last, so the GGUF's experts
        (with the biases load_hf_state_dict set aside) are loaded and checked here."""
        super().load_quantized(self._take_gguf_experts(weights))
        for layer, parts in sorted(self._gguf_experts.items()):
            if set(parts) != _GGUF_PARTS or not 0 <= layer < len(self.layers):
                raise ValueError(f"layer {layer}'s experts are {sorted(parts)}, the model needs {sorted(_GGUF_PARTS)}")
            self.layers[layer].mlp.load_stacked_experts(parts)
        self._gguf_experts = {}
        self._check_experts_loaded()

    def _take_gguf_experts(self, tensors: dict) -> dict:
        """Set a GGUF's expert tensors aside by layer (self._gguf_experts); the rest returned."""
        rest = {}
        for name, t in tensors.items():
            m = _GGUF_EXPERT.match(name)
            if m is None:
                rest[name] = t
            else:
                self._gguf_experts.setdefault(int(m.group(1)), {})[f"{m.group(2)}.{m.group(3)}"] = t
        return rest

    def _check_experts_loaded(self) -> None:
        unloaded = [i for i, layer in enumerate(self.layers) if not layer.mlp.loaded]
        if unloaded:
            raise ValueError(f"checkpoint lacks experts of layers {unloaded}")

    def weight_bytes(self) -> int:
        return super().weight_bytes() + sum(layer.mlp.weight_bytes() for layer in self.layers)


def gpt_oss_gguf_config(header) -> dict:
    meta, arch = header.metadata, header.architecture

    key = functools.partial(header_field, meta, arch)

    rope = _rope_parameters(meta, arch, float(key("rope.freq_base", 150000.0)))  # refused before anything else
    tensors = {info.name: info for info in header.tensors}
    layers = int(key("block_count"))
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern")
    if pattern not in (None, 2):
        raise ValueError(f"this {arch} GGUF has attention.sliding_window_pattern {pattern}; radixserve runs "
                         "gpt-oss's alternation (window layers first, every other layer)")
    return dict(
        model_type="gpt_oss", architectures=["GptOssForCausalLM"],
        vocab_size=int(tensors["token_embd.weight"].dims[1]), hidden_size=int(key("embedding_length")),
        num_hidden_layers=layers, num_attention_heads=int(key("attention.head_count")),
        num_key_value_heads=int(key("attention.head_count_kv")), head_dim=int(key("attention.key_length")),
        intermediate_size=int(key("expert_feed_forward_length")), num_local_experts=int(key("expert_count")),
        num_experts_per_tok=int(key("expert_used_count")), sliding_window=int(key("attention.sliding_window")),
        layer_types=["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")), max_position_embeddings=int(key("context_length")),
        rope_parameters=rope,
        attention_bias="blk.0.attn_q.bias" in tensors, tie_word_embeddings="output.weight" not in tensors,
        swiglu_limit=SWIGLU_LIMIT, hidden_act="silu", bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"), dtype="float32",
    )


def _rope_parameters(meta: dict, arch: str, theta: float) -> dict:
    """gpt-oss's RoPE from the header: plain, or YaRN (its factor, original context and betas;
    `truncate` off, as OpenAI's gpt-oss configs set it). Any other scaling, or YaRN with an
    attention or extrapolation factor of its own, is refused rather than run otherwise."""
    kind = meta.get(f"{arch}.rope.scaling.type")
    if kind != "yarn":
        refuse_rope_scaling(meta, arch)
        return {"rope_type": "default", "rope_theta": theta}
    plain_values = (("yarn_attn_factor", (1.0,)), ("yarn_ext_factor", (-1.0, 1.0)), ("yarn_log_multiplier", (0.0,)))
    for name, plain in plain_values:
        value = meta.get(f"{arch}.rope.scaling.{name}")
        if value is not None and float(value) not in plain:
            raise ValueError(f"this {arch} GGUF sets {arch}.rope.scaling.{name} {value:g}, which radixserve does not "
                             f"read; it runs gpt-oss's YaRN (factor, original context, beta_fast, beta_slow)")
    original = meta.get(f"{arch}.rope.scaling.original_context_length")
    if original is None:
        raise ValueError(f"this {arch} GGUF scales RoPE by YaRN without {arch}.rope.scaling.original_context_length")
    return {"rope_type": "yarn", "rope_theta": theta, "factor": float(meta.get(f"{arch}.rope.scaling.factor", 1.0)),
            "original_max_position_embeddings": int(original),
            "beta_fast": float(meta.get(f"{arch}.rope.scaling.yarn_beta_fast", 32.0)),
            "beta_slow": float(meta.get(f"{arch}.rope.scaling.yarn_beta_slow", 1.0)), "truncate": False}

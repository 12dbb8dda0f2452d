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
from radixserve.model.gguf_file import refuse_rope_scaling
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
    def __init__(self, spec: ModelSpec, layer_index: int, mlp: nn.Module):
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
        self.mlp = mlp

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
    # llama.cpp's qwen35 block tensors -> transformers' names under model.layers.N; ssm_a and
    # ssm_dt.bias are whole names (ssm_a holds A = -exp(A_log): the model holds A)
    gguf_layer_names = {
        "attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
        "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
        "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
        "attn_qkv": "linear_attn.in_proj_qkv", "attn_gate": "linear_attn.in_proj_z",
        "ssm_alpha": "linear_attn.in_proj_a", "ssm_beta": "linear_attn.in_proj_b",
        "ssm_conv1d": "linear_attn.conv1d", "ssm_norm": "linear_attn.norm", "ssm_out": "linear_attn.out_proj",
        "ssm_a": "linear_attn.A", "ssm_dt.bias": "linear_attn.dt_bias",
    }
    gguf_model_type = "qwen3_5_text"  # the config a qwen35 GGUF's header converts to (gguf_config)

    @classmethod
    def spec_fields(cls, config) -> dict:
        return {"qk_norm": True}

    def __init__(self, spec: ModelSpec, max_positions: int):
        super().__init__(spec)
        self.embed_tokens = Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(Qwen3_5DecoderLayer(spec, i, self.make_mlp(spec, i)) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.rotary = RotaryEmbedding(replace(spec, head_dim=rotary_dim(spec.hf_config)), max_positions)
        self.lm_head = None if spec.tie_word_embeddings else Linear(spec.hidden_size, spec.vocab_size, bias=False)

    def make_mlp(self, spec: ModelSpec, layer_index: int) -> nn.Module:
        return MLP(spec)

    @classmethod
    def gguf_config(cls, header) -> dict:
        """config.json's fields from a qwen35 / qwen35moe GGUF header (transformers reads no such
        file): the attention from the usual keys, the DeltaNet from the ssm.* keys as llama.cpp's
        converter writes them, the layer kinds from the tensors (a DeltaNet layer has ssm_a)."""
        return qwen3_5_gguf_config(header, cls.gguf_model_type)

    # ---- weights: the GGUF's layout is held (norms 1 + w, A, value heads tiled) --------

    def from_hf_checkpoint(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """As transformers names them (an image-text checkpoint's text tower too; its vision tower
        and multi-token-prediction head left out), converted once to what the model holds, as
        llama.cpp's converter does: q_proj split into q and its output gate, every zero-centered
        norm's weight w held as 1 + w (float32), A = -exp(A_log), value heads tiled."""
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
            elif name.endswith("linear_attn.A_log"):
                out[name.removesuffix("_log")] = self._tiled(name, -t.float().exp())
            else:
                out[name] = self._tiled(name, t)
        return out

    def _tiled(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """A DeltaNet tensor of a transformers checkpoint with its value heads (grouped by key
        head there) in llama.cpp's tiled order."""
        config = self.spec.hf_config
        k_heads, v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        if ".linear_attn." not in name or k_heads == v_heads:
            return t
        per_k, dv, key_dim = v_heads // k_heads, config.linear_value_head_dim, k_heads * config.linear_key_head_dim
        tile = lambda x, dim, size: _tile_heads(x, dim, k_heads, per_k, size)  # noqa: E731
        if name.endswith(("in_proj_qkv.weight", "conv1d.weight")):  # q, k channels, then v's
            return torch.cat((t[:2 * key_dim], tile(t[2 * key_dim:], 0, dv)))
        if name.endswith("in_proj_z.weight"):
            return tile(t, 0, dv)
        if name.endswith(("in_proj_a.weight", "in_proj_b.weight", ".A", ".A_log", ".dt_bias")):
            return tile(t, 0, 1)
        if name.endswith("out_proj.weight"):
            return tile(t, 1, dv)
        return t

    def load_weights(self, tensors: dict[str, torch.Tensor], source: str) -> None:
        """A GGUF's tensors are held as read, but for q_proj (split here into q and its gate) and
        the conv weight (squeezed to [C, L] in the file)."""
        self._source = source
        if source == "gguf":
            tensors = {n: t for name, w in tensors.items() for n, t in self._gguf_tensor(name, w).items()}
        super().load_weights(tensors, source)

    def _gguf_tensor(self, name: str, t):
        if name.endswith("self_attn.q_proj.weight"):
            q, gate = _split_q_gate(t, self.spec.num_heads, self.spec.head_dim)
            return {name: q, name.replace(".q_proj.", ".output_gate."): gate}
        if name.endswith("linear_attn.conv1d.weight") and t.dim() == 2:
            return {name: t.unsqueeze(1)}
        if name.endswith("mlp.shared_expert_gate.weight") and t.dim() == 1:  # [H] where written squeezed
            return {name: t.unsqueeze(0)}
        return {name: t}

    def drop_float_weights(self, names: set[str]) -> None:
        """A quantized q_proj also holds the output gate's rows."""
        gates = {n.replace(".qkv_proj.", ".output_gate.") for n in names if n.endswith("self_attn.qkv_proj.weight")}
        super().drop_float_weights(names | gates)

    def load_quantized(self, weights: dict[str, QuantWeight]) -> None:
        config = self.spec.hf_config
        tiled = config.linear_num_key_heads != config.linear_num_value_heads
        out: dict[str, QuantWeight] = {}
        for name, w in weights.items():
            if getattr(self, "_source", "gguf") == "hf" and tiled and ".linear_attn." in name:
                raise ValueError("a Qwen3.5 with more value heads than key heads is quantized from its GGUF, "
                                 "not at load: use weight_dtype float32 for a transformers checkpoint")
            if name.endswith("self_attn.q_proj.weight"):
                out[name], out[name.replace(".q_proj.", ".output_gate.")] = _split_q_gate(
                    w, self.spec.num_heads, self.spec.head_dim)
            else:
                out[name] = w
        super().load_quantized(out)


def _split_q_gate(t, heads: int, head_dim: int):
    """q_proj's rows are per head [q (head_dim), gate (head_dim)]: the q rows and the gate rows
    (of a float tensor or of a quantized weight, whose rows are whole)."""
    index = torch.arange(heads * 2 * head_dim).reshape(heads, 2, head_dim)
    q_rows, gate_rows = index[:, 0].reshape(-1), index[:, 1].reshape(-1)
    if isinstance(t, QuantWeight):
        return _quant_rows(t, q_rows), _quant_rows(t, gate_rows)
    return t[q_rows].contiguous(), t[gate_rows].contiguous()


def _quant_rows(w: QuantWeight, rows: torch.Tensor) -> QuantWeight:
    return QuantWeight(w.codes[rows].contiguous(), w.scale[rows].contiguous(),
                       None if w.offset is None else w.offset[rows].contiguous(), w.bits, w.group, w.zero, w.kind)


def _tile_heads(t: torch.Tensor, dim: int, k_heads: int, per_k: int, size: int) -> torch.Tensor:
    """Value heads along `dim` from grouped by key head [k0v0, k0v1, k1v0, ...] to tiled [k0v0,
    k1v0, k0v1, ...] (each head `size` long), as llama.cpp's converter reorders them."""
    shape = list(t.shape)
    grouped = t.reshape(*shape[:dim], k_heads, per_k, size, *shape[dim + 1:])
    return grouped.transpose(dim, dim + 1).contiguous().reshape(shape)


def qwen3_5_gguf_config(header, model_type: str) -> dict:
    meta = header.metadata
    arch = header.architecture

    def key(name: str, default=None):
        value = meta.get(f"{arch}.{name}", default)
        if value is None:
            raise ValueError(f"the {arch} GGUF's header lacks {arch}.{name}")
        return value

    refuse_rope_scaling(meta, arch)
    tensors = {info.name: info for info in header.tensors}
    layers = int(key("block_count")) - int(meta.get(f"{arch}.nextn_predict_layers", 0) or 0)
    head_dim = int(key("attention.key_length"))
    v_heads = int(key("ssm.time_step_rank"))
    config = dict(
        model_type=model_type,
        architectures=["Qwen3_5MoeForCausalLM" if model_type == "qwen3_5_moe_text" else "Qwen3_5ForCausalLM"],
        vocab_size=int(tensors["token_embd.weight"].dims[1]),
        hidden_size=int(key("embedding_length")),
        num_hidden_layers=layers,
        num_attention_heads=int(key("attention.head_count")),
        num_key_value_heads=int(key("attention.head_count_kv")),
        head_dim=head_dim,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")),
        max_position_embeddings=int(key("context_length")),
        rope_parameters={"rope_type": "default", "rope_theta": float(key("rope.freq_base", 10000.0)),
                         "partial_rotary_factor": int(key("rope.dimension_count")) / head_dim},
        tie_word_embeddings="output.weight" not in tensors,
        linear_conv_kernel_dim=int(key("ssm.conv_kernel")),
        linear_key_head_dim=int(key("ssm.state_size")),
        linear_num_key_heads=int(key("ssm.group_count")),
        linear_num_value_heads=v_heads,
        linear_value_head_dim=int(key("ssm.inner_size")) // v_heads,
        layer_types=["linear_attention" if f"blk.{i}.ssm_a" in tensors else "full_attention" for i in range(layers)],
        hidden_act="silu",
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        dtype="float32",
    )
    if model_type == "qwen3_5_moe_text":
        config.update(num_experts=int(key("expert_count")), num_experts_per_tok=int(key("expert_used_count")),
                      moe_intermediate_size=int(key("expert_feed_forward_length")),
                      shared_expert_intermediate_size=int(key("expert_shared_feed_forward_length")))
    else:
        config["intermediate_size"] = int(key("feed_forward_length"))
    return config


_SKIPPED = ("model.visual.", "visual.", "mtp.", "model.mtp.")


def _text_tower_name(name: str) -> str | None:
    """model.language_model.X (Qwen3_5ForConditionalGeneration) -> model.X; None: not the text model."""
    if name.startswith(_SKIPPED):
        return None
    if name.startswith("model.language_model."):
        return "model." + name[len("model.language_model."):]
    return name


"""GraniteHybridForCausalLM: IBM's Granite 4.0-H (model_type granitemoehybrid): Mamba2 layers
(model/mamba2.py) beside full-attention layers (`layer_types`: linear_attention /
full_attention; "mamba" / "attention" in older configs, as transformers reads them).

Each layer: x + r * op(input_layernorm(x)), then x + r * (shared MLP + experts)(post norm),
with r the residual_multiplier; the shared MLP is Llama's (its width shared_intermediate_size:
the spec's intermediate_size), the experts (model/moe.py's SparseMoE: top k of the router's
logits, softmax over those k) only where the config has num_local_experts. The embeddings are
scaled by embedding_multiplier, the attention's q.k by attention_multiplier (not head_dim ** -0.5),
the logits divided by logits_scaling. Its attention has no RoPE unless position_embedding_type
is "rope" (Granite 4.0-H's is "nope"). The Mamba2 layers' per-request state lives in the
runner's state pool (execution/recurrent_state.py).
"""

from __future__ import annotations

import functools
import math

import torch
from torch import nn

from radixserve.attention.backend import AttentionBackend, AttentionPlan, plan_for
from radixserve.attention.kv_pool import KVPool
from radixserve.kernels.key_basis import rotate_heads
from radixserve.model.causal_lm import CausalLM
from radixserve.model.gguf_file import header_field, refuse_rope_scaling
from radixserve.model.layers import Embedding, Linear, RMSNorm, RotaryEmbedding, apply_rotary
from radixserve.model.llama import MLP
from radixserve.model.mamba2 import Mamba2Mixer
from radixserve.model.moe import ExpertLoading, SparseMoE
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
        self.shared_mlp = MLP(spec)
        experts = int(getattr(config, "num_local_experts", 0) or 0)
        # top k of the logits, softmax over those k: softmax over all, top k, renormalized
        self.mlp = SparseMoE(spec.hidden_size, config.intermediate_size, experts, config.num_experts_per_tok,
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


class GraniteHybridForCausalLM(ExpertLoading, CausalLM):
    recurrent_layer_types = ("linear_attention",)  # layer_types' recurrent kind: the Mamba2 layers
    # llama.cpp's granitehybrid block tensors -> the names here (ssm_a, ssm_d, ssm_dt.bias whole)
    gguf_layer_names = {
        **CausalLM.gguf_layer_names, "ssm_in": "mamba.in_proj", "ssm_conv1d": "mamba.conv1d",
        "ssm_out": "mamba.out_proj", "ssm_norm": "mamba.norm", "ssm_a": "mamba.A", "ssm_d": "mamba.D",
        "ssm_dt.bias": "mamba.dt_bias", "ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.gate_proj",
        "ffn_up_exps": "mlp.experts.up_proj", "ffn_down_exps": "mlp.experts.down_proj",
        "ffn_gate_shexp": "shared_mlp.gate_proj", "ffn_up_shexp": "shared_mlp.up_proj",
        "ffn_down_shexp": "shared_mlp.down_proj", "ffn_gate": "shared_mlp.gate_proj", "ffn_up": "shared_mlp.up_proj",
        "ffn_down": "shared_mlp.down_proj",
    }

    @classmethod
    def gguf_config(cls, header) -> dict:
        """config.json's fields from a granitehybrid GGUF header (transformers reads no such file),
        as llama.cpp's converter writes them: the multipliers as *_scale, the Mamba2 shape from the
        ssm.* keys, the layer kinds from the tensors (a Mamba2 layer has ssm_a), RoPE only where
        rope.scaling.finetuned says so (Granite 4.0-H has none)."""
        return granite_gguf_config(header)

    @classmethod
    def spec_fields(cls, config) -> dict:
        check_config(config)
        return {"attention_scale": float(config.attention_multiplier),
                "intermediate_size": int(config.shared_intermediate_size)}  # the shared MLP's

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

    def load_weights(self, tensors: dict[str, torch.Tensor], source: str) -> None:
        """A GGUF's tensors are held as read, reshaped where llama.cpp stores another shape:
        A and D [H, 1], the gated norm [groups, inner / groups], the conv squeezed to [C, L]."""
        if source == "gguf":
            tensors = {name: _gguf_shape(name, t) for name, t in tensors.items()}
        super().load_weights(tensors, source)

    # ---- weights: Granite's names onto the modules here (fused q/k/v and gate/up; experts to moe.py) ----

    def from_hf_checkpoint(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """As the modules here hold them: the shared MLP's input_linear split into gate and up,
        the experts named as moe.py takes them, A_log as A = -exp(A_log) (float32)."""
        out: dict[str, torch.Tensor] = {}
        for name, t in tensors.items():
            name = _rename(name)
            if name.endswith(".shared_mlp.input_linear.weight"):  # [gate; up]
                gate, up = t.chunk(2, dim=0)
                out[name.replace(".input_linear.", ".gate_proj.")] = gate
                out[name.replace(".input_linear.", ".up_proj.")] = up
            elif name.endswith(".mamba.A_log"):
                out[name[:-len("A_log")] + "A"] = -torch.exp(t.float())
            else:
                out[name] = t
        return out


def _gguf_shape(name: str, t: torch.Tensor) -> torch.Tensor:
    if name.endswith((".mamba.A", ".mamba.D", ".mamba.norm.weight")):
        return t.reshape(-1)
    if name.endswith(".mamba.conv1d.weight") and t.dim() == 2:
        return t.unsqueeze(1)
    return t


def granite_gguf_config(header) -> dict:
    meta, arch = header.metadata, header.architecture

    key = functools.partial(header_field, meta, arch)

    refuse_rope_scaling(meta, arch)
    tensors = {info.name: info for info in header.tensors}
    layers, hidden = int(key("block_count")), int(key("embedding_length"))
    heads, inner = int(key("ssm.time_step_rank")), int(key("ssm.inner_size"))
    mamba = [f"blk.{i}.ssm_a" in tensors for i in range(layers)]
    first_mamba, first_attn = mamba.index(True) if any(mamba) else 0, mamba.index(False) if not all(mamba) else 0
    attn_heads = int(key("attention.head_count"))
    # head_count_kv is per layer (0 on Mamba2 layers), an array the header scan leaves: the k rows say it
    key_rows = tensors.get(f"blk.{first_attn}.attn_k.weight")
    kv_heads = int(key_rows.dims[1]) // (hidden // attn_heads) if key_rows is not None else attn_heads
    shared = tensors.get("blk.0.ffn_gate_shexp.weight") or tensors.get("blk.0.ffn_gate.weight")
    experts = int(meta.get(f"{arch}.expert_count", 0) or 0)
    return dict(
        model_type="granitemoehybrid", architectures=["GraniteMoeHybridForCausalLM"],
        vocab_size=int(tensors["token_embd.weight"].dims[1]), hidden_size=hidden, num_hidden_layers=layers,
        num_attention_heads=attn_heads, num_key_value_heads=kv_heads,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon")), max_position_embeddings=int(key("context_length")),
        rope_parameters={"rope_type": "default", "rope_theta": float(key("rope.freq_base", 10000.0))},
        position_embedding_type="rope" if meta.get(f"{arch}.rope.scaling.finetuned") else "nope",
        tie_word_embeddings="output.weight" not in tensors,
        layer_types=["mamba" if m else "attention" for m in mamba],
        attention_bias=f"blk.{first_attn}.attn_q.bias" in tensors,
        intermediate_size=int(meta.get(f"{arch}.expert_feed_forward_length") or key("feed_forward_length")),
        shared_intermediate_size=int(shared.dims[1]) if shared is not None else int(key("feed_forward_length")),
        num_local_experts=experts, num_experts_per_tok=int(meta.get(f"{arch}.expert_used_count", 0) or 0),
        mamba_n_heads=heads, mamba_n_groups=int(key("ssm.group_count")), mamba_d_state=int(key("ssm.state_size")),
        mamba_d_conv=int(key("ssm.conv_kernel")), mamba_expand=inner // hidden, mamba_d_head=inner // heads,
        mamba_conv_bias=f"blk.{first_mamba}.ssm_conv1d.bias" in tensors,
        mamba_proj_bias=f"blk.{first_mamba}.ssm_in.bias" in tensors,
        embedding_multiplier=float(meta.get(f"{arch}.embedding_scale", 1.0)),
        attention_multiplier=float(meta.get(f"{arch}.attention.scale", 1.0)),
        residual_multiplier=float(meta.get(f"{arch}.residual_scale", 1.0)),
        logits_scaling=float(meta.get(f"{arch}.logit_scale", 1.0)),
        hidden_act="silu", bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"), dtype="float32",
    )


_RENAMES = (
    (".shared_mlp.output_linear.", ".shared_mlp.down_proj."),
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

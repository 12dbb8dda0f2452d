"""LlamaForCausalLM over a flat batch of tokens: Llama, Mistral, Qwen2 (qkv bias), Qwen3 (q/k norm).

Every op works on [T, ...] rows where T is all the step's tokens from all requests
(prefill chunks and decodes together); only attention needs to know which row belongs
to which request, and it learns that from the step's AttentionPlan. The numerics follow
transformers' implementation op for op (RMSNorm in fp32, rotate-half RoPE) so greedy
outputs match it token for token.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.attention.backend import AttentionBackend, AttentionPlan
from radixserve.attention.kv_pool import KVPool
from radixserve.model.native_decoder import NativeDecoder
from radixserve.kernels.key_basis import rotate_heads
from radixserve.kernels.native_ops import max_rows, rms_norm, rope_, silu_mul, skinny_linear
from radixserve.kernels.onednn_linear import bf16_available, onednn_linear, onednn_linear_bf16
from radixserve.kernels.quant_linear import QuantWeight, concat_rows, quant_linear
from radixserve.model.spec import ModelSpec


# Below this many rows, MKL multiplies faster as weight @ x.T (measured 1.2-1.7x at 8-64 rows).
_SMALL_BATCH_ROWS = 256
# A quantized weight past the integer kernel's rows is dequantized this many features at a time.
_DEQUANT_FEATURES = 4096


@dataclass
class StepRows:
    """Shared by a model's Linear layers: how many rows at the head of this step's batch are
    decodes (single-query rows), which bf16 matmuls leave in float32."""

    decodes: int = 0


class Linear(nn.Linear):
    """nn.Linear through `linear` below; `onednn`, `weight_bf16` and `step` are set for the
    whole model by LlamaForCausalLM.use_onednn_linear and use_bf16_matmuls. A quantized
    layer has `quant` instead of `weight` (None) and multiplies through `quantized_linear`."""

    onednn = True
    weight_bf16: torch.Tensor | None = None  # a bfloat16 copy of weight, for a step's prompt rows
    step: StepRows | None = None
    quant: QuantWeight | None = None

    def reset_parameters(self) -> None:
        """Nothing: every weight is loaded (initializing meta tensors imported torch's compiler
        stack, Triton's 66 MB library with it)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            return quantized_linear(x, self.quant, self.bias, self.onednn)
        if self.weight_bf16 is None or not self.onednn or x.shape[0] <= max_rows():  # float32 only
            return linear(x, self.weight, self.bias, self.onednn)
        decodes = self.step.decodes
        if decodes >= x.shape[0]:
            return linear(x, self.weight, self.bias, self.onednn)
        out = linear(x, self.weight, self.bias, self.onednn, self.weight_bf16)
        if decodes:  # the decode rows again in float32 (cheaper than splitting the product)
            out[:decodes] = linear(x[:decodes], self.weight, self.bias, self.onednn)
        return out


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    onednn: bool = True,
    weight_bf16: torch.Tensor | None = None,
) -> torch.Tensor:
    """x @ weight.T (+ bias): the skinny C kernel for decode-sized float32 batches on CPU,
    oneDNN past its rows (unless `onednn` is off; on bf16 inputs where `weight_bf16` is
    given), else torch's BLAS."""
    out = skinny_linear(x, weight, bias)
    if out is None and onednn and x.shape[0] > max_rows():
        if weight_bf16 is not None:
            out = onednn_linear_bf16(x, weight_bf16, bias)
        if out is None:
            out = onednn_linear(x, weight, bias)
    if out is not None:
        return out
    if x.dim() != 2 or x.shape[0] > _SMALL_BATCH_ROWS or x.device.type != "cpu":
        return F.linear(x, weight, bias)
    out = torch.mm(weight, x.t()).t()
    return out if bias is None else out + bias


def quantized_linear(x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None = None,
                     onednn: bool = True) -> torch.Tensor:
    """x @ weight.T (+ bias) for a quantized weight: the integer kernel up to the rows the
    native decoder takes (so both paths give the same bits), else the weight dequantized a
    slice of features at a time into a reused float32 buffer and multiplied by the float path."""
    if x.dim() == 2 and x.shape[0] <= max(max_rows(), 1):
        out = quant_linear(x, weight, bias)
        if out is not None:
            return out
    n, k = weight.shape
    if n <= _DEQUANT_FEATURES:
        return linear(x, weight.dequantize(out=_dequant_buffer(n, k)), bias, onednn)
    parts = []
    for start in range(0, n, _DEQUANT_FEATURES):
        rows = torch.arange(start, min(n, start + _DEQUANT_FEATURES))
        part_bias = None if bias is None else bias[start:start + _DEQUANT_FEATURES]
        parts.append(linear(x, weight.dequantize(rows, _dequant_buffer(len(rows), k)), part_bias, onednn))
    return torch.cat(parts, dim=-1)


_scratch = threading.local()


def _dequant_buffer(n: int, k: int) -> torch.Tensor:
    """A float32 [n, k] view of this thread's dequantization buffer (grown, never shrunk: a
    fresh allocation of that size page-faults in, which cost as much as the dequantization)."""
    buffer = getattr(_scratch, "buffer", None)
    if buffer is None or buffer.numel() < n * k:
        buffer = _scratch.buffer = torch.empty(n * k, dtype=torch.float32)
    return buffer[: n * k].view(n, k)


class Embedding(nn.Embedding):
    """nn.Embedding whose table may be quantized (`quant`, `weight` then None): the rows
    looked up are dequantized."""

    quant: QuantWeight | None = None

    def reset_parameters(self) -> None:
        """Nothing: every weight is loaded (as Linear.reset_parameters)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.quant is None:
            return super().forward(ids)
        return self.quant.dequantize(ids.reshape(-1)).reshape(*ids.shape, -1)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = rms_norm(x, self.weight, self.eps)  # float32 rows on CPU, in C
        if out is not None:
            return out
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # One op, bit for bit the computation below in float32.
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin for every position up to max_positions, computed once in float32."""

    def __init__(self, spec: ModelSpec, max_positions: int):
        super().__init__()
        self.spec = spec
        if torch.empty(0).device.type == "meta":  # built for real once the model is placed (loader)
            self.register_buffer("cos", torch.empty(max_positions, spec.head_dim), persistent=False)
            self.register_buffer("sin", torch.empty(max_positions, spec.head_dim), persistent=False)
        else:
            self.build(max_positions, None)

    def build(self, max_positions: int, device: torch.device | None) -> None:
        inv_freq, scaling = _rope_inv_freq(self.spec)
        positions = torch.arange(max_positions, dtype=torch.float32, device=device)
        freqs = positions[:, None] * inv_freq.to(device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of every token's position, [T, 1, head_dim], once per step for all layers."""
        return self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    if rope_(q, k, cos, sin):  # float32 on CPU: in place, in C
        return q, k
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, layer_index: int):
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = spec.num_heads
        self.num_kv_heads = spec.num_kv_heads
        self.head_dim = spec.head_dim
        self.q_size = spec.num_heads * spec.head_dim
        self.kv_size = spec.num_kv_heads * spec.head_dim
        self.qkv_proj = Linear(spec.hidden_size, self.q_size + 2 * self.kv_size, bias=spec.qkv_bias)
        self.o_proj = Linear(self.q_size, spec.hidden_size, bias=spec.o_bias)
        self.q_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(spec.head_dim, spec.rms_norm_eps) if spec.qk_norm else None

    def forward(self, x, rope, backend: AttentionBackend, pool: KVPool, plan: AttentionPlan):
        t = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(t, self.num_heads, self.head_dim)
        k = k.reshape(t, self.num_kv_heads, self.head_dim)
        v = v.reshape(t, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, k, *rope)
        if pool.rotate_keys:
            q, k = rotate_heads(q), rotate_heads(k)
        k_cache, v_cache = pool.layer(self.layer_index)
        out = backend.forward(q.contiguous(), k.contiguous(), v.contiguous(), k_cache, v_cache, plan)
        return self.o_proj(out.reshape(t, self.q_size))


class MLP(nn.Module):
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
    def __init__(self, spec: ModelSpec, layer_index: int):
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.self_attn = Attention(spec, layer_index)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.mlp = MLP(spec)

    def forward(self, x, rope, backend: AttentionBackend, pool: KVPool, plan: AttentionPlan):
        x = x + self.self_attn(self.input_layernorm(x), rope, backend, pool, plan)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    def __init__(self, spec: ModelSpec, max_positions: int):
        super().__init__()
        self.spec = spec
        self.embed_tokens = Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(spec, i) for i in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.rotary = RotaryEmbedding(spec, max_positions)
        self.lm_head = None if spec.tie_word_embeddings else Linear(spec.hidden_size, spec.vocab_size, bias=False)
        # Runs a decode step's layers in one C call; set by the runner where its attention
        # backend is the C one (NativeDecoder.for_model), after the weights are loaded.
        self.native: NativeDecoder | None = None
        self.onednn_linear = True
        self.step_rows = StepRows()

    def use_onednn_linear(self, on: bool) -> None:
        """Route float32 CPU matmuls too large for the skinny kernel through oneDNN (on) or
        torch's BLAS (off)."""
        self.onednn_linear = on
        for module in self.modules():
            if isinstance(module, Linear):
                module.onednn = on

    def use_bf16_matmuls(self, on: bool) -> None:
        """Multiply a step's prompt rows, where they take oneDNN (more rows than the skinny
        kernel's), on bfloat16 inputs through a bfloat16 copy of each layer's weights (on; +half
        the layers' weight bytes), or in float32 (off: the copies are dropped). Its decode rows
        (forward's `decodes`) and the logits' matmul stay float32.
        Refused, changing nothing, where it cannot run: float32 CPU weights, oneDNN on, and a
        CPU that multiplies bf16 natively."""
        if on:
            norm = self.norm.weight
            missing = [need for need, ok in (
                ("float32 weights on CPU", norm.dtype == torch.float32 and norm.device.type == "cpu"),
                ("onednn_linear on", self.onednn_linear),
                ("a CPU with native bf16 matmuls in oneDNN (AVX512_BF16 or AMX)", bf16_available()),
            ) if not ok]
            if missing:
                raise ValueError(f"prefill_matmul_dtype bfloat16 needs {'; '.join(missing)}: use float32")
        for module in self.layers.modules():  # not the lm head: the logits stay float32
            if isinstance(module, Linear) and module.quant is None:  # quantized: dequantized to float32
                module.weight_bf16 = module.weight.detach().to(torch.bfloat16).contiguous() if on else None
                module.step = self.step_rows

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        backend: AttentionBackend,
        pool: KVPool,
        plan: AttentionPlan,
        logits_indices: torch.Tensor,
        decodes: int = 0,
    ) -> torch.Tensor:
        """Run the step's tokens; return logits [len(logits_indices), vocab] in float32.
        `plan` is what `backend.prepare` made of the step's metadata; the first `decodes`
        tokens are single-query rows (decodes, drafts), kept float32 under bf16 matmuls."""
        self.step_rows.decodes = decodes
        x = self.embed_tokens(input_ids)
        rope = self.rotary.lookup(positions, x.dtype)
        if self.native is None or not self.native.run(x, *rope, pool, plan):
            for layer in self.layers:
                x = layer(x, rope, backend, pool, plan)
        x = self.norm(x[logits_indices])
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        if head.quant is not None:
            return quantized_linear(x, head.quant, onednn=self.onednn_linear).float().contiguous()
        return linear(x, head.weight, onednn=self.onednn_linear).float().contiguous()

    def quantized_layers(self) -> dict[str, Linear | Embedding]:
        """The modules whose weights a checkpoint may hold quantized, by their weight's name."""
        return {f"{name}.weight": m for name, m in self.named_modules() if isinstance(m, (Linear, Embedding))}

    def drop_float_weights(self, names: set[str]) -> None:
        """Before the model is materialized: the modules of `names` (as quantized_layers names
        them) will hold quantized weights, so their float weight is never allocated."""
        layers = self.quantized_layers()
        for name in names:
            layers[name].weight = None

    def load_quantized(self, weights: dict[str, QuantWeight]) -> None:
        """Quantized weights named as in transformers' checkpoints, q/k/v and gate/up fused
        (their storage made common: kernels/quant_linear.concat_rows)."""
        layers = self.quantized_layers()
        fused: dict[str, dict[str, QuantWeight]] = {}
        for name, weight in weights.items():
            target, part = _map_weight_name(name)
            if target not in layers or layers[target].weight is not None:
                raise ValueError(f"quantized weight {name!r} has no quantized place in the model")
            fused.setdefault(target, {})[part] = weight
        for target, parts in fused.items():
            order = _PART_ORDER.get(target.rsplit(".", 2)[-2], ("all",))
            if set(parts) != set(order):
                raise ValueError(f"{target} needs the parts {order}, the checkpoint has {sorted(parts)}")
            joined = concat_rows([parts[p] for p in order])
            module = layers[target]
            expected = (module.num_embeddings, module.embedding_dim) if isinstance(module, Embedding) else (
                module.out_features, module.in_features)
            if joined.shape != expected:
                raise ValueError(f"quantized weight {target} is {joined.shape}, the model needs {expected}")
            module.quant = joined
        missing = [name for name, m in layers.items() if m.weight is None and m.quant is None]
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} quantized weights, e.g. {missing[:3]}")

    def weight_bytes(self) -> int:
        """Bytes the weights hold: parameters and buffers of the model, and quantized weights."""
        params = sum(p.numel() * p.element_size() for p in self.parameters())
        quant = sum(m.quant.nbytes for m in self.quantized_layers().values() if m.quant is not None)
        bf16 = sum(m.weight_bf16.numel() * 2 for m in self.modules()
                   if isinstance(m, Linear) and m.weight_bf16 is not None)
        return params + quant + bf16

    def load_hf_state_dict(self, tensors: dict[str, torch.Tensor]) -> None:
        """Load weights named as in transformers' checkpoints, fusing q/k/v and gate/up."""
        own = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in tensors.items():
            target, part = _map_weight_name(name)
            if target is None:
                continue
            if target not in own:
                raise ValueError(f"checkpoint weight {name!r} has no place in the model")
            _copy_part(own[target], tensor, part, self.spec)
            loaded.add(f"{target}:{part}")
        missing = [n for n in _expected_parts(own, self.spec) if n not in loaded]
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} weights, e.g. {missing[:3]}")


# ---- weight-name mapping ------------------------------------------------------------

_PART_ORDER = {"qkv_proj": ("q", "k", "v"), "gate_up_proj": ("gate", "up")}

_FUSED = {
    "q_proj": ("qkv_proj", "q"),
    "k_proj": ("qkv_proj", "k"),
    "v_proj": ("qkv_proj", "v"),
    "gate_proj": ("gate_up_proj", "gate"),
    "up_proj": ("gate_up_proj", "up"),
}


def _map_weight_name(name: str) -> tuple[str | None, str]:
    if name.startswith("model."):
        name = name[len("model."):]
    if "rotary_emb" in name:
        return None, ""
    for hf, (ours, part) in _FUSED.items():
        if f".{hf}." in name:
            return name.replace(f".{hf}.", f".{ours}."), part
    return name, "all"


def _part_slice(part: str, spec: ModelSpec) -> slice:
    q = spec.num_heads * spec.head_dim
    kv = spec.num_kv_heads * spec.head_dim
    inter = spec.intermediate_size
    slices = {
        "q": slice(0, q),
        "k": slice(q, q + kv),
        "v": slice(q + kv, q + 2 * kv),
        "gate": slice(0, inter),
        "up": slice(inter, 2 * inter),
    }
    return slices[part]


def _copy_part(param: nn.Parameter, tensor: torch.Tensor, part: str, spec: ModelSpec) -> None:
    dest = param.data if part == "all" else param.data[_part_slice(part, spec)]
    if dest.shape != tensor.shape:
        raise ValueError(f"weight shape {tuple(tensor.shape)} does not fit {tuple(dest.shape)}")
    dest.copy_(tensor.to(dest.dtype))


def _expected_parts(own: dict[str, nn.Parameter], spec: ModelSpec) -> list[str]:
    out = []
    for name in own:
        if "qkv_proj" in name:
            out += [f"{name}:{p}" for p in ("q", "k", "v")]
        elif "gate_up_proj" in name:
            out += [f"{name}:{p}" for p in ("gate", "up")]
        else:
            out.append(f"{name}:all")
    return out


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope_inv_freq(spec: ModelSpec) -> tuple[torch.Tensor, float]:
    config = spec.hf_config
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        dim = spec.head_dim
        return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    if rope_type == "dynamic":
        raise ValueError("dynamic NTK RoPE scaling is not supported")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported RoPE type {rope_type!r}")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    return inv_freq.float(), float(scaling)

"""The layers every model family is built from: Linear (float, bf16 copies, or quantized
weights), Embedding, RMSNorm and RoPE, over a flat batch of rows [T, ...].

The numerics follow transformers op for op (RMSNorm in float32, rotate-half RoPE), so
greedy outputs match it token for token.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.kernels.heap import on_trim
from radixserve.kernels.native_ops import max_rows, rms_norm, rope_, skinny_linear
from radixserve.kernels.onednn_linear import onednn_linear, onednn_linear_bf16
from radixserve.kernels.quant_linear import QuantWeight, best_path, quant_linear
from radixserve.model.spec import ModelSpec


# Below this many rows, MKL multiplies faster as weight @ x.T (measured 1.2-1.7x at 8-64 rows).
_SMALL_BATCH_ROWS = 256
# A quantized weight past the integer kernel's rows is dequantized this many features at a time.
_DEQUANT_FEATURES = 4096
# RoPE tables on CPU start at this many positions and double as steps reach further.
_ROPE_INITIAL = 4096
# Positions a table computes per op: 64 x (head_dim / 2) values stay under torch's grain for
# splitting an op across threads, and are a whole number of vectors (no scalar tail).
_ROPE_CHUNK = 64


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
    integer_prompt = True  # quantized: prompt-sized rows by the integer kernel (CausalLM.use_integer_prompt_matmuls)

    def reset_parameters(self) -> None:
        """Nothing: every weight is loaded (initializing meta tensors imported torch's compiler
        stack, Triton's 66 MB library with it)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            return quantized_linear(x, self.quant, self.bias, self.onednn, self.integer_prompt)
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
                     onednn: bool = True, integer_prompt: bool = True) -> torch.Tensor:
    """x @ weight.T (+ bias) for a quantized weight: the integer kernel up to the rows the
    native decoder takes (so both paths give the same bits), and past them too where
    `integer_prompt` (the same rounding of the activations) for a weight in the lanes layout, or
    a 4-bit one on AVX2 up to _AVX2_INTEGER_ROWS rows; else the
    weight dequantized a slice of features at a time into a reused float32 buffer and
    multiplied by the float path. No rows (the head of a step whose prompt chunks sample
    nothing): no product, nothing dequantized."""
    if x.dim() == 2 and x.shape[0] == 0:
        return x.new_empty(0, weight.shape[0])
    if x.dim() == 2 and (x.shape[0] <= max(max_rows(), 1) or (integer_prompt and _integer_rows(x, weight))):
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


# On AVX2 (one feature a row) the integer kernel's row tiles outrun dequantizing a 4-bit weight
# for sgemm up to here (2 cores, Q4_0 shapes of 1-6k features: 64 rows 43-50 GMAC/s against 23-27,
# 256 rows 39-48 against 46-53, 736 rows 44-52 against 58-64; a 100-token prompt 0.72-0.85x the
# time on the Qwen3.5-0.8B-shaped Q4_0 file and the default Q4_1 model). 8-bit codes keep sgemm:
# their 4-row tiles made Gemma 3's (Q4_K with Q6_K) 100-token prompt 1.15x slower.
_AVX2_INTEGER_ROWS = 128


def _integer_rows(x: torch.Tensor, weight: QuantWeight) -> bool:
    return weight.lanes or (weight.bits == 4 and x.shape[0] <= _AVX2_INTEGER_ROWS and best_path() == "avx2")


_scratch = threading.local()


def _dequant_buffer(n: int, k: int) -> torch.Tensor:
    """A float32 [n, k] view of this thread's dequantization buffer (grown, kept from call to
    call: a fresh allocation of that size page-faults in, which cost as much as the
    dequantization; let go when the engine trims its heap, once idle or every 30 s busy)."""
    buffer = getattr(_scratch, "buffer", None)
    if buffer is None or buffer.numel() < n * k:
        buffer = _scratch.buffer = torch.empty(n * k, dtype=torch.float32)
    return buffer[: n * k].view(n, k)


@on_trim
def _release_dequant_buffer() -> None:
    _scratch.buffer = None


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
    """cos/sin of every position a step reads, from tables computed in float32. `layer_type`
    names the config's per-kind RoPE parameters (Gemma 3: sliding_attention, full_attention).
    The tables hold one half of head_dim: rotate-half RoPE's angles repeat in the other half
    (transformers' cat((freqs, freqs))), so `lookup` repeats the rows a step reads, the same
    values. On CPU the tables cover the positions steps have reached (from _ROPE_INITIAL,
    doubled as longer contexts come, up to max_positions), not the model's whole context:
    Gemma 3's two 32k-position tables would hold 64 MiB resident for contexts few requests
    reach. Elsewhere they are built whole once (a step's position is not read on the host)."""

    def __init__(self, spec: ModelSpec, max_positions: int, layer_type: str | None = None):
        super().__init__()
        self.spec = spec
        self.layer_type = layer_type
        self.max_positions = max_positions
        if torch.empty(0).device.type == "meta":  # built for real once the model is placed (loader)
            rows = min(max_positions, _ROPE_INITIAL)
            self.register_buffer("cos", torch.empty(rows, spec.head_dim // 2), persistent=False)
            self.register_buffer("sin", torch.empty(rows, spec.head_dim // 2), persistent=False)
        else:
            self.build(max_positions, None)

    def build(self, max_positions: int, device: torch.device | None) -> None:
        self.max_positions = max_positions
        on_cpu = device is None or torch.device(device).type == "cpu"
        self._fill(min(max_positions, _ROPE_INITIAL) if on_cpu else max_positions, device)

    def _fill(self, rows: int, device: torch.device | None) -> None:
        """Tables of `rows` positions, _ROPE_CHUNK positions an op: each chunk is one thread's
        whole vector loop, so a position's values are the same bits whatever the table's size
        or the thread count (KV written before the tables grew matches KV written after)."""
        inv_freq, scaling = _rope_inv_freq(self.spec, self.layer_type)
        inv_freq = inv_freq.to(device)[None, :]
        cos = torch.empty(rows, inv_freq.shape[1], dtype=torch.float32, device=device)
        sin = torch.empty_like(cos)
        for start in range(0, rows, _ROPE_CHUNK):
            end = min(rows, start + _ROPE_CHUNK)
            freqs = torch.arange(start, end, dtype=torch.float32, device=device)[:, None] * inv_freq
            cos[start:end] = freqs.cos() * scaling
            sin[start:end] = freqs.sin() * scaling
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def lookup(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of every token's position, [T, 1, head_dim], once per step for all layers."""
        cos, sin = self.tables(positions)
        cos, sin = cos[positions], sin[positions]
        return (torch.cat((cos, cos), dim=-1).unsqueeze(1).to(dtype),
                torch.cat((sin, sin), dim=-1).unsqueeze(1).to(dtype))

    def tables(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The cos and sin tables [rows, head_dim / 2], grown first where they do not yet reach
        every one of `positions` (the native decoder reads a row's angles from them in C)."""
        rows = self.cos.shape[0]
        if rows < self.max_positions and positions.numel() and self.cos.device.type == "cpu":
            need = int(positions.max()) + 1
            if need > rows:
                self._fill(min(self.max_positions, max(need, 2 * rows)), self.cos.device)
        return self.cos, self.sin


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    if rope_(q, k, cos, sin):  # float32 on CPU: in place, in C
        return q, k
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rope_inv_freq(spec: ModelSpec, layer_type: str | None = None) -> tuple[torch.Tensor, float]:
    config = spec.hf_config
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if layer_type is not None:
        params = params[layer_type]
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        dim = spec.head_dim
        return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    if rope_type == "dynamic":
        raise ValueError("dynamic NTK RoPE scaling is not supported")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if hasattr(config, "transformers_config"):  # read back from JSON: transformers computes this variant
        config = config.transformers_config()
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported RoPE type {rope_type!r}")
    extra = {} if layer_type is None else {"layer_type": layer_type}
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu", **extra)
    return inv_freq.float(), float(scaling)

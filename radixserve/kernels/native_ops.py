"""The model's C kernels for float32 on CPU (csrc/, built by native_build.py), each
returning None where it does not apply so that the caller keeps its torch path.

- skinny_linear: x @ weight.T (+ bias) for decode-sized batches. At a few rows a BLAS
  spends as long packing the weight as multiplying by it; the kernel reads the weight
  in its own layout, once, prefetching the next tile's. Measured on the 2-core dev
  machine, cold weights, the default model's matmuls: at 1 row as fast as the weight
  streams, 1.6x MKL at 8 rows, 1.2x at 32, 1.07-1.2x up to 128 (AVX-512 build; the
  AVX2 build stops at 32). Above `max_rows()` (prefill chunks) oneDNN takes over
  (onednn_linear.py), or the BLAS where oneDNN is off.
- rms_norm, rms_norm_heads_, rms_norm_add_, rope_, silu_mul, gelu_tanh_mul, hadamard_heads_: one pass each instead of the several tensor ops (and as
  many dispatches) torch needs; at decode sizes the dispatches were most of their cost.
- delta_rule_step_: a Gated DeltaNet decode token for a batch, each request's state advanced in
  place in the layer's state pool (csrc/delta_rule.c), each state read once and written once.
"""

from __future__ import annotations

import functools
import os

import torch

from radixserve.kernels.native_build import load_kernel

MAX_ROWS = 128  # the most any build takes; max_rows() is this build's own limit


def model_ops_enabled() -> bool:
    """RADIXSERVE_NATIVE_CPU=0 keeps the model's own ops (these kernels) on torch, to
    compare or to rule them out; attention is chosen by the attention backend instead."""
    return os.environ.get("RADIXSERVE_NATIVE_CPU", "1") != "0"


@functools.cache
def _load(name: str):
    """The typed kernel, or None when disabled or not buildable (decided once per process)."""
    return load_kernel(name) if model_ops_enabled() else None


@functools.cache
def _skinny_kernel():
    available = _load("skinny_linear_available")
    if available is None or not available():
        return None  # built without AVX2 + FMA: the BLAS is the better choice
    return _load("skinny_linear_f32")


@functools.cache
def max_rows() -> int:
    """The most rows this build of the kernel takes (where it still beats the BLAS); 0 without it."""
    if _skinny_kernel() is None:
        return 0
    limit = _load("skinny_linear_max_rows")
    return min(MAX_ROWS, limit()) if limit is not None else 32


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """The product by the C kernel, or None where it does not apply."""
    if not (
        x.dim() == 2 and 0 < x.shape[0] <= max_rows() and x.shape[1] % 8 == 0 and _rows_f32(x)
        and _dense_f32(weight) and weight.dim() == 2 and weight.shape[1] == x.shape[1]
        and (bias is None or (_dense_f32(bias) and bias.shape == weight.shape[:1]))
    ):
        return None
    fn = _skinny_kernel()
    if fn is None:
        return None
    rows, features = x.shape[0], weight.shape[0]
    out = torch.empty(rows, features, dtype=torch.float32)
    status = fn(
        x.data_ptr(), rows, x.stride(0), weight.data_ptr(), features, weight.shape[1],
        None if bias is None else bias.data_ptr(), out.data_ptr(), out.stride(0),
    )
    return out if status == 0 else None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """RMSNorm of x's rows [T, dim] by the C kernel, or None where it does not apply."""
    if not (x.dim() == 2 and _rows_f32(x) and _dense_f32(weight) and weight.shape == x.shape[1:]):
        return None
    fn = _load("rms_norm_f32")
    if fn is None:
        return None
    out = torch.empty(x.shape, dtype=torch.float32)
    fn(x.data_ptr(), x.stride(0), weight.data_ptr(), out.data_ptr(), out.stride(0), x.shape[0], x.shape[1], eps)
    return out


def rms_norm_add_(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor, eps: float) -> bool:
    """x += RMSNorm(y) in place, x and y [T, dim] (a residual add of a normalized output), the
    bits of rms_norm then an add; False (x untouched) where the kernel does not apply."""
    if not (x.dim() == 2 and y.shape == x.shape and _rows_f32(x) and _rows_f32(y) and _dense_f32(weight)
            and weight.shape == x.shape[1:]):
        return False
    fn = _load("rms_norm_add_f32")
    if fn is None:
        return False
    fn(x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0), weight.data_ptr(), x.shape[0], x.shape[1], eps)
    return True


def rope_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """Rotate q [T, Hq, D] and k [T, Hk, D] in place with cos, sin [T, 1, D]; False (and
    nothing touched) where the kernel does not apply."""
    tokens, head_dim = q.shape[0], q.shape[-1]
    if not (
        q.dim() == 3 and k.dim() == 3 and k.shape[0] == tokens and k.shape[2] == head_dim and head_dim % 2 == 0
        and all(_rows_f32(t) and t.stride(1) == head_dim for t in (q, k))
        and all(_dense_f32(t) and t.shape == (tokens, 1, head_dim) for t in (cos, sin))
    ):
        return False
    fn = _load("rope_f32")
    if fn is None:
        return False
    fn(q.data_ptr(), q.stride(0), q.shape[1], k.data_ptr(), k.stride(0), k.shape[1],
       cos.data_ptr(), sin.data_ptr(), tokens, head_dim)
    return True


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """silu(gate) * up of gate_up [T, 2n] = [gate | up], or None where it does not apply."""
    return _gated("silu_mul_f32", gate_up)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor | None:
    """gelu_tanh(gate) * up of gate_up [T, 2n] = [gate | up] (Gemma's MLP), or None where it
    does not apply."""
    return _gated("gelu_tanh_mul_f32", gate_up)


def _gated(kernel: str, gate_up: torch.Tensor) -> torch.Tensor | None:
    if not (gate_up.dim() == 2 and gate_up.shape[1] % 2 == 0 and _rows_f32(gate_up)):
        return None
    fn = _load(kernel)
    if fn is None:
        return None
    rows, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, n, dtype=torch.float32)
    fn(gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), rows, n)
    return out


def rms_norm_heads_(x: torch.Tensor, weight: torch.Tensor, eps: float) -> bool:
    """RMSNorm of every head of x [T, H, D] in place (q/k norms); False (x untouched) where the
    kernel does not apply."""
    if not (x.dim() == 3 and _rows_f32(x) and x.stride(1) == x.shape[2] and _dense_f32(weight)
            and weight.shape == x.shape[2:]):
        return False
    fn = _load("rms_norm_heads_f32")
    if fn is None:
        return False
    fn(x.data_ptr(), x.stride(0), x.shape[1], x.shape[0], x.shape[2], weight.data_ptr(), eps)
    return True


def hadamard_heads_(x: torch.Tensor) -> bool:
    """Rotate every head of x [T, H, D] into the Hadamard basis in place (key_basis.py);
    False (x untouched) where the kernel does not apply."""
    if not (x.dim() == 3 and _rows_f32(x) and x.stride(1) == x.shape[2]):
        return False
    fn = _load("hadamard_heads_f32")
    if fn is None:
        return False
    fn(x.data_ptr(), x.stride(0), x.shape[1], x.shape[0], x.shape[2])
    return True


def delta_rule_step_(state: torch.Tensor, slots: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor | None:
    """One token of the gated delta rule for D requests, their states state[slots] [D, H, Dk, Dv]
    advanced in place in the pool; q, k [D, H, Dk], v [D, H, Dv], g, beta [D, H]. Returns o
    [D, H, Dv], or None (nothing touched) where the kernel does not apply."""
    if not (state.dim() == 4 and _dense_f32(state) and slots.dtype == torch.int64 and slots.dim() == 1
            and slots.is_contiguous()):
        return None
    d, (h, dk, dv) = slots.shape[0], state.shape[1:]
    if not (q.shape == k.shape == (d, h, dk) and v.shape == (d, h, dv) and g.shape == beta.shape == (d, h)
            and all(_dense_f32(t) for t in (q, k, v, g, beta))):
        return None
    fn = _load("delta_rule_step_f32")
    if fn is None:
        return None
    out = torch.empty(d, h, dv, dtype=torch.float32)
    if fn(state.data_ptr(), state.shape[0], slots.data_ptr(), d, h, dk, dv, q.data_ptr(), k.data_ptr(), v.data_ptr(),
          g.data_ptr(), beta.data_ptr(), out.data_ptr()):
        raise IndexError(f"a state slot outside the pool's {state.shape[0]}: {slots.tolist()}")
    return out


def _rows_f32(t: torch.Tensor) -> bool:
    """A float32 CPU tensor whose last axis is contiguous (rows may be strided)."""
    return t.dtype == torch.float32 and t.device.type == "cpu" and t.stride(-1) == 1


def _dense_f32(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()

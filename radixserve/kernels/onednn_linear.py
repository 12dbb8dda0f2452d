"""onednn_linear: x @ weight.T (+ bias) in float32 on CPU through oneDNN's matmul, or None
where it does not apply so that the caller keeps torch's F.linear (MKL).

Why: torch sends float32 F.linear to MKL, which on the 2-core dev machine (an AMD EPYC
with AVX-512) runs far below the AVX-512 peak (MKL is known to pick generic paths on
non-Intel CPUs), while oneDNN dispatches on the ISA itself (ONEDNN_VERBOSE: AVX-512).
The default model's prefill matmuls, all 121 of them with cold weights (bench_matmul): on one
host MKL 190-210 GFLOPS, oneDNN 450-490 (512 rows 694 -> 334 ms); on a 2-core Zen 4 MKL ~152,
oneDNN ~185 (512 rows 908 -> 744 ms): the gap depends on the host (docs/kernels.md). At the
few rows of a decode step the skinny C kernel is as fast and runs inside the native
decoder, so this is for the larger steps (prefill chunks, prompt logprobs).

It multiplies by the plain [out, in] weight (mkldnn._linear_pointwise accepts a dense
one): no packed copy, so no second copy of the weights in memory; packing was only ~10%
faster. From two rows up, a row's result does not depend on how many rows share the call
(one row takes another kernel); that holds among calls that all run here, not across the
skinny kernel's steps, whose sums are added in another order.

oneDNN builds (JIT-compiles) a primitive for every distinct shape and keeps it in a
process-wide cache of 1,024: ~7 ms and ~0.3-0.6 MiB each on the dev machine. A server's steps
come in every row count, so the cache grew for hours (issue 45's soak: +100 MiB in 6 minutes).
So a product runs at a bucketed row count: its rows copied into a zero-padded buffer, rounded
up to a multiple of 32, or of an eighth of the power of two at or above it when that is coarser
(at most 1/8 more rows past 256); past 2,048 rows, in tiles of 2,048. A weight's shape then
has at most ~30 primitives. Padding keeps every row's bits (a row's result does not depend on
the other rows, above).

onednn_linear_bf16 is the same product on bfloat16 inputs (rows rounded on the way in, a
bfloat16 copy of the weight made once by the model), float32 sums inside oneDNN, its output
rounded to bfloat16 and widened back, the bias added in float32: ~1.8x the float32 rate where
the CPU multiplies bf16 natively (AVX512_BF16 or AMX), refused elsewhere (oneDNN would
emulate it, slower than float32).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)


@functools.cache
def available() -> bool:
    """oneDNN is built into this torch and its linear agrees with F.linear (decided once)."""
    if not torch.backends.mkldnn.is_available() or not hasattr(torch.ops.mkldnn, "_linear_pointwise"):
        return False
    try:
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(300, 64, generator=generator)
        weight = torch.randn(48, 64, generator=generator)
        bias = torch.randn(48, generator=generator)
        agrees = torch.allclose(_call(x, weight, bias), F.linear(x, weight, bias), rtol=1e-4, atol=1e-4)
    except (RuntimeError, TypeError) as exc:  # an internal op: its signature may change
        log.warning("oneDNN linear unavailable (%s); float32 matmuls stay on torch's BLAS", exc)
        return False
    if not agrees:
        log.warning("oneDNN linear disagrees with F.linear; float32 matmuls stay on torch's BLAS")
    return agrees


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """The product by oneDNN, or None where it does not apply: not float32 rows on CPU with a
    matching dense [out, in] weight and [out] bias, autograd on (the op has no backward),
    oneDNN switched off, or its float32 matmuls set to a lower precision."""
    if not (
        _f32_cpu(x) and x.dim() == 2 and x.shape[0] > 0
        and _f32_cpu(weight) and weight.dim() == 2 and weight.shape[1] == x.shape[1] and weight.is_contiguous()
        and (bias is None or (_f32_cpu(bias) and bias.shape == weight.shape[:1] and bias.is_contiguous()))
        and not torch.is_grad_enabled() and exact_float32() and available()
    ):
        return None
    return _call(x, weight, bias)


@functools.cache
def bf16_available() -> bool:
    """oneDNN multiplies bfloat16 natively on this CPU and agrees with F.linear on the same
    rounded inputs (decided once)."""
    native = _cpu_has("_is_avx512_bf16_supported") or _cpu_has("_is_amx_tile_supported")
    supported = getattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", None)  # an internal op
    if not (available() and native and supported is not None and supported()):
        return False
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(300, 64, generator=generator)
    weight = torch.randn(48, 64, generator=generator).to(torch.bfloat16)
    try:
        out = _call_bf16(x, weight, None)
    except (RuntimeError, TypeError) as exc:
        log.warning("oneDNN bf16 linear unavailable (%s)", exc)
        return False
    expected = F.linear(x.to(torch.bfloat16).float(), weight.float())
    return torch.allclose(out, expected, rtol=2**-7, atol=1e-2)


def onednn_linear_bf16(x: torch.Tensor, weight_bf16: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """x @ weight.T (+ bias) on bf16 inputs (see the module's docstring), float32 out; None
    where it does not apply (as onednn_linear, for bf16 weights)."""
    if not (
        _f32_cpu(x) and x.dim() == 2 and x.shape[0] > 0
        and weight_bf16.dtype == torch.bfloat16 and weight_bf16.device.type == "cpu" and weight_bf16.dim() == 2
        and weight_bf16.shape[1] == x.shape[1] and weight_bf16.is_contiguous()
        and (bias is None or (_f32_cpu(bias) and bias.shape == weight_bf16.shape[:1]))
        and not torch.is_grad_enabled() and torch.backends.mkldnn.enabled and bf16_available()
    ):
        return None
    return _call_bf16(x, weight_bf16, bias)


def exact_float32() -> bool:
    """oneDNN is on and computes float32 matmuls in float32 (not bf16 / tf32); both are
    settings a program can change at any time, so they are read on every call."""
    if not torch.backends.mkldnn.enabled:
        return False
    matmul = getattr(torch.backends.mkldnn, "matmul", None)
    return getattr(matmul, "fp32_precision", "none") in ("none", "ieee")


def _cpu_has(probe: str) -> bool:
    """torch.cpu's probe of a CPU feature (private names: False where this torch lacks one)."""
    return bool(getattr(torch.cpu, probe, lambda: False)())


def _f32_cpu(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 and t.device.type == "cpu"


# Row counts up to this many run as they are (small primitives; decode-sized rows keep their kernel).
_EXACT_ROWS = 32
# Rows past this many run in tiles of this many (the default step budget, max_num_batched_tokens).
_TILE_ROWS = 2048


def row_bucket(rows: int) -> int:
    """The row count a product of `rows` (<= _TILE_ROWS) rows runs at."""
    if rows <= _EXACT_ROWS:
        return rows
    step = max(32, 1 << ((rows - 1).bit_length() - 4))
    return -(-rows // step) * step


def _bucketed(product: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, out_features: int) -> torch.Tensor:
    """product(x) run at bucketed row counts (see the module's docstring)."""
    rows = x.shape[0]
    if rows <= _TILE_ROWS:
        return _padded(product, x)
    out = torch.empty(rows, out_features, dtype=torch.float32)
    for start in range(0, rows, _TILE_ROWS):  # a last tile of one row takes two: one row has its own kernel
        out[start:start + _TILE_ROWS] = _padded(product, x[start:start + _TILE_ROWS], min_rows=2)
    return out


def _padded(product: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, min_rows: int = 1) -> torch.Tensor:
    rows, bucket = x.shape[0], max(min_rows, row_bucket(x.shape[0]))
    if bucket == rows:
        return product(x)
    padded = x.new_empty(bucket, x.shape[1])
    padded[:rows] = x
    padded[rows:] = 0
    return product(padded)[:rows]


def _call(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return _bucketed(lambda rows: torch.ops.mkldnn._linear_pointwise(rows, weight, bias, "none", [], ""),
                     x, weight.shape[0])


def _call_bf16(x: torch.Tensor, weight_bf16: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = _bucketed(lambda rows: torch.ops.mkldnn._linear_pointwise(
        rows.to(torch.bfloat16), weight_bf16, None, "none", [], "").float(), x, weight_bf16.shape[0])
    return out if bias is None else out.add_(bias)

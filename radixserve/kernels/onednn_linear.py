"""onednn_linear: x @ weight.T (+ bias) in float32 on CPU through oneDNN's matmul, or None
where it does not apply so that the caller keeps torch's F.linear (MKL).

Why: torch sends float32 F.linear to MKL, which on the 2-core dev machine (an AMD EPYC
with AVX-512) runs far below the AVX-512 peak (MKL is known to pick generic paths on
non-Intel CPUs), while oneDNN dispatches on the ISA itself (ONEDNN_VERBOSE: AVX-512).
The default model's prefill matmuls: MKL 190-210 GFLOPS, oneDNN 450-490; all 121 of
them with cold weights (bench_matmul), 512 rows 694 -> 334 ms, 256 rows 380 -> 166 ms. At the
few rows of a decode step the skinny C kernel is as fast and runs inside the native
decoder, so this is for the larger steps (prefill chunks, prompt logprobs).

It multiplies by the plain [out, in] weight (mkldnn._linear_pointwise accepts a dense
one): no packed copy, so no second copy of the weights in memory; packing was only ~10%
faster. From two rows up, a row's result does not depend on how many rows share the call
(one row takes another kernel); that holds among calls that all run here, not across the
skinny kernel's steps, whose sums are added in another order.
"""

from __future__ import annotations

import functools
import logging

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


def exact_float32() -> bool:
    """oneDNN is on and computes float32 matmuls in float32 (not bf16 / tf32); both are
    settings a program can change at any time, so they are read on every call."""
    if not torch.backends.mkldnn.enabled:
        return False
    matmul = getattr(torch.backends.mkldnn, "matmul", None)
    return getattr(matmul, "fp32_precision", "none") in ("none", "ieee")


def _f32_cpu(t: torch.Tensor) -> bool:
    return t.dtype == torch.float32 and t.device.type == "cpu"


def _call(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")

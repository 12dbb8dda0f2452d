"""skinny_linear: x @ weight.T (+ bias) for decode-sized batches on CPU, in C
(csrc/skinny_linear.c, built by native_build.py).

At a few rows a BLAS spends as long packing the weight as multiplying by it; the C kernel
reads the weight in its own layout, once. Measured on the 2-core dev machine, cold
weights: 2x MKL at 1 row (the weight read at memory speed), 1.4x at 8 rows, about even
at 32 rows except the wide lm_head (1.4x). Above MAX_ROWS the BLAS wins.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from radixserve.native_build import build_native

MAX_ROWS = 32
_SOURCE = Path(__file__).parent / "csrc" / "skinny_linear.c"
_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


@functools.cache
def _kernel():
    library = build_native(_SOURCE)
    if library is None:
        return None
    fn = library.skinny_linear_f32
    fn.restype = ctypes.c_int
    fn.argtypes = [_PTR, _I64, _I64, _PTR, _I64, _I64, _PTR, _PTR, _I64]
    return fn


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """The product by the C kernel, or None where it does not apply (the caller uses torch)."""
    if not _applies(x, weight, bias):
        return None
    fn = _kernel()
    if fn is None:
        return None
    rows, features = x.shape[0], weight.shape[0]
    out = torch.empty(rows, features, dtype=torch.float32)
    status = fn(
        x.data_ptr(), rows, x.stride(0), weight.data_ptr(), features, weight.shape[1],
        None if bias is None else bias.data_ptr(), out.data_ptr(), out.stride(0),
    )
    return out if status == 0 else None


def _applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    return (
        x.dim() == 2
        and 0 < x.shape[0] <= MAX_ROWS
        and x.dtype == torch.float32
        and weight.dtype == torch.float32
        and x.device.type == "cpu"
        and weight.device.type == "cpu"
        and x.shape[1] % 8 == 0
        and x.stride(1) == 1
        and weight.is_contiguous()
        and (bias is None or (bias.dtype == torch.float32 and bias.is_contiguous() and bias.device.type == "cpu"))
    )

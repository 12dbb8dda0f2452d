"""Triton kernels for paged attention over shared block tables.

    store_kv.store_kv                  scatter a step's new K/V into the pool by slot
    decode_attention.decode_attention  one query token per request (split-K when long)
    extend_attention.extend_attention  prefill chunks over a cached prefix, causal

Each kernel module imports triton, and Triton reads TRITON_INTERPRET when a kernel is
defined, so on a machine without CUDA call `configure_triton(device)` before importing
any of them: the kernels then run in Triton's interpreter on CPU tensors. This package
itself imports neither triton nor the kernel modules.
"""

from __future__ import annotations

import os
import sys

import torch

# Quantized pages' code element types (kernels/quantized_pages.py); the kernels tell them apart by the cache's dtype.
CODE_DTYPES = (torch.int8, torch.float8_e4m3fn)


def configure_triton(device: torch.device | str) -> None:
    """Select Triton's interpreter unless `device` is CUDA. Triton fixes its mode when it
    is first imported, so this must run before anything imports triton."""
    if torch.device(device).type == "cuda":
        return
    os.environ.setdefault("TRITON_INTERPRET", "1")
    if "triton" in sys.modules and not _triton_imported_interpreted():
        raise RuntimeError(
            f"triton was imported in compiled mode, so its kernels cannot run on {device}; "
            "set TRITON_INTERPRET=1 in the environment (or call configure_triton) before importing triton"
        )


def _triton_imported_interpreted() -> bool:
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.zeros, InterpretedFunction)


def interpreting() -> bool:
    """Whether the kernels were (or will be) defined for Triton's interpreter."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_device(*tensors: torch.Tensor) -> None:
    """Compiled kernels need CUDA tensors; interpreted ones need CPU tensors."""
    want = "cpu" if interpreting() else "cuda"
    for t in tensors:
        if t.device.type != want:
            mode = "Triton's interpreter (TRITON_INTERPRET=1)" if want == "cpu" else "compiled Triton"
            raise ValueError(
                f"the kernels were loaded for {mode} and need {want} tensors, got one on {t.device}; "
                "one process runs the kernels on CUDA or in the interpreter, not both"
            )


def check_last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dimension, got strides {tuple(t.stride())}")


def check_cache_pair(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Both caches: one layer's [num_blocks, block_size, num_kv_heads, head_dim] pool."""
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache and v_cache must share a 4-d shape, got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if k_cache.dtype != v_cache.dtype:
        raise ValueError(f"k_cache and v_cache dtypes differ: {k_cache.dtype} vs {v_cache.dtype}")
    check_last_dim_contiguous("k_cache", k_cache)
    check_last_dim_contiguous("v_cache", v_cache)


def check_scales(k_cache: torch.Tensor, k_scales: torch.Tensor | None, v_scales: torch.Tensor | None) -> None:
    """With quantized pages the caches are int8 or float8_e4m3fn codes and the scales float32
    [blocks, block_size, kv_heads] with contiguous heads (views of the pages: kernels/quantized_pages.py)."""
    if k_scales is None and v_scales is None:
        return
    if k_scales is None or v_scales is None or k_cache.dtype not in CODE_DTYPES:
        raise ValueError("quantized pages need int8 or float8_e4m3fn caches and both k_scales and v_scales")
    for name, t in (("k_scales", k_scales), ("v_scales", v_scales)):
        if t.dtype != torch.float32 or t.shape != k_cache.shape[:3] or t.stride(2) != 1:
            raise ValueError(f"{name} must be float32 {tuple(k_cache.shape[:3])} with contiguous heads, got "
                             f"{t.dtype} {tuple(t.shape)} strides {tuple(t.stride())}")


def scale_args(k_cache: torch.Tensor, k_scales: torch.Tensor | None, v_scales: torch.Tensor | None) -> tuple:
    """The scale pointers and strides a kernel takes (the caches themselves, unused, when not quantized)."""
    if k_scales is None:
        return k_cache, k_cache, 0, 0, 0, 0
    return k_scales, v_scales, k_scales.stride(0), k_scales.stride(1), v_scales.stride(0), v_scales.stride(1)


def check_head_dim(head_dim: int) -> None:
    if head_dim < 16 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two >= 16, got {head_dim}")


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs use exact fp32 products (no tf32), so fp32 results match torch closely."""
    return "ieee" if dtype == torch.float32 else "tf32"


def dot_in_fp32(dtype: torch.dtype) -> bool:
    """Triton's interpreter multiplies bf16 tiles wrongly (it reads their raw bits), so
    there the kernels upcast bf16 dot operands; compiled kernels use tensor cores."""
    return interpreting() and dtype == torch.bfloat16


def next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()

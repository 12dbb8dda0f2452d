"""NativeDecodeAttention: the C decode-attention kernel (csrc/paged_decode.c) for CPU.

Pure torch has to gather a request's blocks into a contiguous buffer before attention can
read them, which triples the memory traffic of decode attention; the C kernel reads K/V
in place through the block table, and reads a prefix that neighbouring requests share
once for all of them. Built and loaded by native_build.py; without it the torch backend
keeps its pure-torch path.
"""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

import torch

from radixserve.native_build import build_native

_SOURCE = Path(__file__).parent / "csrc" / "paged_decode.c"
_I64, _F32 = ctypes.c_int64, ctypes.c_float
_PTR = ctypes.c_void_p


class NativeDecodeAttention:
    def __init__(self, library: ctypes.CDLL):
        self._fn = library.paged_decode_attention_f32
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [_PTR, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _F32]

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """q [D, H, d] float32 -> out [D, H, d]; caches [blocks, block_size, kv_heads, d].
        Requests that share leading blocks should be neighbours (they are read once)."""
        _check(q, k_cache, v_cache, block_tables, seq_lens)
        out = torch.empty_like(q)
        status = self._fn(
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
            block_tables.stride(0), seq_lens.data_ptr(), out.data_ptr(), q.shape[0], q.shape[1],
            k_cache.shape[2], k_cache.shape[3], k_cache.shape[1], scale,
        )
        if status:
            raise RuntimeError("native decode attention could not allocate its scratch memory")
        return out


@functools.cache
def load_native_decode() -> NativeDecodeAttention | None:
    """The compiled kernel, or None when it cannot be built here."""
    library = build_native(_SOURCE)
    return None if library is None else NativeDecodeAttention(library)


def _check(q, k_cache, v_cache, block_tables, seq_lens) -> None:
    for name, t, dtype in (
        ("q", q, torch.float32), ("k_cache", k_cache, torch.float32), ("v_cache", v_cache, torch.float32),
        ("block_tables", block_tables, torch.int32), ("seq_lens", seq_lens, torch.int32),
    ):
        if t.device.type != "cpu" or t.dtype != dtype:
            raise ValueError(f"{name} must be a CPU {dtype} tensor, got {t.dtype} on {t.device}")
    if not (q.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous() and seq_lens.is_contiguous()):
        raise ValueError("q, k_cache, v_cache and seq_lens must be contiguous")
    if block_tables.stride(1) != 1:
        raise ValueError("block_tables rows must be contiguous")

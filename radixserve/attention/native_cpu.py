"""NativeDecodeAttention: the C decode-attention kernel (csrc/paged_decode.c) for CPU.

Pure torch has to gather a request's blocks into a contiguous buffer before attention can
read them, which triples the memory traffic of decode attention; the C kernel reads K/V
in place through the block table. It is built on first use with the system C compiler
into the model cache directory (a second or two) and called through ctypes; ctypes drops
the GIL, so a few Python threads split the requests between cores.
When no compiler is available, or RADIXSERVE_NATIVE_CPU=0, the torch backend keeps its
pure-torch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from radixserve.model.default_model import cache_root

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "paged_decode.c"
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fPIC", "-shared"]
_I64, _F32 = ctypes.c_int64, ctypes.c_float
_PTR = ctypes.c_void_p


class NativeDecodeAttention:
    def __init__(self, library: ctypes.CDLL, num_threads: int):
        self._fn = library.paged_decode_attention_f32
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [_PTR, _PTR, _PTR, _PTR, _I64, _PTR, _PTR, _I64, _I64, _I64, _I64, _F32, _I64, _I64]
        self._threads = ThreadPoolExecutor(num_threads, "radixserve-attn") if num_threads > 1 else None
        self._num_threads = num_threads

    def __call__(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_list: list[int],
        scale: float,
    ) -> torch.Tensor:
        """q [D, H, d] float32 -> out [D, H, d]; caches [blocks, block_size, kv_heads, d]."""
        _check(q, k_cache, v_cache, block_tables, seq_lens)
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        out = torch.empty_like(q)
        args = (
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), block_tables.data_ptr(),
            block_tables.stride(0), seq_lens.data_ptr(), out.data_ptr(), q.shape[1], num_kv_heads,
            head_dim, k_cache.shape[1], scale,
        )
        ranges = _balanced_ranges(seq_lens_list, self._num_threads)
        if self._threads is None or len(ranges) == 1:
            results = [self._fn(*args, *r) for r in ranges]
        else:
            results = list(self._threads.map(lambda r: self._fn(*args, *r), ranges))
        if any(results):
            raise RuntimeError("native decode attention could not allocate its scratch memory")
        return out


@functools.cache
def load_native_decode(num_threads: int | None = None) -> NativeDecodeAttention | None:
    """The compiled kernel, or None (logged) when it cannot be built here."""
    if os.environ.get("RADIXSERVE_NATIVE_CPU", "1") == "0":
        return None
    try:
        library = ctypes.CDLL(str(_build()))
    except (OSError, subprocess.CalledProcessError, FileNotFoundError) as exc:
        logger.warning("native CPU decode attention unavailable (%s); using pure torch", exc)
        return None
    return NativeDecodeAttention(library, num_threads or torch.get_num_threads())


def _build() -> Path:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise FileNotFoundError("no C compiler (cc or gcc) on PATH")
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join([compiler, *_FLAGS]).encode() + os.uname().machine.encode())
    target = cache_root() / "kernels" / f"paged_decode-{key.hexdigest()[:16]}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as work:
        built = Path(work) / target.name
        subprocess.run(
            [compiler, *_FLAGS, str(_SOURCE), "-o", str(built), "-lm"],
            check=True, capture_output=True, text=True,
        )
        os.replace(built, target)
    return target


def _balanced_ranges(seq_lens: list[int], parts: int) -> list[tuple[int, int]]:
    """Split the requests into contiguous ranges of about equal total context."""
    total = sum(seq_lens)
    if parts <= 1 or len(seq_lens) < 2:
        return [(0, len(seq_lens))]
    ranges, start, acc = [], 0, 0
    for i, n in enumerate(seq_lens):
        acc += n
        if acc * parts >= total * (len(ranges) + 1) and len(ranges) < parts - 1:
            ranges.append((start, i + 1))
            start = i + 1
    ranges.append((start, len(seq_lens)))
    return [r for r in ranges if r[0] < r[1]]


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

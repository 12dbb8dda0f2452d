"""NativeDecodeAttention: the C decode-attention kernel (csrc/paged_decode.c) for CPU.

Pure torch has to gather a request's blocks into a contiguous buffer before attention can
read them, which triples the memory traffic of decode attention; the C kernel reads K/V
in place through the block table, and reads a prefix that neighbouring requests share
once for all of them. It is built on first use with the system C compiler into the model
cache directory (a second or two) and called through ctypes. It is built with OpenMP,
linked against the libgomp torch has already loaded, so its threads are torch's own
workers (a second thread pool would fight torch's spinning workers for the cores).
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
from pathlib import Path

import torch

from radixserve.model.default_model import cache_root

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "paged_decode.c"
_FLAGS = ["-O3", "-march=native", "-ffast-math", "-fPIC", "-shared"]
_OPENMP = ["-fopenmp"]  # dropped, with a warning, where the compiler has no OpenMP
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
    """The compiled kernel, or None (logged) when it cannot be built here."""
    if os.environ.get("RADIXSERVE_NATIVE_CPU", "1") == "0":
        return None
    try:
        library = ctypes.CDLL(str(_build()))
    except (OSError, subprocess.CalledProcessError, FileNotFoundError) as exc:
        logger.warning("native CPU decode attention unavailable (%s); using pure torch", exc)
        return None
    return NativeDecodeAttention(library)


def _build() -> Path:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise FileNotFoundError("no C compiler (cc or gcc) on PATH")
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join([compiler, *_FLAGS, *_OPENMP]).encode() + os.uname().machine.encode())
    target = cache_root() / "kernels" / f"paged_decode-{key.hexdigest()[:16]}.so"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as work:
        built = Path(work) / target.name
        try:
            _compile(compiler, _OPENMP, built)
        except subprocess.CalledProcessError as exc:
            logger.warning("building the C decode kernel with OpenMP failed (%s); it will use one thread",
                           exc.stderr.strip()[:200])
            _compile(compiler, [], built)
        os.replace(built, target)
    return target


def _compile(compiler: str, extra: list[str], output: Path) -> None:
    subprocess.run(
        [compiler, *_FLAGS, *extra, str(_SOURCE), "-o", str(output), "-lm"],
        check=True, capture_output=True, text=True,
    )


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

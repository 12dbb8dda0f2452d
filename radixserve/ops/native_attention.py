"""NativePagedAttention: the C paged-KV kernels for CPU: store new K/V rows into their
slots and decode attention (csrc/paged_attention.c), and tiled causal attention of prompt
chunks over the pool (csrc/prefill_attention.c); the cpu attention backend's kernels.

Pure torch has to gather a request's blocks into a contiguous buffer before attention can
read them, which triples the memory traffic of decode attention; the C kernel reads K/V
in place through the block table, and reads a prefix that neighbouring requests share
once for all of them. Built, loaded and typed by native_build.py.
"""

from __future__ import annotations

import functools

import torch

from radixserve.ops.native_build import load_kernel


class NativePagedAttention:
    def __init__(self, decode, store, prefill=None):
        self._decode = decode
        self._store = store
        self._prefill = prefill

    @property
    def has_prefill(self) -> bool:
        return self._prefill is not None

    def decode(
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
        status = self._decode(
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[0], block_tables.data_ptr(),
            block_tables.stride(0), block_tables.shape[1], seq_lens.data_ptr(), out.data_ptr(), q.shape[0],
            q.shape[1], k_cache.shape[2], k_cache.shape[3], k_cache.shape[1], scale,
        )
        if status == -2:
            raise ValueError("a context length is < 1 or past its block table, or a block id is outside the pool")
        if status:
            raise RuntimeError("native decode attention could not allocate its scratch memory")
        return out

    def prefill(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        query_start: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        out: torch.Tensor,
    ) -> None:
        """Causal attention of C prompt chunks, written into their rows of out (q's shape,
        [T, H, d] float32): chunk c's queries are q rows query_start[c]:query_start[c + 1]
        (int32 [C + 1]), the last of its context seq_lens[c] (int32 [C]) tokens, all already
        in the caches through block_tables[c]. Other rows of out are left as they are."""
        _check(q, k_cache, v_cache, block_tables, seq_lens, per_query=False)
        if out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous():
            raise ValueError("out must be a contiguous tensor like q")
        if query_start.dtype != torch.int32 or query_start.device.type != "cpu" or not query_start.is_contiguous() \
                or seq_lens.dim() != 1 or query_start.shape != (seq_lens.shape[0] + 1,) \
                or block_tables.shape[0] != seq_lens.shape[0]:
            raise ValueError("query_start needs one int32 entry per chunk and one more, block_tables a row per chunk")
        status = self._prefill(
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[0], block_tables.data_ptr(),
            block_tables.stride(0), block_tables.shape[1], query_start.data_ptr(), seq_lens.data_ptr(),
            seq_lens.shape[0], q.shape[0], out.data_ptr(), q.shape[1], k_cache.shape[2], k_cache.shape[3],
            k_cache.shape[1], scale,
        )
        if status == -2:
            raise ValueError("a chunk's rows are empty, outside q or longer than its context; or its context is "
                             "past its block table, or a block id is outside the pool")
        if status:
            raise RuntimeError("native prefill attention could not allocate its scratch memory")

    def store(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              slots: torch.Tensor) -> bool:
        """Write k, v [T, kv_heads, d] into the caches' flat slots [T] (int64); False (and
        nothing written) where the kernel does not apply; ValueError (nothing written) for
        a slot outside the pool."""
        if k_cache.dim() != 4:
            return False
        row = k_cache.shape[2] * k_cache.shape[3]
        if not (
            all(t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous()
                for t in (k, v, k_cache, v_cache))
            and slots.dtype == torch.int64 and slots.is_contiguous() and slots.device.type == "cpu"
            and k.shape == v.shape and k.numel() == slots.numel() * row and k_cache.shape == v_cache.shape
        ):
            return False
        num_slots = k_cache.shape[0] * k_cache.shape[1]
        if self._store(k.data_ptr(), v.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), slots.data_ptr(),
                       slots.numel(), row, num_slots):
            raise ValueError(f"a slot is outside the pool's {num_slots} slots")
        return True


@functools.cache
def load_native_attention() -> NativePagedAttention | None:
    """The compiled kernels, or None when they cannot be built here."""
    decode, store = load_kernel("paged_decode_attention_f32"), load_kernel("paged_store_f32")
    if decode is None or store is None:
        return None
    return NativePagedAttention(decode, store, load_kernel("paged_prefill_attention_f32"))


def _check(q, k_cache, v_cache, block_tables, seq_lens, per_query: bool = True) -> None:
    for name, t, dtype in (
        ("q", q, torch.float32), ("k_cache", k_cache, torch.float32), ("v_cache", v_cache, torch.float32),
        ("block_tables", block_tables, torch.int32), ("seq_lens", seq_lens, torch.int32),
    ):
        if t.device.type != "cpu" or t.dtype != dtype:
            raise ValueError(f"{name} must be a CPU {dtype} tensor, got {t.dtype} on {t.device}")
    if not (q.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous() and seq_lens.is_contiguous()):
        raise ValueError("q, k_cache, v_cache and seq_lens must be contiguous")
    if block_tables.dim() != 2 or block_tables.stride(1) != 1:
        raise ValueError("block_tables must be a matrix with contiguous rows")
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError("q must be [D, H, d] and the caches [blocks, block_size, kv_heads, d], alike")
    if q.shape[2] != k_cache.shape[3] or q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} does not fit caches {tuple(k_cache.shape)} (head dim, head groups)")
    if per_query and (seq_lens.shape != (q.shape[0],) or block_tables.shape[0] != q.shape[0]):
        raise ValueError("seq_lens and block_tables need one row per query")

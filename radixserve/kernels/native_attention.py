"""NativePagedAttention: the C paged-KV kernels for CPU: store new K/V rows into their
slots and decode attention (csrc/paged_attention.c), and tiled causal attention of prompt
chunks over the pool (csrc/prefill_attention.c); the cpu attention backend's kernels.

Pure torch has to gather a request's blocks into a contiguous buffer before attention can
read them, which triples the memory traffic of decode attention; the C kernel reads K/V
in place through the block table, and reads a prefix that neighbouring requests share
once for all of them. With int8 pages (kernels/quantized_pages.py) the store quantizes and
decode dequantizes each block once per group of query heads, prefill each row as it packs a
tile. With a sliding window both start at the first block a window reaches and never read
the table before it. With attention sinks (gpt-oss: a logit per query head that joins each
softmax's denominator, no value with it) both fold the sink in after a row's last key.
Built, loaded and typed by native_build.py.
"""

from __future__ import annotations

import functools

import torch

from radixserve.kernels.quantized_pages import QuantizedPages
from radixserve.kernels.native_build import load_kernel


class NativePagedAttention:
    def __init__(self, decode, store, decode_i8, store_i8, prefill=None, prefill_i8=None, bf16_available=None):
        self._decode = decode
        self._store = store
        self._decode_i8 = decode_i8
        self._store_i8 = store_i8
        self._prefill = prefill
        self._prefill_i8 = prefill_i8
        self._bf16_available = bf16_available

    @property
    def has_prefill(self) -> bool:
        return self._prefill is not None and self._prefill_i8 is not None

    def has_bf16_prefill(self, head_dim: int) -> bool:
        """Whether prefill can take bf16 dot products at this head_dim: a CPU with AVX512_BF16
        and head_dim a multiple of 32."""
        return self.has_prefill and self._bf16_available is not None and bool(self._bf16_available(head_dim))

    def decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        pages: QuantizedPages | None = None,
        window: int = 0,
        sinks: torch.Tensor | None = None,
        tree_masks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [D, H, d] float32 -> out [D, H, d]; caches [blocks, block_size, kv_heads, d], or
        with `pages` int8 pages [blocks, page_bytes]. Requests that share leading blocks
        should be neighbours (they are read once). window > 0: each row sees its last
        `window` keys, and its table only from the block of the first on. sinks: float32 [H]
        attention-sink logits, or None. tree_masks: int64 [D] draft-tree masks
        (attention/metadata.py), or None."""
        masks = _masks_ptr(tree_masks, q.shape[0])
        if pages is not None:
            return self._decode_pages(q, k_cache, v_cache, block_tables, seq_lens, scale, pages, window, sinks, masks)
        _check(q, k_cache, v_cache, block_tables, seq_lens)
        out = torch.empty_like(q)
        status = self._decode(
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[0], block_tables.data_ptr(),
            block_tables.stride(0), block_tables.shape[1], seq_lens.data_ptr(), out.data_ptr(), q.shape[0],
            q.shape[1], k_cache.shape[2], k_cache.shape[3], k_cache.shape[1], scale, max(window, 0),
            _sinks_ptr(sinks, q.shape[1]), masks,
        )
        _raise_for(status)
        return out

    def _decode_pages(self, q, k_pages, v_pages, block_tables, seq_lens, scale, pages: QuantizedPages,
                      window: int, sinks: torch.Tensor | None, masks: int | None) -> torch.Tensor:
        _check_pages(q, k_pages, v_pages, block_tables, seq_lens, pages)
        out = torch.empty_like(q)
        status = self._decode_i8(
            q.data_ptr(), k_pages.data_ptr(), v_pages.data_ptr(), k_pages.shape[0], pages.page_bytes,
            pages.code_bytes, block_tables.data_ptr(), block_tables.stride(0), block_tables.shape[1],
            seq_lens.data_ptr(), out.data_ptr(), q.shape[0], q.shape[1], pages.num_kv_heads, pages.head_dim,
            pages.block_size, scale, max(window, 0), _sinks_ptr(sinks, q.shape[1]), masks,
        )
        _raise_for(status)
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
        pages: QuantizedPages | None = None,
        bf16: bool = False,
        window: int = 0,
        sinks: torch.Tensor | None = None,
    ) -> None:
        """Causal attention of C prompt chunks, written into their rows of out (q's shape,
        [T, H, d] float32, contiguous; q's token rows may be strided, as views of the fused qkv
        rows are): chunk c's queries are q rows query_start[c]:query_start[c + 1]
        (int32 [C + 1]), the last of its context seq_lens[c] (int32 [C]) tokens, all already
        in the caches (or int8 `pages`) through block_tables[c]. Other rows of out are left as they are.
        bf16: q.k and P.V take their inputs rounded to bfloat16 (float32 sums and softmax);
        only where has_bf16_prefill(head_dim). window > 0: each row sees its last `window`
        keys, and a chunk's table is read from the block of its first row's first key on.
        sinks: float32 [H] attention-sink logits, or None."""
        if pages is None:
            _check(q, k_cache, v_cache, block_tables, seq_lens, per_query=False, strided_q=True)
        else:
            _check_pages(q, k_cache, v_cache, block_tables, seq_lens, pages, per_query=False, strided_q=True)
        if out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous():
            raise ValueError("out must be a contiguous tensor like q")
        if query_start.dtype != torch.int32 or query_start.device.type != "cpu" or not query_start.is_contiguous() \
                or seq_lens.dim() != 1 or query_start.shape != (seq_lens.shape[0] + 1,) \
                or block_tables.shape[0] != seq_lens.shape[0]:
            raise ValueError("query_start needs one int32 entry per chunk and one more, block_tables a row per chunk")
        tables = (block_tables.data_ptr(), block_tables.stride(0), block_tables.shape[1], query_start.data_ptr(),
                  seq_lens.data_ptr(), seq_lens.shape[0], q.shape[0], out.data_ptr(), q.shape[1])
        rows = (q.data_ptr(), q.stride(0))
        if pages is None:
            status = self._prefill(*rows, k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[0], *tables,
                                   k_cache.shape[2], k_cache.shape[3], k_cache.shape[1], scale, int(bf16),
                                   max(window, 0), _sinks_ptr(sinks, q.shape[1]))
        else:
            status = self._prefill_i8(*rows, k_cache.data_ptr(), v_cache.data_ptr(), k_cache.shape[0],
                                      pages.page_bytes, pages.code_bytes, *tables, pages.num_kv_heads, pages.head_dim,
                                      pages.block_size, scale, int(bf16), max(window, 0),
                                      _sinks_ptr(sinks, q.shape[1]))
        if status == -3:
            raise ValueError(f"bf16 prompt attention needs a CPU with AVX512_BF16 and a head_dim that is a "
                             f"multiple of 32 (head_dim {q.shape[2]})")
        if status == -2:
            raise ValueError("a chunk's rows are empty, outside q or longer than its context; or its context is "
                             "past its block table, or a block id is outside the pool")
        if status:
            raise RuntimeError("native prefill attention could not allocate its scratch memory")

    def store(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              slots: torch.Tensor, pages: QuantizedPages | None = None) -> bool:
        """Write k, v [T, kv_heads, d] (token rows strided alike, or dense) into the caches'
        flat slots [T] (int64); False (and nothing written) where the kernel does not apply;
        ValueError (nothing written) for a slot outside the pool. With `pages` the caches are
        int8 pages and k, v are quantized."""
        if pages is not None:
            return self._store_pages(k, v, k_cache, v_cache, slots, pages)
        if k_cache.dim() != 4:
            return False
        row = k_cache.shape[2] * k_cache.shape[3]
        if not (
            all(t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous() for t in (k_cache, v_cache))
            and _kv_rows(k, v, k_cache.shape[2:])
            and slots.dtype == torch.int64 and slots.is_contiguous() and slots.device.type == "cpu"
            and k.shape[0] == slots.numel() and k_cache.shape == v_cache.shape
        ):
            return False
        num_slots = k_cache.shape[0] * k_cache.shape[1]
        if self._store(k.data_ptr(), v.data_ptr(), k.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                       slots.data_ptr(), slots.numel(), row, num_slots):
            raise ValueError(f"a slot is outside the pool's {num_slots} slots")
        return True

    def _store_pages(self, k, v, k_pages, v_pages, slots, pages: QuantizedPages) -> bool:
        if not (
            _kv_rows(k, v, (pages.num_kv_heads, pages.head_dim))
            and all(_is_pages(t, pages) for t in (k_pages, v_pages)) and k_pages.shape == v_pages.shape
            and slots.dtype == torch.int64 and slots.is_contiguous() and slots.device.type == "cpu"
            and k.shape[0] == slots.numel()
        ):
            return False
        num_slots = k_pages.shape[0] * pages.block_size
        if self._store_i8(k.data_ptr(), v.data_ptr(), k.stride(0), k_pages.data_ptr(), v_pages.data_ptr(),
                          slots.data_ptr(),
                          slots.numel(), pages.num_kv_heads, pages.head_dim, pages.block_size, pages.page_bytes,
                          pages.code_bytes, num_slots):
            raise ValueError(f"a slot is outside the pool's {num_slots} slots")
        return True


@functools.cache
def load_native_attention() -> NativePagedAttention | None:
    """The compiled kernels, or None when they cannot be built here."""
    names = ("paged_decode_attention_f32", "paged_store_f32", "paged_decode_attention_i8", "paged_store_i8")
    kernels = [load_kernel(name) for name in names]
    if None in kernels:
        return None
    return NativePagedAttention(*kernels, load_kernel("paged_prefill_attention_f32"),
                                load_kernel("paged_prefill_attention_i8"), load_kernel("paged_prefill_bf16_available"))


def _sinks_ptr(sinks: torch.Tensor | None, num_heads: int) -> int | None:
    """The address the kernels read a layer's sink logits at (None: no sinks)."""
    return _vector_ptr(sinks, "sinks", torch.float32, num_heads)


def _masks_ptr(masks: torch.Tensor | None, rows: int) -> int | None:
    """The address the decode kernel reads the rows' draft-tree masks at (None: none)."""
    return _vector_ptr(masks, "tree_masks", torch.int64, rows)


def _vector_ptr(t: torch.Tensor | None, name: str, dtype: torch.dtype, n: int) -> int | None:
    """A contiguous CPU `dtype` [n] tensor's address for a kernel (None: none given)."""
    if t is None:
        return None
    if not (t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous() and t.shape == (n,)):
        kind = str(dtype).removeprefix("torch.")
        raise ValueError(f"{name} must be a contiguous CPU {kind} [{n}] tensor, got {t.dtype} "
                         f"{tuple(t.shape)} on {t.device}")
    return t.data_ptr()


def _raise_for(status: int) -> None:
    if status == -2:
        raise ValueError("a context length is < 1 or past its block table, a tree mask's highest bit is past its "
                         "row's context, or a block id is outside the pool")
    if status:
        raise RuntimeError("native decode attention could not allocate its scratch memory")


def _kv_rows(k: torch.Tensor, v: torch.Tensor, row: tuple[int, int]) -> bool:
    """k and v float32 CPU [T, kv_heads, d] of `row`'s shape, heads dense within a token row,
    token rows the same number of floats apart in both."""
    return all(t.dtype == torch.float32 and t.device.type == "cpu" and t.dim() == 3 and tuple(t.shape[1:]) == tuple(row)
               and t.stride(2) == 1 and t.stride(1) == row[1] and t.stride(0) >= row[0] * row[1] for t in (k, v)) \
        and k.shape[0] == v.shape[0] and k.stride(0) == v.stride(0)


def _q_layout(q: torch.Tensor, strided: bool) -> bool:
    """q contiguous, or where `strided`, [T, H, d] with heads dense within each token row."""
    if q.is_contiguous():
        return True
    return strided and q.dim() == 3 and q.stride(2) == 1 and q.stride(1) == q.shape[2] and q.stride(0) >= q.shape[1] * q.shape[2]


def _is_pages(t: torch.Tensor, pages: QuantizedPages) -> bool:
    return (t.dtype == torch.uint8 and t.device.type == "cpu" and t.is_contiguous() and t.dim() == 2
            and t.shape[1] == pages.page_bytes)


def _check_pages(q, k_pages, v_pages, block_tables, seq_lens, pages: QuantizedPages, per_query: bool = True,
                 strided_q: bool = False) -> None:
    if not (_is_pages(k_pages, pages) and _is_pages(v_pages, pages) and k_pages.shape == v_pages.shape):
        raise ValueError(f"int8 pages must be contiguous CPU uint8 [blocks, {pages.page_bytes}], alike")
    for name, t, dtype in (("q", q, torch.float32), ("block_tables", block_tables, torch.int32),
                           ("seq_lens", seq_lens, torch.int32)):
        if t.device.type != "cpu" or t.dtype != dtype:
            raise ValueError(f"{name} must be a CPU {dtype} tensor, got {t.dtype} on {t.device}")
    if not (_q_layout(q, strided_q) and seq_lens.is_contiguous()) or block_tables.dim() != 2 \
            or block_tables.stride(1) != 1:
        raise ValueError("q and seq_lens must be contiguous (q's token rows may be strided in prefill), "
                         "block_tables a matrix with contiguous rows")
    if q.dim() != 3 or q.shape[2] != pages.head_dim or q.shape[1] % pages.num_kv_heads:
        raise ValueError(f"q {tuple(q.shape)} does not fit pages of {pages.num_kv_heads} KV heads x {pages.head_dim}")
    if per_query and (seq_lens.shape != (q.shape[0],) or block_tables.shape[0] != q.shape[0]):
        raise ValueError("seq_lens and block_tables need one row per query")


def _check(q, k_cache, v_cache, block_tables, seq_lens, per_query: bool = True, strided_q: bool = False) -> None:
    for name, t, dtype in (
        ("q", q, torch.float32), ("k_cache", k_cache, torch.float32), ("v_cache", v_cache, torch.float32),
        ("block_tables", block_tables, torch.int32), ("seq_lens", seq_lens, torch.int32),
    ):
        if t.device.type != "cpu" or t.dtype != dtype:
            raise ValueError(f"{name} must be a CPU {dtype} tensor, got {t.dtype} on {t.device}")
    if not (_q_layout(q, strided_q) and k_cache.is_contiguous() and v_cache.is_contiguous()
            and seq_lens.is_contiguous()):
        raise ValueError("q, k_cache, v_cache and seq_lens must be contiguous (q's token rows may be strided in "
                         "prefill)")
    if block_tables.dim() != 2 or block_tables.stride(1) != 1:
        raise ValueError("block_tables must be a matrix with contiguous rows")
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError("q must be [D, H, d] and the caches [blocks, block_size, kv_heads, d], alike")
    if q.shape[2] != k_cache.shape[3] or q.shape[1] % k_cache.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} does not fit caches {tuple(k_cache.shape)} (head dim, head groups)")
    if per_query and (seq_lens.shape != (q.shape[0],) or block_tables.shape[0] != q.shape[0]):
        raise ValueError("seq_lens and block_tables need one row per query")

"""Prefix-extend attention: a prefill chunk's new tokens over the request's whole context.

A request's new K/V are already in the pool (store_kv runs first), so the kernel reads
the cached prefix and the new tokens alike through the block table: a prefix that came
from the radix cache, possibly shared with other requests, is never copied or
recomputed. The new token at context position p attends to positions 0..p; with a sliding
window W, to p - W + 1..p, and a program's walk starts at its first row's first key (no
block-table entry before it is read).

One program serves BLOCK_M query tokens of one request for one query head, walking the
context BLOCK_N tokens at a time up to its last row's position, with an online softmax
in fp32. A query head's attention sink (gpt-oss) joins each row's (m, l) after its last key.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.kernels.triton import (
    check_cache_pair,
    check_device,
    check_head_dim,
    check_last_dim_contiguous,
    check_scales,
    dot_in_fp32,
    dot_precision,
    scale_args,
)
from radixserve.kernels.triton.decode_attention import check_sinks, dequantized, gather_context, softmax_with_sinks
from radixserve.kernels.triton.paged_tile import load_paged_rows, online_softmax_step

_LOG2E = 1.4426950408889634


@triton.jit
def _extend_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, out_ptr, block_tables_ptr, query_start_ptr,
    seq_lens_ptr, sinks_ptr,
    scale_log2e, window,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    stride_ksb, stride_kss, stride_vsb, stride_vss,
    stride_bt,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr, QUANTIZED: tl.constexpr, WINDOWED: tl.constexpr,
    SINKS: tl.constexpr,
):
    m_block = tl.program_id(0)
    req = tl.program_id(1).to(tl.int64)
    head = tl.program_id(2)
    q_start = tl.load(query_start_ptr + req)
    q_len = tl.load(query_start_ptr + req + 1) - q_start
    if m_block * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    prefix_len = seq_len - q_len
    kv_head = head // GROUP

    rows = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < q_len
    positions = prefix_len + rows
    tokens = (q_start + rows).to(tl.int64)
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + tokens[:, None] * stride_qt + head * stride_qh + d[None, :], mask=row_mask[:, None], other=0.0)
    if DOT_IN_FP32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    table = block_tables_ptr + req * stride_bt
    # Rows past q_len sit at positions >= seq_len; every row sees position 0, so no row is all
    # -inf (under a window a row may be, in the tiles before its window: MAY_BE_EMPTY).
    kv_end = tl.minimum(seq_len, prefix_len + (m_block + 1) * BLOCK_M)
    kv_start = 0
    if WINDOWED:
        kv_start = tl.maximum(prefix_len + m_block * BLOCK_M - window + 1, 0)
    for tile in range(kv_start, kv_end, BLOCK_N):
        n = tile + tl.arange(0, BLOCK_N)
        n_mask = n < kv_end
        k = load_paged_rows(
            k_cache_ptr, k_scale_ptr, table, n, n_mask, d, kv_head, stride_kcb, stride_kcs, stride_kch,
            stride_ksb, stride_kss, BLOCK_SIZE, QUANTIZED,
        ).to(q.dtype)
        if DOT_IN_FP32:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2e
        visible = (n[None, :] <= positions[:, None]) & n_mask[None, :]
        if WINDOWED:
            visible = visible & (n[None, :] > positions[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        v = load_paged_rows(
            v_cache_ptr, v_scale_ptr, table, n, n_mask, d, kv_head, stride_vcb, stride_vcs, stride_vch,
            stride_vsb, stride_vss, BLOCK_SIZE, QUANTIZED,
        ).to(q.dtype)
        m_i, l_i, acc = online_softmax_step(m_i, l_i, acc, s, v, DOT_PRECISION, DOT_IN_FP32, WINDOWED)

    if SINKS:  # a row that saw no key (m -inf) gets 0: keep = exp2(-inf) = 0
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
        top = tl.maximum(m_i, sink)
        keep = tl.exp2(m_i - top)
        out = acc * (keep / (l_i * keep + tl.exp2(sink - top)))[:, None]
    else:
        if WINDOWED:
            l_i = tl.where(l_i > 0, l_i, 1.0)  # rows past q_len may see no key of the window
        out = acc / l_i[:, None]
    dst = out_ptr + tokens[:, None] * stride_ot + head * stride_oh + d[None, :]
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])


def _check(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out, k_scales, v_scales) -> None:
    check_cache_pair(k_cache, v_cache)
    check_scales(k_cache, k_scales, v_scales)
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    check_head_dim(head_dim)
    if q.dim() != 3 or q.shape[2] != head_dim or q.shape[1] % num_kv_heads:
        raise ValueError(f"q must be [T, k*{num_kv_heads}, {head_dim}], got {tuple(q.shape)}")
    if k_scales is None and q.dtype != k_cache.dtype:
        raise ValueError(f"q dtype {q.dtype} must equal the cache dtype {k_cache.dtype}")
    batch = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    if seq_lens.dim() != 1 or seq_lens.dtype != torch.int32:
        raise ValueError(f"seq_lens must be int32 [B], got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    if query_start_loc.shape != (batch + 1,) or query_start_loc.dtype != torch.int32:
        raise ValueError(f"query_start_loc must be int32 [B+1={batch + 1}], got {query_start_loc.dtype} {tuple(query_start_loc.shape)}")
    if block_tables.dim() != 2 or block_tables.shape[0] != batch or block_tables.dtype != torch.int32:
        raise ValueError(f"block_tables must be int32 [B={batch}, max_blocks], got {block_tables.dtype} {tuple(block_tables.shape)}")
    if block_tables.stride(1) != 1 or query_start_loc.stride(0) != 1:
        raise ValueError("block_tables rows and query_start_loc must be contiguous")
    if out.shape != q.shape or out.dtype != q.dtype:
        raise ValueError(f"out must match q ({tuple(q.shape)}, {q.dtype}), got {tuple(out.shape)}, {out.dtype}")
    check_last_dim_contiguous("q", q)
    check_last_dim_contiguous("out", out)
    check_device(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out)


def _tiles(q: torch.Tensor) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps)."""
    if q.device.type != "cuda":
        return 16, 16, 4
    return (128, 64, 8) if q.shape[2] <= 64 else (64, 64, 4)


def extend_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    max_query_len: int | None = None,
    out: torch.Tensor | None = None,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    window: int = 0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each request's new tokens over its paged context (window > 0:
    each over its last `window` keys only; sinks: [num_heads] attention-sink logits).

    Request i's queries are rows query_start_loc[i]:query_start_loc[i+1] of q
    ([T, num_heads, head_dim]); they are the last q_len of its seq_lens[i] context
    positions, whose K/V (prefix and new tokens) are all in k_cache/v_cache
    ([num_blocks, block_size, num_kv_heads, head_dim]) through block_tables[i] (int32).
    Only those rows of `out` (like q; zeros when not given) are written; it is returned.
    max_query_len (the longest chunk) sizes the grid without a device sync. With
    k_scales/v_scales the caches are the codes of quantized pages (as in decode_attention).
    """
    out = torch.zeros_like(q) if out is None else out
    _check(q, k_cache, v_cache, block_tables, query_start_loc, seq_lens, out, k_scales, v_scales)
    check_sinks(sinks, q)
    batch = seq_lens.shape[0]
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads = k_cache.shape[2]
    if batch == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_start_loc[1:] - query_start_loc[:-1]).max())
    block_m, block_n, num_warps = _tiles(q)
    grid = (triton.cdiv(max_query_len, block_m), batch, num_heads)
    k_sp, v_sp, *scale_strides = scale_args(k_cache, k_scales, v_scales)
    _extend_kernel[grid](
        q, k_cache, v_cache, k_sp, v_sp, out, block_tables, query_start_loc, seq_lens,
        q if sinks is None else sinks, scale * _LOG2E, max(window, 0),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        *scale_strides,
        block_tables.stride(0),
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_M=block_m, BLOCK_N=block_n,
        DOT_PRECISION=dot_precision(q.dtype), DOT_IN_FP32=dot_in_fp32(q.dtype), QUANTIZED=k_scales is not None,
        WINDOWED=window > 0, SINKS=sinks is not None, num_warps=num_warps, num_stages=2,
    )
    return out


def extend_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    max_query_len: int | None = None,
    out: torch.Tensor | None = None,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    window: int = 0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """extend_attention in plain torch (fp32 math), one request at a time."""
    out = torch.zeros_like(q) if out is None else out
    group = q.shape[1] // k_cache.shape[2]
    k_cache, v_cache = dequantized(k_cache, k_scales), dequantized(v_cache, v_scales)
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        start, end = starts[i], starts[i + 1]
        if start == end:
            continue
        first = max(seq_len - (end - start) - window + 1, 0) if window > 0 else 0
        keys = gather_context(k_cache, block_tables[i], seq_len, first).repeat_interleave(group, dim=1)
        values = gather_context(v_cache, block_tables[i], seq_len, first).repeat_interleave(group, dim=1)
        positions = torch.arange(seq_len - (end - start), seq_len, device=q.device)
        j = torch.arange(first, seq_len, device=q.device)[None, :]
        visible = (j <= positions[:, None]) & ((j > positions[:, None] - window) if window > 0 else True)
        scores = torch.einsum("thd,nhd->htn", q[start:end].float(), keys.float()) * scale
        probs = softmax_with_sinks(scores.masked_fill(~visible, float("-inf")), sinks)
        out[start:end] = torch.einsum("htn,nhd->thd", probs, values.float()).to(out.dtype)
    return out

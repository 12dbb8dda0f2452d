"""Paged decode attention: one query token per request over its block table.

One program serves one (request, KV head) pair and all the query heads that read that
KV head (padded to 16 rows for tl.dot), so each K/V row is read once per step whatever
the query/KV head ratio. It walks the context BLOCK_N tokens at a time, mapping each
token to its physical block through the block table (any block size), with an online
softmax in fp32.

When requests x KV heads are too few to fill the GPU, the context is also split
(flash-decoding): each of `num_splits` programs per (request, KV head) covers one slice,
writes its normalised partial output and log-sum-exp, and a second kernel merges them.

With a sliding window W the keys are the last W of the context: the walk (and the splits)
cover [seq_len - W, seq_len) only, and no block-table entry before it is read.

With attention sinks (gpt-oss: a logit per query head in each softmax's denominator, no
value with it) the sink joins a row's (m, l) after its last key, or the splits' merge.

With draft-tree masks (attention/metadata.py) a row with a nonzero mask sees the slots before
its tree's base and, from the base on, those whose bit is set; its window counts positions.
An ordinary row reads as a tree whose base is its length, so one code path serves both.
"""

from __future__ import annotations

import functools

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
    next_power_of_2,
    scale_args,
)
from radixserve.kernels.triton.paged_tile import load_paged_rows, online_softmax_step

_LOG2E = 1.4426950408889634
_MIN_TILES_PER_SPLIT = 4
_MAX_SPLITS = 64
_PROGRAMS_PER_SM = 8


@triton.jit
def _popcount(x):
    """Set bits of each uint64 lane (SWAR), as int32."""
    x = x - ((x >> 1) & 0x5555555555555555)
    x = (x & 0x3333333333333333) + ((x >> 2) & 0x3333333333333333)
    x = (x + (x >> 4)) & 0x0F0F0F0F0F0F0F0F
    return ((x * 0x0101010101010101) >> 56).to(tl.int32)


@triton.jit
def _bit_length(x):
    """The position of the highest set bit plus one (0 for 0), as int32."""
    x = x | (x >> 1)
    x = x | (x >> 2)
    x = x | (x >> 4)
    x = x | (x >> 8)
    x = x | (x >> 16)
    x = x | (x >> 32)
    return _popcount(x)


@triton.jit
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr, seq_lens_ptr,
    out_ptr, part_out_ptr, part_lse_ptr, sinks_ptr, masks_ptr,
    scale_log2e, num_splits, window,
    stride_qb, stride_qh, stride_ob, stride_oh,
    stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs, stride_vch,
    stride_ksb, stride_kss, stride_vsb, stride_vss,
    stride_bt,
    stride_pob, stride_poh, stride_pos, stride_plb, stride_plh,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr, QUANTIZED: tl.constexpr, WINDOWED: tl.constexpr,
    SINKS: tl.constexpr, TREE: tl.constexpr,
):
    req = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + req)
    first = 0
    if WINDOWED:
        first = tl.maximum(seq_len - window, 0)
    if TREE:
        tree = tl.load(masks_ptr + req).to(tl.uint64, bitcast=True)
        base = seq_len - _bit_length(tree)  # seq_len for an ordinary row: every key before it
        if WINDOWED:
            first = tl.minimum(tl.maximum(base + _popcount(tree) - window, 0), base)
    if SPLIT:
        # Every split of a request covers the same whole number of tiles; late ones may be empty.
        split_len = tl.cdiv(tl.cdiv(seq_len - first, num_splits), BLOCK_N) * BLOCK_N
        start = first + split * split_len
        end = tl.minimum(start + split_len, seq_len)
    else:
        start = first
        end = seq_len

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP + g
    head_mask = g < GROUP
    q = tl.load(q_ptr + req * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=head_mask[:, None], other=0.0)
    if DOT_IN_FP32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)
    table = block_tables_ptr + req * stride_bt
    for tile in range(start, end, BLOCK_N):
        n = tile + tl.arange(0, BLOCK_N)
        n_mask = n < end
        k = load_paged_rows(
            k_cache_ptr, k_scale_ptr, table, n, n_mask, d, kv_head, stride_kcb, stride_kcs, stride_kch,
            stride_ksb, stride_kss, BLOCK_SIZE, QUANTIZED,
        ).to(q.dtype)
        if DOT_IN_FP32:
            k = k.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2e
        seen = n_mask
        if TREE:
            j = tl.minimum(tl.maximum(n - base, 0), 63).to(tl.uint64)
            tail = tree >> j
            ancestor = (tail & 1) != 0
            if WINDOWED:
                ancestor = ancestor & (_popcount(tail) <= window)
            seen = n_mask & ((n < base) | ancestor)
        s = tl.where(seen[None, :], s, float("-inf"))
        v = load_paged_rows(
            v_cache_ptr, v_scale_ptr, table, n, n_mask, d, kv_head, stride_vcb, stride_vcs, stride_vch,
            stride_vsb, stride_vss, BLOCK_SIZE, QUANTIZED,
        ).to(q.dtype)
        m_i, l_i, acc = online_softmax_step(m_i, l_i, acc, s, v, DOT_PRECISION, DOT_IN_FP32, False)

    # An empty split has l_i == 0 and acc == 0: write a zero output with weight exp2(-inf) = 0.
    if SINKS and not SPLIT:  # (split: the merge takes the sink)
        sink = tl.load(sinks_ptr + heads, mask=head_mask, other=0.0).to(tl.float32) * 1.4426950408889634
        top = tl.maximum(m_i, sink)
        keep = tl.exp2(m_i - top)
        out = acc * (keep / (l_i * keep + tl.exp2(sink - top)))[:, None]
    else:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    if SPLIT:
        part = part_out_ptr + req * stride_pob + heads[:, None] * stride_poh + split * stride_pos + d[None, :]
        tl.store(part, out, mask=head_mask[:, None])
        # A non-empty split has l_i >= 1 (its max scores 1); an empty one has m_i = -inf.
        lse = m_i + tl.log2(tl.maximum(l_i, 1.0))
        tl.store(part_lse_ptr + req * stride_plb + heads * stride_plh + split, lse, mask=head_mask)
    else:
        dst = out_ptr + req * stride_ob + heads[:, None] * stride_oh + d[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=head_mask[:, None])


@triton.jit
def _merge_splits_kernel(
    part_out_ptr, part_lse_ptr, out_ptr, sinks_ptr, num_splits,
    stride_pob, stride_poh, stride_pos, stride_plb, stride_plh, stride_ob, stride_oh,
    HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, SINKS: tl.constexpr,
):
    req = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, HEAD_DIM)
    s_mask = s < num_splits
    lse = tl.load(part_lse_ptr + req * stride_plb + head * stride_plh + s, mask=s_mask, other=float("-inf"))
    top = tl.max(lse, 0)  # the first split is never empty, so the max is finite
    if SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
        top = tl.maximum(top, sink)
    weight = tl.exp2(lse - top)
    total = tl.sum(weight, 0)
    if SINKS:
        total += tl.exp2(sink - top)
    part = part_out_ptr + req * stride_pob + head * stride_poh + s[:, None] * stride_pos + d[None, :]
    partial = tl.load(part, mask=s_mask[:, None], other=0.0)
    out = tl.sum(partial * weight[:, None], 0) / total
    tl.store(out_ptr + req * stride_ob + head * stride_oh + d, out.to(out_ptr.dtype.element_ty))


def _check(q, k_cache, v_cache, block_tables, seq_lens, out, k_scales, v_scales) -> None:
    check_cache_pair(k_cache, v_cache)
    check_scales(k_cache, k_scales, v_scales)
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    check_head_dim(head_dim)
    if q.dim() != 3 or q.shape[2] != head_dim or q.shape[1] % num_kv_heads:
        raise ValueError(f"q must be [B, k*{num_kv_heads}, {head_dim}], got {tuple(q.shape)}")
    if k_scales is None and q.dtype != k_cache.dtype:
        raise ValueError(f"q dtype {q.dtype} must equal the cache dtype {k_cache.dtype}")
    batch = q.shape[0]
    if block_tables.dim() != 2 or block_tables.shape[0] != batch or block_tables.dtype != torch.int32:
        raise ValueError(f"block_tables must be int32 [B={batch}, max_blocks], got {block_tables.dtype} {tuple(block_tables.shape)}")
    if block_tables.stride(1) != 1:
        raise ValueError("block_tables rows must be contiguous")
    if seq_lens.shape != (batch,) or seq_lens.dtype != torch.int32:
        raise ValueError(f"seq_lens must be int32 [B={batch}], got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    if out.shape != q.shape or out.dtype != q.dtype:
        raise ValueError(f"out must match q ({tuple(q.shape)}, {q.dtype}), got {tuple(out.shape)}, {out.dtype}")
    check_last_dim_contiguous("q", q)
    check_last_dim_contiguous("out", out)
    check_device(q, k_cache, v_cache, block_tables, seq_lens, out)


def _block_n(q: torch.Tensor) -> int:
    if q.device.type != "cuda":
        return 32
    return 128 if q.shape[2] <= 64 else 64


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _choose_num_splits(q: torch.Tensor, num_kv_heads: int, max_seq_len: int, block_n: int) -> int:
    """Split long contexts until there are enough programs to keep every SM busy."""
    if q.device.type != "cuda":
        return 1
    programs = q.shape[0] * num_kv_heads
    wanted = triton.cdiv(_PROGRAMS_PER_SM * _num_sms(q.device), programs)
    useful = triton.cdiv(max_seq_len, _MIN_TILES_PER_SPLIT * block_n)
    return max(1, min(wanted, useful, _MAX_SPLITS))


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    window: int = 0,
    sinks: torch.Tensor | None = None,
    tree_masks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of one query token per request over its paged context (window > 0: its
    last `window` keys only, the table read from the block of the first of them on; sinks:
    [num_heads] attention-sink logits, each joining its head's softmax denominator;
    tree_masks: int64 [B] draft-tree masks, attention/metadata.py).

    q: [B, num_heads, head_dim]; k_cache/v_cache: [num_blocks, block_size, num_kv_heads,
    head_dim]; block_tables: int32 [B, max_blocks]; seq_lens: int32 [B], each >= 1 (the
    query is the context's last token, so it sees all seq_lens[i] positions).
    max_seq_len (the largest seq_len, to size the split without a device sync) and
    num_splits (force the split-K path with that many splits; 1 = single pass) only
    change scheduling, never the result. Writes into and returns `out` (like q). With
    k_scales/v_scales ([num_blocks, block_size, num_kv_heads] float32) the caches are the
    int8 or float8_e4m3fn codes of quantized pages, dequantized as they are loaded.
    """
    out = torch.empty_like(q) if out is None else out
    _check(q, k_cache, v_cache, block_tables, seq_lens, out, k_scales, v_scales)
    check_sinks(sinks, q)
    if tree_masks is not None and (tree_masks.shape != (q.shape[0],) or tree_masks.dtype != torch.int64
                                   or tree_masks.device != q.device):
        raise ValueError(f"tree_masks must be int64 [{q.shape[0]}] on {q.device}, got {tree_masks.dtype} "
                         f"{tuple(tree_masks.shape)} on {tree_masks.device}")
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if batch == 0:
        return out
    block_n = _block_n(q)
    if num_splits is None:
        longest = int(seq_lens.max()) if max_seq_len is None else max_seq_len
        num_splits = _choose_num_splits(q, num_kv_heads, min(longest, window) if window > 0 else longest, block_n)
    group = num_heads // num_kv_heads
    split = num_splits > 1
    if split:
        part_out = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused
    k_sp, v_sp, *scale_strides = scale_args(k_cache, k_scales, v_scales)
    _decode_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, k_sp, v_sp, block_tables, seq_lens,
        out, part_out, part_lse, q if sinks is None else sinks, seq_lens if tree_masks is None else tree_masks,
        scale * _LOG2E, num_splits, max(window, 0),
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        *scale_strides,
        block_tables.stride(0),
        part_out.stride(0), part_out.stride(1), part_out.stride(2) if split else 0,
        part_lse.stride(0), part_lse.stride(1),
        GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=k_cache.shape[1],
        BLOCK_G=max(16, next_power_of_2(group)), BLOCK_N=block_n, SPLIT=split,
        DOT_PRECISION=dot_precision(q.dtype), DOT_IN_FP32=dot_in_fp32(q.dtype), QUANTIZED=k_scales is not None,
        WINDOWED=window > 0, SINKS=sinks is not None, TREE=tree_masks is not None, num_warps=4, num_stages=2,
    )
    if split:
        _merge_splits_kernel[(batch, num_heads)](
            part_out, part_lse, out, q if sinks is None else sinks, num_splits,
            part_out.stride(0), part_out.stride(1), part_out.stride(2),
            part_lse.stride(0), part_lse.stride(1), out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_S=next_power_of_2(num_splits), SINKS=sinks is not None,
            num_warps=1 if head_dim <= 64 else 2,
        )
    return out


def decode_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    *,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
    window: int = 0,
    sinks: torch.Tensor | None = None,
    tree_masks: torch.Tensor | None = None,
) -> torch.Tensor:
    """decode_attention in plain torch (fp32 math), one request at a time; a draft-tree row's
    keys listed one by one from its mask (attention/metadata.py)."""
    out = torch.empty_like(q) if out is None else out
    group = q.shape[1] // k_cache.shape[2]
    k_cache, v_cache = dequantized(k_cache, k_scales), dequantized(v_cache, v_scales)
    trees = [0] * q.shape[0] if tree_masks is None else [m % (1 << 64) for m in tree_masks.tolist()]
    for i, seq_len in enumerate(seq_lens.tolist()):
        keys, values = _row_context(k_cache, v_cache, block_tables[i], seq_len, trees[i], window)
        keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[i].float(), keys.float()) * scale
        out[i] = torch.einsum("hn,nhd->hd", softmax_with_sinks(scores, sinks), values.float()).to(out.dtype)
    return out


def _row_context(k_cache, v_cache, table, seq_len: int, tree: int, window: int):
    """The K and V rows one decode row sees, [n, kv_heads, head_dim] each, listed slot by slot."""
    if not tree:
        first = max(seq_len - window, 0) if window > 0 else 0
        return gather_context(k_cache, table, seq_len, first), gather_context(v_cache, table, seq_len, first)
    base = seq_len - tree.bit_length()
    position = base + bin(tree).count("1") - 1
    first = max(0, position + 1 - window) if window > 0 else 0
    slots = list(range(first, base)) + [base + j for j in range(64) if tree >> j & 1
                                         and (window <= 0 or bin(tree >> j).count("1") <= window)]
    block_size = k_cache.shape[1]
    blocks = table[[s // block_size for s in slots]].long()
    offsets = torch.tensor([s % block_size for s in slots])
    return k_cache[blocks, offsets], v_cache[blocks, offsets]


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """softmax over the last dim of scores [H, ..., n]; with sinks [H], each head's sink
    logit joins the denominator (one more column, dropped after the softmax)."""
    if sinks is None:
        return scores.softmax(-1)
    column = sinks.float().view(-1, *([1] * (scores.dim() - 1))).expand(*scores.shape[:-1], 1)
    return torch.cat([scores, column], dim=-1).softmax(-1)[..., :-1]


def check_sinks(sinks: torch.Tensor | None, q: torch.Tensor) -> None:
    if sinks is not None and (sinks.shape != (q.shape[1],) or not sinks.is_contiguous()
                              or sinks.device != q.device or not sinks.is_floating_point()):
        raise ValueError(f"sinks must be a contiguous float [{q.shape[1]}] tensor on {q.device}, got "
                         f"{sinks.dtype} {tuple(sinks.shape)} on {sinks.device}")


def dequantized(cache: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    """The cache as values: itself, or its codes times their per-token-head scales."""
    return cache if scales is None else cache.float() * scales[..., None]


def gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int, first: int = 0) -> torch.Tensor:
    """Tokens [first, length) of one request's context: [length - first, num_kv_heads, head_dim],
    from the table entries of those tokens' blocks only."""
    block_size = cache.shape[1]
    blocks = block_table[first // block_size : triton.cdiv(length, block_size)].long()
    start = first - first // block_size * block_size
    return cache[blocks].flatten(0, 1)[start : start + length - first]

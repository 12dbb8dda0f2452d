"""Device helpers shared by the paged attention kernels: load one tile of K or V rows
through a block table (dequantizing int8 or fp8 pages in registers), and fold one tile of
scores into an online softmax."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_paged_rows(cache_ptr, scale_ptr, table, n, n_mask, d, kv_head, stride_block, stride_slot, stride_head,
                    stride_scale_block, stride_scale_slot, BLOCK_SIZE: tl.constexpr, QUANTIZED: tl.constexpr):
    """Rows [len(n), head_dim] of one KV head for context positions n (0 where masked),
    each found at block table[n // BLOCK_SIZE], slot n % BLOCK_SIZE. QUANTIZED: the cache
    holds int8 or float8e4nv codes (the pointer's type says which) and scale_ptr their float32
    scales ([blocks, block_size, kv_heads]); the rows come back dequantized, in fp32 (both
    code types convert to fp32 exactly)."""
    block = tl.load(table + n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
    slot = n % BLOCK_SIZE
    rows = cache_ptr + block * stride_block + slot * stride_slot + kv_head * stride_head
    if QUANTIZED:
        codes = tl.load(rows[:, None] + d[None, :], mask=n_mask[:, None], other=0.0)
        scales = tl.load(scale_ptr + block * stride_scale_block + slot * stride_scale_slot + kv_head,
                         mask=n_mask, other=0.0)
        values = codes.to(tl.float32) * scales[:, None]
    else:
        values = tl.load(rows[:, None] + d[None, :], mask=n_mask[:, None], other=0.0)
    return values  # one return: compiled Triton types every return a function has, taken or not


@triton.jit
def online_softmax_step(m_i, l_i, acc, s, v, DOT_PRECISION: tl.constexpr, DOT_IN_FP32: tl.constexpr,
                        MAY_BE_EMPTY: tl.constexpr):
    """Fold scores s (log2 domain, -inf where masked) and their V rows into the running
    max m_i, sum l_i and output acc (all fp32). MAY_BE_EMPTY: a row may have seen only -inf
    so far (a sliding window it has not reached yet); it then stays at m -inf, l 0, acc 0."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    shift = m_new
    if MAY_BE_EMPTY:
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # exp2(-inf - 0) = 0, not exp2(nan)
    alpha = tl.exp2(m_i - shift)
    p = tl.exp2(s - shift[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    p = p.to(v.dtype)
    if DOT_IN_FP32:
        p = p.to(tl.float32)
        v = v.to(tl.float32)
    acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc

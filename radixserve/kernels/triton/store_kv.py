"""store_kv: scatter a step's new K and V rows into one layer's paged pool.

Token t goes to flat slot slot_mapping[t] (block = slot // block_size, offset =
slot % block_size); a negative slot means "do not store" (padding tokens). With int8 pages
each token's head is quantized as it is written (kernels/int8_pages.py: scale = max|x| / 127,
codes rounded half away from zero), codes into the cache and the scale beside them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.kernels.int8_pages import quantize
from radixserve.kernels.triton import (
    check_cache_pair,
    check_device,
    check_last_dim_contiguous,
    check_scales,
    next_power_of_2,
    scale_args,
)


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch,
    stride_vcb, stride_vcs, stride_vch,
    stride_ksb, stride_kss, stride_vsb, stride_vss,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, INT8: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.arange(0, BLOCK_H)[:, None]
    dims = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
    k = tl.load(k_ptr + token * stride_kt + heads * stride_kh + dims, mask=mask)
    v = tl.load(v_ptr + token * stride_vt + heads * stride_vh + dims, mask=mask)
    k_dst = k_cache_ptr + block * stride_kcb + offset * stride_kcs + heads * stride_kch + dims
    v_dst = v_cache_ptr + block * stride_vcb + offset * stride_vcs + heads * stride_vch + dims
    if INT8:
        head_mask = tl.arange(0, BLOCK_H) < NUM_KV_HEADS
        k, k_scale = _quantize(tl.where(mask, k, 0.0))
        v, v_scale = _quantize(tl.where(mask, v, 0.0))
        tl.store(k_scale_ptr + block * stride_ksb + offset * stride_kss + tl.arange(0, BLOCK_H), k_scale, mask=head_mask)
        tl.store(v_scale_ptr + block * stride_vsb + offset * stride_vss + tl.arange(0, BLOCK_H), v_scale, mask=head_mask)
    tl.store(k_dst, k, mask=mask)
    tl.store(v_dst, v, mask=mask)


@triton.jit
def _quantize(x):
    """Rows x [heads, dims] -> int8 codes and one scale per row (masked entries are 0)."""
    x = x.to(tl.float32)
    amax = tl.max(tl.abs(x), 1)
    inv = tl.where(amax > 0, 127.0 * (1.0 / tl.where(amax > 0, amax, 1.0)), 0.0)
    y = x * inv[:, None]
    c = tl.minimum(tl.floor(tl.abs(y) + 0.5), 127.0)
    return tl.where(y < 0, -c, c).to(tl.int8), amax * (1.0 / 127.0)


def _check(k, v, k_cache, v_cache, slot_mapping, k_scales, v_scales) -> None:
    check_cache_pair(k_cache, v_cache)
    check_scales(k_cache, k_scales, v_scales)
    if k.dim() != 3 or k.shape != v.shape or k.shape[1:] != k_cache.shape[2:]:
        raise ValueError(
            f"k and v must be [T, num_kv_heads, head_dim] matching the cache's {tuple(k_cache.shape[2:])}, "
            f"got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if k_scales is None and (k.dtype != k_cache.dtype or v.dtype != v_cache.dtype):
        raise ValueError(f"k/v dtype {k.dtype} must equal the cache dtype {k_cache.dtype}")
    if slot_mapping.dim() != 1 or slot_mapping.shape[0] != k.shape[0] or slot_mapping.dtype != torch.int64:
        raise ValueError(f"slot_mapping must be int64 [T={k.shape[0]}], got {slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    check_last_dim_contiguous("k", k)
    check_last_dim_contiguous("v", v)
    check_device(k, v, k_cache, v_cache, slot_mapping)


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
) -> None:
    """Write k[t] and v[t] ([T, num_kv_heads, head_dim]) into k_cache/v_cache
    ([num_blocks, block_size, num_kv_heads, head_dim]) at flat slot slot_mapping[t]; with
    k_scales/v_scales ([num_blocks, block_size, num_kv_heads] float32) the caches are int8
    codes and each token's heads are quantized."""
    _check(k, v, k_cache, v_cache, slot_mapping, k_scales, v_scales)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    block_size = k_cache.shape[1]
    k_sp, v_sp, *scale_strides = scale_args(k_cache, k_scales, v_scales)
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, k_sp, v_sp, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        *scale_strides,
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_H=next_power_of_2(num_kv_heads), BLOCK_D=next_power_of_2(head_dim), INT8=k_scales is not None,
        num_warps=1 if num_kv_heads * head_dim <= 512 else 4,
    )


def store_kv_reference(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
) -> None:
    """store_kv in plain torch."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    if k_scales is not None:
        blocks, offsets = slots // k_cache.shape[1], slots % k_cache.shape[1]
        for x, cache, scales in ((k, k_cache, k_scales), (v, v_cache, v_scales)):
            cache[blocks, offsets], scales[blocks, offsets] = quantize(x[keep])
        return
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k[keep])
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v[keep])

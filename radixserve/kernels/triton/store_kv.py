"""store_kv: scatter a step's new K and V rows into one layer's paged pool.

Token t goes to flat slot slot_mapping[t] (block = slot // block_size, offset =
slot % block_size); a negative slot means "do not store" (padding tokens).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.kernels.triton import (
    check_cache_pair,
    check_device,
    check_last_dim_contiguous,
    next_power_of_2,
)


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch,
    stride_vcb, stride_vcs, stride_vch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
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
    tl.store(k_dst, k, mask=mask)
    tl.store(v_dst, v, mask=mask)


def _check(k, v, k_cache, v_cache, slot_mapping) -> None:
    check_cache_pair(k_cache, v_cache)
    if k.dim() != 3 or k.shape != v.shape or k.shape[1:] != k_cache.shape[2:]:
        raise ValueError(
            f"k and v must be [T, num_kv_heads, head_dim] matching the cache's {tuple(k_cache.shape[2:])}, "
            f"got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if k.dtype != k_cache.dtype or v.dtype != v_cache.dtype:
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
) -> None:
    """Write k[t] and v[t] ([T, num_kv_heads, head_dim]) into k_cache/v_cache
    ([num_blocks, block_size, num_kv_heads, head_dim]) at flat slot slot_mapping[t]."""
    _check(k, v, k_cache, v_cache, slot_mapping)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    block_size = k_cache.shape[1]
    _store_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_H=next_power_of_2(num_kv_heads), BLOCK_D=next_power_of_2(head_dim),
        num_warps=1 if num_kv_heads * head_dim <= 512 else 4,
    )


def store_kv_reference(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """store_kv in plain torch."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k[keep])
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v[keep])

"""store_kv: scatter a step's new K and V rows into one layer's paged pool.

Token t goes to flat slot slot_mapping[t] (block = slot // block_size, offset =
slot % block_size); a negative slot means "do not store" (padding tokens). With quantized
pages each token's head is quantized as it is written (kernels/quantized_pages.py: scale =
max|x| / qmax), codes into the cache and the scale beside them: int8 codes rounded half away
from zero, fp8 e4m3 codes rounded to nearest even from the float32 bits (_e4m3_bits), not by
Triton's cast, so that the bytes are torch's on every GPU and in the interpreter (whose cast
flushes subnormals and rounds ties up).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.kernels.quantized_pages import code_of_dtype, quantize
from radixserve.kernels.triton import (
    check_cache_pair,
    check_device,
    check_last_dim_contiguous,
    check_scales,
    next_power_of_2,
    scale_args,
)


# The CODE of a plain cache, of int8 codes, of float8_e4m3fn codes.
_PLAIN, _INT8, _FP8 = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


@triton.jit
def _store_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr, slot_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kcb, stride_kcs, stride_kch,
    stride_vcb, stride_vcs, stride_vch,
    stride_ksb, stride_kss, stride_vsb, stride_vss,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, CODE: tl.constexpr,
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
    if CODE != _PLAIN:
        head_mask = tl.arange(0, BLOCK_H) < NUM_KV_HEADS
        k, k_scale = _quantize(tl.where(mask, k, 0.0), CODE)
        v, v_scale = _quantize(tl.where(mask, v, 0.0), CODE)
        tl.store(k_scale_ptr + block * stride_ksb + offset * stride_kss + tl.arange(0, BLOCK_H), k_scale, mask=head_mask)
        tl.store(v_scale_ptr + block * stride_vsb + offset * stride_vss + tl.arange(0, BLOCK_H), v_scale, mask=head_mask)
    tl.store(k_dst, k, mask=mask)
    tl.store(v_dst, v, mask=mask)


@triton.jit
def _quantize(x, CODE: tl.constexpr):
    """Rows x [heads, dims] -> codes and one scale per row (masked entries are 0)."""
    if CODE == _INT8:
        qmax = 127.0
    else:
        qmax = 448.0
    x = x.to(tl.float32)
    amax = tl.max(tl.abs(x), 1)
    inv = tl.where(amax > 0, qmax * (1.0 / tl.where(amax > 0, amax, 1.0)), 0.0)
    y = x * inv[:, None]
    if CODE == _INT8:
        c = tl.minimum(tl.floor(tl.abs(y) + 0.5), 127.0)
        codes = tl.where(y < 0, -c, c).to(tl.int8)
    else:
        codes = _e4m3_bits(tl.minimum(tl.maximum(y, -448.0), 448.0)).to(tl.float8e4nv, bitcast=True)
    return codes, amax * (1.0 / qmax)


@triton.jit
def _e4m3_bits(y):
    """float32 y, |y| <= 448 -> its float8_e4m3fn byte (uint8), round to nearest even, sign of zero kept."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = tl.abs(y)
    a_bits = a.to(tl.int32, bitcast=True)
    # Normal: drop 20 of float32's 23 mantissa bits with ties to even (a carry moves into the
    # exponent), then rebias the exponent from 127 to 7 (120 << 3 = 960).
    normal = ((a_bits + 0x7FFFF + ((a_bits >> 20) & 1)) >> 20) - 960
    # Below 2^-6 the code is a subnormal: round(a * 2^9), ties to even by adding 2^23 (exact:
    # a * 2^9 < 8); 8 is the smallest normal's code, so the two ranges meet.
    subnormal = ((a * 512.0 + 8388608.0) - 8388608.0).to(tl.int32)
    return (sign | tl.where(a < 0.015625, subnormal, normal)).to(tl.uint8)


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
    k_scales/v_scales ([num_blocks, block_size, num_kv_heads] float32) the caches are int8 or
    float8_e4m3fn codes and each token's heads are quantized."""
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
        BLOCK_H=next_power_of_2(num_kv_heads), BLOCK_D=next_power_of_2(head_dim), CODE=_code(k_cache, k_scales),
        num_warps=1 if num_kv_heads * head_dim <= 512 else 4,
    )


def _code(k_cache: torch.Tensor, k_scales: torch.Tensor | None) -> int:
    if k_scales is None:
        return _PLAIN.value
    return (_INT8 if k_cache.dtype == torch.int8 else _FP8).value


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
            cache[blocks, offsets], scales[blocks, offsets] = quantize(x[keep], code_of_dtype(cache.dtype))
        return
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k[keep])
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v[keep])

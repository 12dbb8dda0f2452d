"""The key basis of quantized KV pages: with kv_cache_dtype int8 (or any quantized dtype)
every key is stored rotated by a normalized Hadamard matrix H after RoPE, and every query is
rotated by the same H before attention.

An int8 code with one scale per token and head spends its range on the head's largest
channel, and a few of a Llama model's key channels run many times larger than the rest, so
raw keys lose most of their small channels to rounding. H is orthogonal, so it spreads each
channel over all of them and changes no score: (Hq).(Hk) = q.k. Values stay as they are:
their rounding moved the default model's outputs a tenth as much as the keys' did
(docs/kv-quantization.md). The head dim is split into power-of-two blocks, largest first,
each rotated on its own (64 -> one block; 96 -> 64 + 32), which keeps H orthogonal for any
head dim.

The invariant: pages of a quantized pool hold H k, never k; anything that reads keys back
out of such pages (attention only, today) must pair them with H q. Tier copies, persistence
and KV handoff move the pages as bytes, and the persisted layout names the basis.
"""

from __future__ import annotations

import functools

import torch

from radixserve.kernels.native_ops import hadamard_heads_

KEY_BASIS = "hadamard, power-of-two blocks of the head dim, after RoPE"


def rotate_heads(x: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] with every head in the Hadamard basis: in place by the C butterflies where
    they apply (float32 on CPU), else one matmul by the cached matrix (the GPU's path)."""
    if hadamard_heads_(x):
        return x
    return x @ hadamard_matrix(x.shape[-1], x.dtype, x.device)


@functools.cache
def hadamard_matrix(head_dim: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The rotation as a [D, D] matrix (symmetric: x @ H == H x): block-diagonal over the
    power-of-two blocks of D, each the Sylvester matrix scaled by 1/sqrt(block)."""
    h = torch.zeros(head_dim, head_dim, dtype=torch.float64)
    start = 0
    for n in _blocks(head_dim):
        block = torch.ones(1, 1, dtype=torch.float64)
        while block.shape[0] < n:
            block = torch.cat([torch.cat([block, block], 1), torch.cat([block, -block], 1)], 0)
        h[start : start + n, start : start + n] = block / n**0.5
        start += n
    return h.to(dtype=dtype, device=device)


def _blocks(head_dim: int) -> list[int]:
    """The head dim as powers of two, largest first: 96 -> [64, 32]."""
    return [1 << b for b in reversed(range(head_dim.bit_length())) if head_dim >> b & 1]

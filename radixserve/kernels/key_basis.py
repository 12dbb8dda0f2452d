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

import torch

from radixserve.kernels.native_ops import hadamard_heads_

KEY_BASIS = "hadamard, power-of-two blocks of the head dim, after RoPE"


def rotate_heads(x: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] with every head in the Hadamard basis: in place by the C kernel where it
    applies (float32 on CPU), else a new tensor from the torch path (the same adds in the same
    order, so the two agree bit for bit)."""
    if hadamard_heads_(x):
        return x
    return hadamard_heads(x)


def hadamard_heads(x: torch.Tensor) -> torch.Tensor:
    """The torch path: [..., D] -> [..., D], each power-of-two block of D rotated."""
    blocks, start, left = [], 0, x.shape[-1]
    while left:
        n = 1 << (left.bit_length() - 1)
        blocks.append(_hadamard_block(x[..., start : start + n]))
        start, left = start + n, left - n
    return blocks[0] if len(blocks) == 1 else torch.cat(blocks, -1)


def _hadamard_block(x: torch.Tensor) -> torch.Tensor:
    n, lead = x.shape[-1], x.shape[:-1]
    h = 1
    while h < n:
        pairs = x.reshape(*lead, n // (2 * h), 2, h)
        a, b = pairs[..., 0, :], pairs[..., 1, :]
        x = torch.stack((a + b, a - b), -2).reshape(*lead, n)
        h *= 2
    return x * _inverse_sqrt(n, x.dtype)


def _inverse_sqrt(n: int, dtype: torch.dtype) -> torch.Tensor:
    """1/sqrt(n) for n a power of two, rounded once: powers of 1/2, times 1/sqrt(2) for odd powers."""
    scale, m = 1.0, n
    while m >= 4:
        scale, m = scale * 0.5, m // 4
    value = torch.tensor(scale, dtype=dtype)
    return value * torch.tensor(0.70710678118654752, dtype=dtype) if m == 2 else value

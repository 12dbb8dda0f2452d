"""Int8Pages: the byte layout of an int8 KV page, and the torch paths that write and read it.

With kv_cache_dtype int8 each layer's K (and V) pool is [num_blocks, page_bytes] uint8, and
one block's page holds its codes and their scales together:

    | codes int8 [block_size, kv_heads, head_dim] | scales float32 [block_size, kv_heads] |
    0                                         code_bytes                             page_bytes

Symmetric quantization with one scale per token and KV head: scale = max|x| / 127 and
code = round(x * 127 / max|x|), half away from zero, so x ~ code * scale. A token's codes
and scale are written once, when the token is stored, and no scale spans tokens, so a
sealed block never changes and the block stays the one unit of sharing, tier copies and
persistence. Attention always reads K/V back from the pages, a step's own new tokens
included, so a prefix-cache hit, a recompute and a speculative verify see the same values.
The C kernels (csrc/paged_attention.c) and the Triton kernels use the same arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.config import KV_CACHE_DTYPES

SCHEME = "int8 symmetric, one float32 scale per token and KV head, scales after the codes in each page"
_INV_127 = 1.0 / 127.0


@dataclass(frozen=True)
class Int8Pages:
    block_size: int
    num_kv_heads: int
    head_dim: int

    @property
    def code_bytes(self) -> int:
        """Where the scales start: the codes, rounded up to whole float32s."""
        return -(-self.block_size * self.num_kv_heads * self.head_dim // 4) * 4

    @property
    def page_bytes(self) -> int:
        return self.code_bytes + 4 * self.block_size * self.num_kv_heads

    def codes(self, pages: torch.Tensor) -> torch.Tensor:
        """int8 view [n, block_size, kv_heads, head_dim] of pages [n, page_bytes] uint8."""
        n = pages.shape[0]
        return pages[:, : self.block_size * self.num_kv_heads * self.head_dim].view(torch.int8).view(
            n, self.block_size, self.num_kv_heads, self.head_dim)

    def scales(self, pages: torch.Tensor) -> torch.Tensor:
        """float32 view [n, block_size, kv_heads] of pages [n, page_bytes] uint8."""
        return pages[:, self.code_bytes : self.page_bytes].view(torch.float32).view(
            pages.shape[0], self.block_size, self.num_kv_heads)

    def store(self, k: torch.Tensor, v: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor,
              slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Quantize k, v [T, kv_heads, head_dim] into their flat slots; returns what the pages
        now hold for them, dequantized to k's dtype."""
        blocks, offsets = slots // self.block_size, slots % self.block_size
        out = []
        for x, pages in ((k, k_pages), (v, v_pages)):
            codes, scales = quantize(x)
            self.codes(pages)[blocks, offsets] = codes
            self.scales(pages)[blocks, offsets] = scales
            out.append(dequantize(codes, scales, x.dtype))
        return out[0], out[1]

    def read(self, pages: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Pages [n, page_bytes] dequantized: [n, block_size, kv_heads, head_dim] of dtype."""
        return dequantize(self.codes(pages), self.scales(pages), dtype)


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> (codes int8 [..., head_dim], scales float32 [...])."""
    x = x.float()
    amax = x.abs().amax(-1)
    inv = torch.where(amax > 0, 127.0 * amax.reciprocal(), torch.zeros_like(amax))
    y = x * inv[..., None]
    codes = torch.copysign((y.abs() + 0.5).floor(), y).clamp_(-127, 127).to(torch.int8)
    return codes, amax * _INV_127


def dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (codes.float() * scales[..., None]).to(dtype)


def check_kv_cache_dtype(kv_cache_dtype: str, device: torch.device) -> None:
    """ValueError for a KV cache dtype this build cannot run on `device`."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {kv_cache_dtype!r}")
    if kv_cache_dtype == "fp8_e4m3":
        where = "on CPU (no fp8 arithmetic there)" if torch.device(device).type == "cpu" else "yet in this build"
        raise ValueError(f"kv_cache_dtype fp8_e4m3 is not supported {where}; use int8 (CPU and GPU) or auto")

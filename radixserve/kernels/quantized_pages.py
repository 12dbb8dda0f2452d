"""QuantizedPages: the byte layout of a quantized KV page, and the torch paths that write and read it.

With kv_cache_dtype int8 or fp8_e4m3 each layer's K (and V) pool is [num_blocks, page_bytes]
uint8, and one block's page holds its codes and their scales together:

    | codes [block_size, kv_heads, head_dim] | scales float32 [block_size, kv_heads] |
    0                                    code_bytes                             page_bytes

The codes are one byte each, int8 or float8_e4m3fn (PageCode), so both kinds have the same
page_bytes and differ only in how a byte reads as a number. Symmetric quantization with one
scale per token and KV head: scale = max|x| / qmax and code = x * qmax / max|x| rounded into
the code type, so x ~ code * scale:

    int8      qmax 127, rounded to an integer half away from zero
    fp8_e4m3  qmax 448 (e4m3's largest finite value), rounded to nearest e4m3, ties to even,
              subnormals kept; never NaN (the scaled value is clamped to +-448)

A token's codes and scale are written once, when the token is stored, and no scale spans
tokens, so a sealed block never changes and the block stays the one unit of sharing, tier
copies and persistence. Attention always reads K/V back from the pages, a step's own new
tokens included, so a prefix-cache hit, a recompute and a speculative verify see the same
values. The C kernels (csrc/paged_attention.c, int8 only) and the Triton kernels use the
same arithmetic.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from radixserve.config import KV_CACHE_DTYPES

FP8_MIN_CAPABILITY = (8, 9)  # compiled Triton converts e4m3 from Ada / Hopper on
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PageCode:
    """What a page's code bytes are: kv_cache_dtype name, element type, the code of max|x|."""

    name: str
    dtype: torch.dtype
    qmax: float
    scheme: str

    def round(self, y: torch.Tensor) -> torch.Tensor:
        """Scaled values y (|y| <= qmax, float32) -> codes of this type."""
        if self.dtype == torch.int8:
            return torch.copysign((y.abs() + 0.5).floor(), y).clamp_(-127, 127).to(torch.int8)
        return y.clamp(-self.qmax, self.qmax).to(self.dtype)


INT8 = PageCode("int8", torch.int8, 127.0,
                "int8 symmetric, one float32 scale per token and KV head, scales after the codes in each page")
FP8_E4M3 = PageCode("fp8_e4m3", torch.float8_e4m3fn, 448.0,
                    "float8_e4m3fn, scale = amax/448 per token and KV head (float32), scales after the codes "
                    "in each page; round to nearest even")
PAGE_CODES = {code.name: code for code in (INT8, FP8_E4M3)}


def page_code(kv_cache_dtype: str) -> PageCode | None:
    """The code of a quantized kv_cache_dtype; None for auto (the model's dtype)."""
    return PAGE_CODES.get(kv_cache_dtype)


def code_of_dtype(dtype: torch.dtype) -> PageCode:
    """The code whose element type is `dtype` (a codes view's dtype)."""
    for code in PAGE_CODES.values():
        if code.dtype == dtype:
            return code
    raise ValueError(f"no quantized KV page holds {dtype} codes; the codes are int8 or float8_e4m3fn")


@dataclass(frozen=True)
class QuantizedPages:
    block_size: int
    num_kv_heads: int
    head_dim: int
    code: PageCode = INT8

    @property
    def code_bytes(self) -> int:
        """Where the scales start: the codes, rounded up to whole float32s."""
        return -(-self.block_size * self.num_kv_heads * self.head_dim // 4) * 4

    @property
    def page_bytes(self) -> int:
        return self.code_bytes + 4 * self.block_size * self.num_kv_heads

    def codes(self, pages: torch.Tensor) -> torch.Tensor:
        """Code view [n, block_size, kv_heads, head_dim] of pages [n, page_bytes] uint8."""
        n = pages.shape[0]
        return pages[:, : self.block_size * self.num_kv_heads * self.head_dim].view(self.code.dtype).view(
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
            codes, scales = quantize(x, self.code)
            self.codes(pages)[blocks, offsets] = codes
            self.scales(pages)[blocks, offsets] = scales
            out.append(dequantize(codes, scales, x.dtype))
        return out[0], out[1]

    def read(self, pages: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Pages [n, page_bytes] dequantized: [n, block_size, kv_heads, head_dim] of dtype."""
        return dequantize(self.codes(pages), self.scales(pages), dtype)


def quantize(x: torch.Tensor, code: PageCode = INT8) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] -> (codes [..., head_dim] of code.dtype, scales float32 [...])."""
    x = x.float()
    amax = x.abs().amax(-1)
    inv = torch.where(amax > 0, code.qmax * amax.reciprocal(), torch.zeros_like(amax))
    return code.round(x * inv[..., None]), amax * (1.0 / code.qmax)


def dequantize(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (codes.float() * scales[..., None]).to(dtype)


def check_kv_cache_dtype(kv_cache_dtype: str, device: torch.device, attention_backend: str = "auto") -> None:
    """ValueError for a KV cache dtype this build cannot run on `device` with that attention
    backend (before the model loads, so a bad combination costs nothing)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {kv_cache_dtype!r}")
    if kv_cache_dtype != "fp8_e4m3":
        return
    device = torch.device(device)
    if device.type == "cuda":
        _check_fp8_on_cuda(device, attention_backend)
    elif attention_backend not in ("torch", "triton"):
        raise ValueError(
            f"kv_cache_dtype fp8_e4m3 on {device.type} runs through the torch attention backend only (the C "
            f"kernels of the {attention_backend} backend read float32 and int8 pages, not fp8): pass "
            "--attention-backend torch, or use --kv-cache-dtype int8, which the C kernels run")
    else:
        logger.warning("kv_cache_dtype fp8_e4m3 on %s: the same bytes as int8 pages, measured less accurate "
                       "(docs/kv-quantization.md), through the %s backend; int8 runs the C kernels", device.type,
                       attention_backend)


def _check_fp8_on_cuda(device: torch.device, attention_backend: str) -> None:
    if attention_backend not in ("auto", "triton"):
        return
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_MIN_CAPABILITY:
        raise ValueError(
            f"kv_cache_dtype fp8_e4m3 with the Triton kernels needs a GPU of compute capability "
            f"{'.'.join(map(str, FP8_MIN_CAPABILITY))}+ (Ada, Hopper), this one is {'.'.join(map(str, capability))}: "
            "use --kv-cache-dtype int8, or --attention-backend torch")

"""The int8 names of kernels/quantized_pages.py, for modules written before fp8 pages:
Int8Pages(block_size, kv_heads, head_dim) is QuantizedPages with its default code, int8."""

from __future__ import annotations

from radixserve.kernels.quantized_pages import INT8, QuantizedPages, check_kv_cache_dtype, dequantize, quantize

Int8Pages = QuantizedPages
SCHEME = INT8.scheme

__all__ = ["Int8Pages", "SCHEME", "check_kv_cache_dtype", "dequantize", "quantize"]

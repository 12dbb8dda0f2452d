"""KVPool: the paged K/V tensors of every layer."""

from __future__ import annotations

import torch


class KVPool:
    """K and V for every layer in one tensor of shape
    [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]."""

    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        self.num_blocks = num_blocks
        self.block_size = block_size
        shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
        self.kv = _zeros(shape, dtype, torch.device(device))

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv[index, 0], self.kv[index, 1]

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return num_layers * 2 * block_size * num_kv_heads * head_dim * element


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zero-filled pool. Never-written slots must hold finite values (attention multiplies
    masked-out V rows by zero weights, and 0 * NaN is NaN). On CPU, numpy's calloc-backed
    zeros let the OS commit zero pages on first touch instead of writing gigabytes up front."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    import numpy as np

    element = torch.empty((), dtype=dtype).element_size()
    raw = np.zeros(int(np.prod(shape)) * element, dtype=np.uint8)
    return torch.from_numpy(raw).view(dtype).view(shape)

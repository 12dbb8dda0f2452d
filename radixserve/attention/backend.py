"""AttentionBackend: the interface the model calls for paged attention."""

from __future__ import annotations

import abc

import torch

from radixserve.attention.metadata import AttentionMetadata


class AttentionBackend(abc.ABC):
    """Writes a step's new K/V into the paged pool, then attends over each request's
    context through its block table. Query head h reads KV head h // (num_heads // num_kv_heads).

    Caches are one layer's pool: [num_blocks, block_size, num_kv_heads, head_dim].
    q is [T, num_heads, head_dim]; k and v are [T, num_kv_heads, head_dim]; the result
    has q's shape.
    """

    name = "abstract"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    def prepare(self, meta: AttentionMetadata) -> None:
        """Called once per step before the first layer; derive per-step state here."""

    @abc.abstractmethod
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Store k/v at meta.slot_mapping, return attention output [T, num_heads, head_dim]."""

"""CpuAttentionBackend: paged attention on CPU with the C kernels of kernels/csrc/paged_attention.c.

Each layer: the store kernel writes the step's new K/V into their slots; the decode
kernel attends every single-token request over its context in place through its block
table (no gather), reading the blocks that neighbouring requests share once for all of
them (the runner orders decodes by block table); prefill chunks run torch's SDPA, one
call each, as in the torch backend. The kernels take float32 pools and int8 pages
(kernels/int8_pages.py: the store quantizes, decode dequantizes a block once per group of
query heads); with a pool of another dtype the backend runs the torch backend's paths
throughout (and says so once).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from radixserve.attention.backend import AttentionBackend, AttentionPlan
from radixserve.attention.metadata import AttentionMetadata
from radixserve.attention.torch_backend import (
    PrefillChunk, TorchAttentionBackend, plan_prefills, prefill_attention, store_kv,
)
from radixserve.kernels.int8_pages import Int8Pages, dequantize
from radixserve.kernels.native_attention import load_native_attention

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CpuPlan(AttentionPlan):
    decode_block_tables: torch.Tensor  # [D, max_blocks] int32
    decode_seq_lens: torch.Tensor  # [D] int32
    prefills: list[PrefillChunk]


class CpuAttentionBackend(AttentionBackend):
    name = "cpu"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 dtype: torch.dtype = torch.float32, pages: Int8Pages | None = None):
        super().__init__(num_heads, num_kv_heads, head_dim, scale, dtype, pages)
        self._kernels = load_native_attention()
        if self._kernels is None:
            raise RuntimeError("the cpu attention backend's C kernels could not be built here (see the "
                               "warning above); use attention_backend='torch'")
        self._torch: TorchAttentionBackend | None = None
        if dtype != torch.float32:
            logger.info("cpu attention backend: the C kernels are float32; %s runs the torch paths", dtype)
            self._torch = TorchAttentionBackend(num_heads, num_kv_heads, head_dim, scale, dtype, pages)

    @property
    def runs_kernels(self) -> bool:
        """Whether attention runs the C kernels (float32 activations) rather than the torch paths."""
        return self._torch is None

    def prepare(self, meta: AttentionMetadata) -> AttentionPlan:
        if self._torch is not None:
            return self._torch.prepare(meta)
        d = meta.num_decodes
        return CpuPlan(d, meta.slot_mapping, meta.block_tables[:d], meta.seq_lens[:d], plan_prefills(meta))

    def forward(self, q, k, v, k_cache, v_cache, plan: AttentionPlan) -> torch.Tensor:
        if self._torch is not None:
            return self._torch.forward(q, k, v, k_cache, v_cache, plan)
        pages = self.pages
        if self._kernels.store(k, v, k_cache, v_cache, plan.slot_mapping, pages):
            if pages is not None and plan.prefills:  # the chunks' fresh K/V as the pages hold them
                k, v = _read_back(pages, k_cache, v_cache, plan.slot_mapping, q.dtype)
        else:
            k, v = store_kv(k, v, k_cache, v_cache, plan.slot_mapping, pages)
        out = torch.empty_like(q)
        d = plan.num_decodes
        if d:
            out[:d] = self._kernels.decode(
                q[:d], k_cache, v_cache, plan.decode_block_tables, plan.decode_seq_lens, self.scale, pages
            )
        for chunk in plan.prefills:
            out[chunk.start : chunk.end] = prefill_attention(q, k, v, k_cache, v_cache, chunk, self.scale, pages)
        return out


def _read_back(pages: Int8Pages, k_pages, v_pages, slots, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    blocks, offsets = slots // pages.block_size, slots % pages.block_size
    return tuple(
        dequantize(pages.codes(p)[blocks, offsets], pages.scales(p)[blocks, offsets], dtype) for p in (k_pages, v_pages)
    )

"""TritonAttentionBackend: paged attention from the Triton kernels in radixserve.kernels.triton.

Each layer: store_kv writes the step's K/V into the pool, the decode kernel serves the
single-token requests (the first num_decodes), and the extend kernel serves the prefill
chunks, reading cached prefixes in place through their block tables; a sliding-window
layer's window goes to both, which start at each query's first window key, and its attention
sinks (gpt-oss) to both, and a step's draft-tree masks to the decode kernel. With quantized pages
(int8 or fp8_e4m3) the kernels take each layer's pages as two strided views, the codes and
the scales (kernels/quantized_pages.py): the store quantizes, attention dequantizes as it loads.

On a device other than CUDA the kernels run in Triton's interpreter, which must be
selected before the kernel modules are imported; so they are imported on the first
forward, once the tensors' device is known.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

from radixserve.attention.backend import AttentionBackend, AttentionPlan
from radixserve.attention.metadata import AttentionMetadata
from radixserve.kernels.quantized_pages import QuantizedPages


@dataclass(frozen=True)
class TritonPlan(AttentionPlan):
    decode_block_tables: torch.Tensor
    decode_seq_lens: torch.Tensor
    max_decode_len: int
    extend_block_tables: torch.Tensor
    extend_query_start: torch.Tensor
    extend_seq_lens: torch.Tensor
    max_extend_len: int
    decode_tree_masks: torch.Tensor | None = None  # [D] int64 draft-tree masks, or None


def load_kernels(device: torch.device) -> SimpleNamespace:
    """Import the kernels, selecting Triton's interpreter first unless `device` is CUDA."""
    from radixserve.kernels.triton import configure_triton

    configure_triton(device)
    from radixserve.kernels.triton.decode_attention import decode_attention
    from radixserve.kernels.triton.extend_attention import extend_attention
    from radixserve.kernels.triton.store_kv import store_kv

    return SimpleNamespace(store_kv=store_kv, decode_attention=decode_attention, extend_attention=extend_attention)


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    page_codes = ("int8", "fp8_e4m3")

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 dtype: torch.dtype = torch.float32, pages: QuantizedPages | None = None):
        super().__init__(num_heads, num_kv_heads, head_dim, scale, dtype, pages)
        self._kernels: SimpleNamespace | None = None

    def prepare(self, meta: AttentionMetadata) -> TritonPlan:
        d = meta.num_decodes
        starts = meta.query_start_loc_list
        extend_lens = [starts[i + 1] - starts[i] for i in range(d, meta.num_requests)]
        return TritonPlan(
            num_decodes=d,
            slot_mapping=meta.slot_mapping,
            decode_block_tables=meta.block_tables[:d],
            decode_seq_lens=meta.seq_lens[:d],
            max_decode_len=max(meta.seq_lens_list[:d], default=0),
            extend_block_tables=meta.block_tables[d:],
            extend_query_start=meta.query_start_loc[d:],
            extend_seq_lens=meta.seq_lens[d:],
            max_extend_len=max(extend_lens, default=0),
            decode_tree_masks=None if meta.tree_masks is None else meta.tree_masks[:d].contiguous(),
        )

    def forward(self, q, k, v, k_cache, v_cache, plan: TritonPlan, window: int = 0, sinks=None):
        kernels = self._kernels or self._load(q.device)
        scales = {}
        if self.pages is not None:
            scales = dict(k_scales=self.pages.scales(k_cache), v_scales=self.pages.scales(v_cache))
            k_cache, v_cache = self.pages.codes(k_cache), self.pages.codes(v_cache)
        kernels.store_kv(k, v, k_cache, v_cache, plan.slot_mapping, **scales)
        out = torch.empty_like(q)
        d = plan.num_decodes
        if d:
            kernels.decode_attention(
                q[:d], k_cache, v_cache, plan.decode_block_tables, plan.decode_seq_lens, self.scale,
                max_seq_len=plan.max_decode_len, out=out[:d], window=window, sinks=sinks,
                tree_masks=plan.decode_tree_masks, **scales,
            )
        if plan.max_extend_len:
            # Extend rows are addressed through query_start_loc, so q and out go in whole.
            kernels.extend_attention(
                q, k_cache, v_cache, plan.extend_block_tables, plan.extend_query_start, plan.extend_seq_lens,
                self.scale, max_query_len=plan.max_extend_len, out=out, window=window, sinks=sinks, **scales,
            )
        return out

    def _load(self, device: torch.device) -> SimpleNamespace:
        self._kernels = load_kernels(device)
        return self._kernels

"""TritonAttentionBackend: paged attention from the Triton kernels in radixserve.ops.triton.

Each layer: store_kv writes the step's K/V into the pool, the decode kernel serves the
single-token requests (the first num_decodes), and the extend kernel serves the prefill
chunks, reading cached prefixes in place through their block tables.

On a device other than CUDA the kernels run in Triton's interpreter, which must be
selected before the kernel modules are imported; so they are imported on the first
forward, once the tensors' device is known.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

from radixserve.attention.backend import AttentionBackend
from radixserve.attention.metadata import AttentionMetadata


@dataclass
class _StepPlan:
    """Per-step views of the metadata, shared by every layer."""

    num_decodes: int
    decode_block_tables: torch.Tensor
    decode_seq_lens: torch.Tensor
    max_decode_len: int
    extend_block_tables: torch.Tensor
    extend_query_start: torch.Tensor
    extend_seq_lens: torch.Tensor
    max_extend_len: int


def load_kernels(device: torch.device) -> SimpleNamespace:
    """Import the kernels, selecting Triton's interpreter first unless `device` is CUDA."""
    from radixserve.ops.triton import configure_triton

    configure_triton(device)
    from radixserve.ops.triton.decode_attention import decode_attention
    from radixserve.ops.triton.extend_attention import extend_attention
    from radixserve.ops.triton.store_kv import store_kv

    return SimpleNamespace(store_kv=store_kv, decode_attention=decode_attention, extend_attention=extend_attention)


def _plan(meta: AttentionMetadata) -> _StepPlan:
    d = meta.num_decodes
    starts = meta.query_start_loc_list
    extend_lens = [starts[i + 1] - starts[i] for i in range(d, meta.num_requests)]
    return _StepPlan(
        num_decodes=d,
        decode_block_tables=meta.block_tables[:d],
        decode_seq_lens=meta.seq_lens[:d],
        max_decode_len=max(meta.seq_lens_list[:d], default=0),
        extend_block_tables=meta.block_tables[d:],
        extend_query_start=meta.query_start_loc[d:],
        extend_seq_lens=meta.seq_lens[d:],
        max_extend_len=max(extend_lens, default=0),
    )


class TritonAttentionBackend(AttentionBackend):
    name = "triton"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        self._kernels: SimpleNamespace | None = None
        self._step_meta: AttentionMetadata | None = None
        self._step: _StepPlan | None = None

    def prepare(self, meta: AttentionMetadata) -> None:
        self._step_meta, self._step = meta, _plan(meta)

    def forward(self, q, k, v, k_cache, v_cache, meta):
        kernels = self._kernels or self._load(q.device)
        if meta is not self._step_meta:
            self.prepare(meta)
        step = self._step
        kernels.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        d = step.num_decodes
        if d:
            kernels.decode_attention(
                q[:d], k_cache, v_cache, step.decode_block_tables, step.decode_seq_lens, self.scale,
                max_seq_len=step.max_decode_len, out=out[:d],
            )
        if step.max_extend_len:
            # Extend rows are addressed through query_start_loc, so q and out go in whole.
            kernels.extend_attention(
                q, k_cache, v_cache, step.extend_block_tables, step.extend_query_start, step.extend_seq_lens,
                self.scale, max_query_len=step.max_extend_len, out=out,
            )
        return out

    def _load(self, device: torch.device) -> SimpleNamespace:
        self._kernels = load_kernels(device)
        return self._kernels

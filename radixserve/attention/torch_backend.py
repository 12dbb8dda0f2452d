"""TorchAttentionBackend: paged attention from plain torch ops; the CPU path.

Decodes are one batched op. On CPU in float32 that op is a small C kernel
(native_cpu.py) that reads K/V in place through the block tables, and another writes the
step's new K/V into their slots. Elsewhere, or without a C compiler, the decodes' blocks
are gathered (whole blocks, one index_select into a reused workspace) into a padded
[D, L, kv_heads, head_dim] view, and one
scaled_dot_product_attention call folds each KV head's group of query heads into the
query-length axis, so grouped-query attention needs no repeated K/V. Prefill chunks are
few per step and each is a large op, so they run one SDPA call each; a chunk with no
cached prefix attends to its own fresh K/V without touching the pool.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from radixserve.attention.backend import AttentionBackend
from radixserve.attention.metadata import AttentionMetadata
from radixserve.ops.native_attention import load_native_attention
from radixserve.ops.native_build import native_enabled


@dataclass
class _Prefill:
    start: int  # first query row
    end: int
    block_index: torch.Tensor | None  # blocks covering the context; None: no cached prefix
    context_len: int
    mask: torch.Tensor | None  # [q_len, context_len], True where attention is allowed


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float):
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        self._group = num_heads // num_kv_heads
        self._workspace: torch.Tensor | None = None
        self._decode_index: torch.Tensor | None = None
        self._decode_mask: torch.Tensor | None = None
        self._decode_len = 0
        self._prefills: list[_Prefill] = []
        self._meta: AttentionMetadata | None = None
        self.use_native = native_enabled()

    def prepare(self, meta: AttentionMetadata) -> None:
        self._meta = meta
        self._decode_index = None
        self._prefills = []
        if meta.num_decodes:
            self._prepare_decodes(meta)
        if meta.num_decodes < meta.num_requests:
            self._prepare_prefills(meta)

    def forward(self, q, k, v, k_cache, v_cache, meta):
        native = self._native_kernels(q)
        if native is None or not native.store(k, v, k_cache, v_cache, meta.slot_mapping):
            self._store(k, v, k_cache, v_cache, meta.slot_mapping)
        out = torch.empty_like(q)
        if meta.num_decodes:
            out[: meta.num_decodes] = self._decode(q[: meta.num_decodes], k_cache, v_cache)
        for p in self._prefills:
            out[p.start : p.end] = self._prefill(q, k, v, k_cache, v_cache, p)
        return out

    # ---- helpers ----------------------------------------------------------------

    @staticmethod
    def _store(k, v, k_cache, v_cache, slot_mapping) -> None:
        kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, k)
        v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, v)

    def _prepare_decodes(self, meta: AttentionMetadata) -> None:
        d, block_size = meta.num_decodes, meta.block_size
        num_blocks = -(-max(meta.seq_lens_list[:d]) // block_size)
        self._decode_index = meta.block_tables[:d, :num_blocks].reshape(-1).long()
        self._decode_len = num_blocks * block_size
        positions = torch.arange(self._decode_len, device=meta.seq_lens.device)
        self._decode_mask = (positions[None, :] < meta.seq_lens[:d, None]).view(d, 1, 1, -1)

    def _prepare_prefills(self, meta: AttentionMetadata) -> None:
        block_size = meta.block_size
        starts = meta.query_start_loc_list
        device = meta.seq_lens.device
        for i in range(meta.num_decodes, meta.num_requests):
            start, end, context = starts[i], starts[i + 1], meta.seq_lens_list[i]
            prefix = context - (end - start)
            if prefix == 0:
                self._prefills.append(_Prefill(start, end, None, context, None))
                continue
            num_blocks = -(-context // block_size)
            index = meta.block_tables[i, :num_blocks].long()
            rows = torch.arange(end - start, device=device)[:, None] + prefix
            mask = torch.arange(context, device=device)[None, :] <= rows
            self._prefills.append(_Prefill(start, end, index, context, mask))

    def _decode(self, q, k_cache, v_cache) -> torch.Tensor:
        native = self._native_kernels(q)
        if native is not None:
            meta = self._meta
            d = meta.num_decodes
            return native.decode(q, k_cache, v_cache, meta.block_tables[:d], meta.seq_lens[:d], self.scale)
        d, kv_heads, head_dim = q.shape[0], self.num_kv_heads, self.head_dim
        rows = self._decode_index.numel()
        k_buf, v_buf = self._gather_buffers(rows, k_cache)
        torch.index_select(k_cache, 0, self._decode_index, out=k_buf)
        torch.index_select(v_cache, 0, self._decode_index, out=v_buf)
        keys = k_buf.view(d, self._decode_len, kv_heads, head_dim).transpose(1, 2)
        values = v_buf.view(d, self._decode_len, kv_heads, head_dim).transpose(1, 2)
        queries = q.view(d, kv_heads, self._group, head_dim)
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=self._decode_mask, scale=self.scale)
        return out.reshape(d, self.num_heads, head_dim)

    def _prefill(self, q, k, v, k_cache, v_cache, p: _Prefill) -> torch.Tensor:
        queries = q[p.start : p.end].transpose(0, 1).unsqueeze(0)
        if p.block_index is None:
            keys = k[p.start : p.end].transpose(0, 1).unsqueeze(0)
            values = v[p.start : p.end].transpose(0, 1).unsqueeze(0)
            out = F.scaled_dot_product_attention(
                queries, keys, values, is_causal=True, scale=self.scale, enable_gqa=self._group > 1
            )
        else:
            keys = self._gather(k_cache, p).transpose(0, 1).unsqueeze(0)
            values = self._gather(v_cache, p).transpose(0, 1).unsqueeze(0)
            out = F.scaled_dot_product_attention(
                queries, keys, values, attn_mask=p.mask, scale=self.scale, enable_gqa=self._group > 1
            )
        return out[0].transpose(0, 1)

    def _native_kernels(self, q: torch.Tensor):
        if not self.use_native or q.device.type != "cpu" or q.dtype != torch.float32:
            return None
        return load_native_attention()

    def _gather_buffers(self, rows: int, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Two [rows, block_size, kv_heads, head_dim] views of a workspace reused across
        layers and steps (fresh allocations of this size cost page faults every step)."""
        need = 2 * rows * cache[0].numel()
        ws = self._workspace
        if ws is None or ws.numel() < need or ws.dtype != cache.dtype or ws.device != cache.device:
            ws = self._workspace = torch.empty(need, dtype=cache.dtype, device=cache.device)
        return ws[:need].view(2, rows, *cache.shape[1:]).unbind(0)

    def _gather(self, cache: torch.Tensor, p: _Prefill) -> torch.Tensor:
        blocks = cache.index_select(0, p.block_index)
        return blocks.view(-1, self.num_kv_heads, self.head_dim)[: p.context_len]

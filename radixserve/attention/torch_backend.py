"""TorchAttentionBackend: paged attention from plain torch ops, on any device and dtype.

Decodes are one batched op: their blocks are gathered (whole blocks, one index_select
into a reused workspace) into a padded [D, L, kv_heads, head_dim] view, and one
scaled_dot_product_attention call folds each KV head's group of query heads into the
query-length axis, so grouped-query attention needs no repeated K/V. Prefill chunks are
few per step and each is a large op, so they run one SDPA call each; a chunk with no
cached prefix attends to its own fresh K/V without touching the pool. The cpu backend
shares the prefill path (plan_prefills, prefill_attention) and the fallback store.

A sliding-window layer (window W > 0) gathers only the blocks that hold some query's last
W keys, from each request's first such block on, and masks the keys outside each query's
window; its indices and masks are made on the first layer of that window and kept in the
step's plan for the others. A window no shorter than any of the step's contexts is full attention.

With quantized pages (int8 or fp8_e4m3) the store quantizes, gathered pages are dequantized
before SDPA, and a chunk with no cached prefix attends to its fresh K/V as the pages hold
them (dequantized).

A layer with attention sinks (gpt-oss: `sinks`, one logit per query head, which joins each
softmax's denominator with no value row) takes the same gathers and masks, and its products and
softmax run as plain ops (`attend`: SDPA has no sink term); without sinks nothing changes.

A draft tree's rows (meta.tree_masks) get their masks' keys in the decodes' masks: the slots
before their tree's base (from their window's first position on) and the tree slots they see.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from radixserve.attention.backend import AttentionBackend, AttentionPlan
from radixserve.kernels.quantized_pages import QuantizedPages
from radixserve.attention.metadata import AttentionMetadata, tree_view


@dataclass(frozen=True)
class PrefillChunk:
    start: int  # first query row
    end: int
    block_index: torch.Tensor | None  # blocks covering the keys from first_key on; None: no cached prefix
    context_len: int
    mask: torch.Tensor | None  # [q_len, context_len - first_key], True where attention is allowed
    first_key: int = 0  # context position of the first gathered key (a block's first), > 0 only with a window


@dataclass(frozen=True)
class TorchPlan(AttentionPlan):
    decode_index: torch.Tensor | None  # [D * blocks] the decodes' blocks, row by row; None: no decodes
    decode_len: int  # padded context length of the gathered decodes (whole blocks)
    decode_mask: torch.Tensor | None  # [D, 1, 1, decode_len], True inside each context (or window)
    prefills: list[PrefillChunk]
    meta: AttentionMetadata | None = None  # for the windowed plans, made on first use
    windows: dict[int, TorchPlan] = field(default_factory=dict, compare=False)

    def for_window(self, window: int) -> TorchPlan:
        """This step's plan for layers of sliding window `window` (0: itself)."""
        meta = self.meta
        if window <= 0 or meta is None or window >= max(meta.seq_lens_list, default=0):
            return self
        plan = self.windows.get(window)
        if plan is None:
            index, length, mask = _plan_decodes(meta, window) if meta.num_decodes else (None, 0, None)
            plan = self.windows[window] = TorchPlan(self.num_decodes, self.slot_mapping, index, length, mask,
                                                    plan_prefills(meta, window), meta)
        return plan


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    page_codes = ("int8", "fp8_e4m3")

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 dtype: torch.dtype = torch.float32, pages: QuantizedPages | None = None):
        super().__init__(num_heads, num_kv_heads, head_dim, scale, dtype, pages)
        self._group = num_heads // num_kv_heads
        self._workspace: torch.Tensor | None = None

    def prepare(self, meta: AttentionMetadata) -> TorchPlan:
        index, length, mask = _plan_decodes(meta) if meta.num_decodes else (None, 0, None)
        return TorchPlan(meta.num_decodes, meta.slot_mapping, index, length, mask, plan_prefills(meta), meta)

    def forward(self, q, k, v, k_cache, v_cache, plan: TorchPlan, window: int = 0, sinks=None):
        k, v = store_kv(k, v, k_cache, v_cache, plan.slot_mapping, self.pages)
        plan = plan.for_window(window)
        out = torch.empty_like(q)
        d = plan.num_decodes
        if d:
            out[:d] = self._decode(q[:d], k_cache, v_cache, plan, sinks)
        for chunk in plan.prefills:
            out[chunk.start : chunk.end] = prefill_attention(q, k, v, k_cache, v_cache, chunk, self.scale, self.pages,
                                                             sinks)
        return out

    def _decode(self, q, k_cache, v_cache, plan: TorchPlan, sinks: torch.Tensor | None = None) -> torch.Tensor:
        d, kv_heads, head_dim = q.shape[0], self.num_kv_heads, self.head_dim
        k_buf, v_buf = self._gather_buffers(plan.decode_index.numel(), k_cache)
        torch.index_select(k_cache, 0, plan.decode_index, out=k_buf)
        torch.index_select(v_cache, 0, plan.decode_index, out=v_buf)
        if self.pages is not None:
            k_buf, v_buf = self.pages.read(k_buf, q.dtype), self.pages.read(v_buf, q.dtype)
        keys = k_buf.view(d, plan.decode_len, kv_heads, head_dim).transpose(1, 2)
        values = v_buf.view(d, plan.decode_len, kv_heads, head_dim).transpose(1, 2)
        queries = q.view(d, kv_heads, self._group, head_dim)
        if sinks is None:
            out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=plan.decode_mask, scale=self.scale)
        else:
            out = attend(queries, keys, values, plan.decode_mask, self.scale, sinks.view(kv_heads, self._group, 1))
        return out.reshape(d, self.num_heads, head_dim)

    def _gather_buffers(self, rows: int, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Two [rows, block_size, kv_heads, head_dim] views of a workspace reused across
        layers and steps (fresh allocations of this size cost page faults every step)."""
        need = 2 * rows * cache[0].numel()
        ws = self._workspace
        if ws is None or ws.numel() < need or ws.dtype != cache.dtype or ws.device != cache.device:
            ws = self._workspace = torch.empty(need, dtype=cache.dtype, device=cache.device)
        return ws[:need].view(2, rows, *cache.shape[1:]).unbind(0)


def store_kv(k, v, k_cache, v_cache, slot_mapping, pages: QuantizedPages | None = None):
    """Write k, v [T, kv_heads, head_dim] into the caches' flat slots; returns k, v as the
    caches now hold them (themselves, or dequantized from quantized pages)."""
    if pages is not None:
        return pages.store(k, v, k_cache, v_cache, slot_mapping)
    kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, v)
    return k, v


def plan_prefills(meta: AttentionMetadata, window: int = 0) -> list[PrefillChunk]:
    """The prefill chunks of a step (requests num_decodes on), with the blocks and the
    causal mask of those that attend over a cached prefix; with a sliding window, the masks
    of all, and the blocks from the first one that some query's window reaches."""
    block_size, starts = meta.block_size, meta.query_start_loc_list
    device = meta.seq_lens.device
    chunks = []
    for i in range(meta.num_decodes, meta.num_requests):
        start, end, context = starts[i], starts[i + 1], meta.seq_lens_list[i]
        prefix = context - (end - start)
        rows = torch.arange(end - start, device=device)[:, None] + prefix
        if prefix == 0:
            mask = None
            if window:
                keys = torch.arange(context, device=device)[None, :]
                mask = (keys <= rows) & (keys > rows - window)
            chunks.append(PrefillChunk(start, end, None, context, mask))
            continue
        first_block = max(0, prefix - window + 1) // block_size if window else 0
        index = meta.block_tables[i, first_block : -(-context // block_size)].long()
        keys = torch.arange(first_block * block_size, context, device=device)[None, :]
        mask = keys <= rows
        if window:
            mask &= keys > rows - window
        chunks.append(PrefillChunk(start, end, index, context, mask, first_block * block_size))
    return chunks


def prefill_attention(q, k, v, k_cache, v_cache, chunk: PrefillChunk, scale: float,
                      pages: QuantizedPages | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """One prefill chunk's attention [q_len, num_heads, head_dim], by one SDPA call (with
    `sinks`, by `attend`); k, v are the step's K/V as store_kv returned them."""
    queries = q[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)
    gqa = q.shape[1] != k.shape[1]
    if sinks is not None:
        return _prefill_with_sinks(queries, k, v, k_cache, v_cache, chunk, scale, pages, sinks)
    if chunk.block_index is None:
        keys = k[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)
        values = v[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)
        if chunk.mask is None:
            out = F.scaled_dot_product_attention(queries, keys, values, is_causal=True, scale=scale, enable_gqa=gqa)
        else:
            out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=chunk.mask, scale=scale,
                                                 enable_gqa=gqa)
    else:
        keys = _gather(k_cache, chunk, pages, q.dtype).transpose(0, 1).unsqueeze(0)
        values = _gather(v_cache, chunk, pages, q.dtype).transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=chunk.mask, scale=scale, enable_gqa=gqa)
    return out[0].transpose(0, 1)


def _prefill_with_sinks(queries, k, v, k_cache, v_cache, chunk: PrefillChunk, scale: float,
                        pages: QuantizedPages | None, sinks: torch.Tensor) -> torch.Tensor:
    if chunk.block_index is None:
        keys, values = k[chunk.start : chunk.end], v[chunk.start : chunk.end]
        n = chunk.end - chunk.start
        mask = chunk.mask if chunk.mask is not None else torch.ones(n, n, dtype=torch.bool, device=k.device).tril()
    else:
        keys, values = _gather(k_cache, chunk, pages, queries.dtype), _gather(v_cache, chunk, pages, queries.dtype)
        mask = chunk.mask
    group = queries.shape[1] // keys.shape[1]
    keys = keys.repeat_interleave(group, 1).transpose(0, 1).unsqueeze(0)
    values = values.repeat_interleave(group, 1).transpose(0, 1).unsqueeze(0)
    return attend(queries, keys, values, mask, scale, sinks.view(-1, 1, 1))[0].transpose(0, 1)


def attend(queries, keys, values, mask: torch.Tensor, scale: float, sinks: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T * scale, masked; with each head's sink logit in the denominator) v, as
    transformers' gpt-oss runs it: the sink is one more column of logits, dropped after the
    softmax. queries [..., q, d], keys and values [..., L, d] (heads matched), mask True where
    attention is allowed (broadcast to [..., q, L]), sinks broadcast to [..., 1]."""
    scores = torch.matmul(queries, keys.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    logits = torch.cat([scores, sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)], dim=-1)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)[..., :-1]
    return torch.matmul(probs.to(values.dtype), values)


def _plan_decodes(meta: AttentionMetadata, window: int = 0) -> tuple[torch.Tensor, int, torch.Tensor]:
    d, block_size = meta.num_decodes, meta.block_size
    if window:
        return _plan_window_decodes(meta, window)
    num_blocks = -(-max(meta.seq_lens_list[:d]) // block_size)
    index = meta.block_tables[:d, :num_blocks].reshape(-1).long()
    length = num_blocks * block_size
    positions = torch.arange(length, device=meta.seq_lens.device)
    mask = positions[None, :] < meta.seq_lens[:d, None]
    _mask_trees(mask, [0] * d, meta, 0)
    return index, length, mask.view(d, 1, 1, -1)


def _mask_trees(mask: torch.Tensor, starts: list[int], meta: AttentionMetadata, window: int) -> None:
    """In place: each draft-tree row's mask (its keys from slot starts[row] on) to what its
    tree mask lets it see (attention/metadata.py: tree_view)."""
    if meta.tree_masks_list is None:
        return
    for r, tree in enumerate(meta.tree_masks_list[:mask.shape[0]]):
        if not tree:
            continue
        seq_len = meta.seq_lens_list[r]
        first, seen = tree_view(seq_len, tree, window)
        base = seq_len - tree.bit_length()
        row = torch.zeros(mask.shape[1], dtype=torch.bool)
        row[max(0, first - starts[r]):max(0, base - starts[r])] = True
        row[[s - starts[r] for s in seen]] = True
        mask[r] = row.to(mask.device)


def _plan_window_decodes(meta: AttentionMetadata, window: int) -> tuple[torch.Tensor, int, torch.Tensor]:
    """Each decode's blocks from the first that holds one of its last `window` keys to its
    last; a row with fewer repeats its last block (masked), so no other entry is read."""
    d, block_size, device = meta.num_decodes, meta.block_size, meta.seq_lens.device
    lens = meta.seq_lens_list[:d]
    trees = meta.tree_masks_list[:d] if meta.tree_masks_list is not None else [0] * d
    first = [tree_view(n, tree, window)[0] // block_size for n, tree in zip(lens, trees)]
    last = [(n - 1) // block_size for n in lens]
    num_blocks = max(b - a + 1 for a, b in zip(first, last))
    first_t = torch.tensor(first, dtype=torch.int64, device=device)[:, None]
    columns = torch.minimum(first_t + torch.arange(num_blocks, device=device),
                            torch.tensor(last, dtype=torch.int64, device=device)[:, None])
    index = meta.block_tables[:d].gather(1, columns).reshape(-1).long()
    length = num_blocks * block_size
    positions = first_t * block_size + torch.arange(length, device=device)
    seq_lens = meta.seq_lens[:d, None].long()
    mask = (positions < seq_lens) & (positions >= seq_lens - window)
    _mask_trees(mask, [b * block_size for b in first], meta, window)
    return index, length, mask.view(d, 1, 1, -1)


def _gather(cache: torch.Tensor, chunk: PrefillChunk, pages: QuantizedPages | None, dtype: torch.dtype) -> torch.Tensor:
    blocks = cache.index_select(0, chunk.block_index)
    if pages is not None:
        blocks = pages.read(blocks, dtype)
    return blocks.view(-1, blocks.shape[2], blocks.shape[3])[: chunk.context_len - chunk.first_key]

"""float64 references the attention kernels' tests share."""

from __future__ import annotations

import torch


def dense_reference(q, k_cache, v_cache, block_tables, seq_lens, scale):
    """float64 attention of each row q[r] (the last token) over its whole context, read from the
    [blocks, block_size, kv_heads, head_dim] caches through the row's block table."""
    out = torch.empty_like(q)
    group = q.shape[1] // k_cache.shape[2]
    for r, n in enumerate(seq_lens.tolist()):
        blocks = block_tables[r, : -(-n // k_cache.shape[1])].long()
        k = k_cache[blocks].flatten(0, 1)[:n].double().repeat_interleave(group, 1)
        v = v_cache[blocks].flatten(0, 1)[:n].double().repeat_interleave(group, 1)
        weights = (torch.einsum("hd,thd->ht", q[r].double(), k) * scale).softmax(-1)
        out[r] = torch.einsum("ht,thd->hd", weights, v).float()
    return out

"""float64 references the attention kernels' tests share."""

from __future__ import annotations

import torch


def dense_reference(q, k_cache, v_cache, block_tables, seq_lens, scale, window=0, sinks=None):
    """float64 attention of each row q[r] (the last token) over its whole context (its last
    `window` keys where window > 0), read from the [blocks, block_size, kv_heads, head_dim]
    caches through the row's block table; sinks: [heads] logits each head's softmax also counts."""
    out = torch.empty_like(q)
    group = q.shape[1] // k_cache.shape[2]
    for r, n in enumerate(seq_lens.tolist()):
        blocks = block_tables[r, : -(-n // k_cache.shape[1])].long()
        first = n - window if 0 < window < n else 0
        k = k_cache[blocks].flatten(0, 1)[first:n].double().repeat_interleave(group, 1)
        v = v_cache[blocks].flatten(0, 1)[first:n].double().repeat_interleave(group, 1)
        scores = torch.einsum("hd,thd->ht", q[r].double(), k) * scale
        if sinks is not None:
            scores = torch.cat([scores, sinks.double()[:, None]], 1)
        weights = scores.softmax(-1)[:, : k.shape[0]]
        out[r] = torch.einsum("ht,thd->hd", weights, v).float()
    return out

"""AttentionMetadata: the per-step tensors that tell attention where each request's K/V lives."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    """Built by the runner once per step; the backend's prepare turns it into a plan.

    The step's tokens form one flat batch. Requests with a single query token (decodes,
    and prefills of which only the last token was uncached) come first; prefill chunks
    follow. Request i owns query rows query_start_loc[i]:query_start_loc[i+1]; after this
    step its context is seq_lens[i] tokens, the last (q_len) of which are this step's.
    Token t's K/V is written to flat slot slot_mapping[t] of the pool
    (block = slot // block_size, offset = slot % block_size). block_tables[i] lists the
    request's blocks, padded with 0 past its last block.

    tree_masks (None: none) marks the rows of a speculative draft tree (core/draft_tree.py):
    row i with a nonzero mask M (an int64 holding uint64 bits) is a single-query row whose own
    key is slot seq_lens[i] - 1, and bit j of M stands for slot base + j, where base =
    seq_lens[i] - 1 - (M's highest set bit): the row sees every slot before base and, of the
    slots from base on, those whose bit is set (its ancestors in the tree, and itself). Its
    position is base + popcount(M) - 1, and a sliding window W counts positions: it sees the
    slots before base from position + 1 - W on, and the slot of bit j while popcount(M >> j)
    <= W (the ancestors at most W - 1 deep above it). A zero mask is an ordinary row.
    """

    num_decodes: int
    block_size: int
    query_start_loc: torch.Tensor  # [B+1] int32
    seq_lens: torch.Tensor  # [B] int32
    block_tables: torch.Tensor  # [B, max_blocks] int32
    slot_mapping: torch.Tensor  # [T] int64
    # The same offsets and lengths as Python ints, so backends never sync a device to read them.
    query_start_loc_list: list[int]
    seq_lens_list: list[int]
    tree_masks: torch.Tensor | None = None  # [B] int64 (uint64 bits); rows past num_decodes are 0
    tree_masks_list: list[int] | None = None  # the same as Python ints in [0, 2**64)

    @property
    def num_requests(self) -> int:
        return len(self.seq_lens_list)


def tree_view(seq_len: int, mask: int, window: int = 0) -> tuple[int, list[int]]:
    """What a row of context seq_len and tree mask `mask` (uint64 as a Python int) sees:
    (the first slot it sees before its tree's base, or the base itself where it sees none of
    those; the tree slots it sees, ascending). An ordinary row (mask 0): (its window's first
    slot, []), all of [first, seq_len) seen."""
    if not mask:
        return (max(0, seq_len - window) if window > 0 else 0), []
    top = mask.bit_length() - 1
    base = seq_len - 1 - top
    position = base + bin(mask).count("1") - 1
    first = min(base, max(0, position + 1 - window)) if window > 0 else 0
    seen = [base + j for j in range(top + 1)
            if mask >> j & 1 and (window <= 0 or bin(mask >> j).count("1") <= window)]
    return first, seen

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

    @property
    def num_requests(self) -> int:
        return len(self.seq_lens_list)

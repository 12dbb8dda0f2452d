"""The KV memory planner: how many of each kind of KV unit a byte budget holds.

A model's cached state comes in kinds (core/cache_component.py), each with its own unit:
a full-attention block (block_size tokens of every full layer), a window page (the same
tokens of every sliding-window layer, hybrid KV), and a recurrent-state snapshot (one
request's states over every recurrent layer, core/recurrent_snapshots.py). The planner takes the budget (kv_cache_memory, else a share of what the device has
free) and splits it among the kinds the model needs:

    full only        blocks = budget // block_bytes
    full + window    blocks = budget // (block_bytes + ratio * page_bytes), pages = ratio * blocks,
                     but never fewer pages than one request's window plus its largest chunk
                     (those first, blocks in what is left)

    recurrent        snapshots = RECURRENT_SHARE * budget // snapshot_bytes first (none: refused),
                     the rest as above

With num_kv_blocks the block count is given and nothing is split (window pages still
follow the ratio, at least the least; snapshots: one per SNAPSHOT_BLOCKS blocks, but no more
bytes than RECURRENT_SHARE of blocks and snapshots together, at least MIN_SNAPSHOTS).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

import torch

from radixserve.attention.kv_pool import KVPool
from radixserve.config import EngineConfig
from radixserve.model.spec import ModelSpec

CPU_KV_BYTES_CAP = 2 << 30
GPU_MEMORY_SHARE = 0.85
RECURRENT_SHARE = 0.25  # of the budget, for recurrent-state snapshots (a model with recurrent layers)
SNAPSHOT_BLOCKS, MIN_SNAPSHOTS = 8, 16


@dataclass(frozen=True)
class Share:
    """One kind's part of the plan: `count` units of `unit_bytes` each."""

    count: int
    unit_bytes: int

    @property
    def bytes(self) -> int:
        return self.count * self.unit_bytes


@dataclass(frozen=True)
class MemoryPlan:
    budget: int | None  # the bytes split (None: num_kv_blocks gave the count)
    shares: dict[str, Share] = field(default_factory=dict)  # "full", "window" (hybrid KV), "recurrent"
    window: int = 0  # hybrid KV: the longest layer window, in tokens

    @property
    def num_blocks(self) -> int:
        return self.shares["full"].count

    @property
    def num_window_pages(self) -> int:
        return self.shares["window"].count if "window" in self.shares else 0

    @property
    def num_snapshots(self) -> int:
        return self.shares["recurrent"].count if "recurrent" in self.shares else 0

    @property
    def window_ratio(self) -> float:
        """Window pages per block (the second tier gives window pages this share of its slots)."""
        return self.num_window_pages / self.num_blocks


def split_budget(budget: int | None, layer_block_bytes: int, num_layers: int, window_layers: int = 0,
                 window: int = 0, least_pages: int = 0, ratio: float = 0.0,
                 num_blocks: int | None = None) -> MemoryPlan:
    """The plan for a budget in bytes (or a given block count): `layer_block_bytes` is one
    layer's K/V for one block; `window_layers` of the `num_layers` keep window pages apart
    (0: none), at `ratio` pages per block and never fewer than `least_pages`."""
    if not window_layers:
        full = layer_block_bytes * num_layers
        if num_blocks:
            return MemoryPlan(budget, {"full": Share(num_blocks, full)})
        blocks = int(budget // full)
        if blocks < 1:
            raise ValueError(f"kv_cache_memory of {budget} bytes holds no KV block ({full} bytes each)")
        return MemoryPlan(budget, {"full": Share(blocks, full)})
    full, page = (num_layers - window_layers) * layer_block_bytes, window_layers * layer_block_bytes
    if num_blocks:
        pages = min(num_blocks, max(least_pages, int(num_blocks * ratio)))
        return MemoryPlan(budget, {"full": Share(num_blocks, full), "window": Share(pages, page)}, window)
    blocks = int(budget // (full + ratio * page))
    pages = int(blocks * ratio)
    if pages < least_pages:  # the least pages first, blocks in what is left
        pages = least_pages
        blocks = int((budget - least_pages * page) // full) if full else int(least_pages / ratio)
    if blocks < 1 or budget < least_pages * page:
        raise ValueError(f"kv_cache_memory of {budget} bytes holds less than one request's window "
                         f"({least_pages} window pages of {page} bytes)")
    return MemoryPlan(budget, {"full": Share(blocks, full), "window": Share(min(blocks, pages), page)}, window)


def plan_memory(cfg: EngineConfig, spec: ModelSpec, dtype: torch.dtype, device: torch.device,
                hybrid: bool, snapshot_bytes: int = 0) -> MemoryPlan:
    """The engine's plan: its model's kinds of KV state in num_kv_blocks, or in
    kv_cache_memory (else a share of the device's free memory). `snapshot_bytes`: one
    recurrent-state snapshot (a model with recurrent layers and the prefix cache on), whose
    share comes off the budget first."""
    budget = None if cfg.num_kv_blocks else kv_budget(cfg.kv_cache_memory, device)
    if not snapshot_bytes:
        return _plan_kv(cfg, spec, dtype, budget, hybrid)
    if budget is None:
        plan = _plan_kv(cfg, spec, dtype, None, hybrid)
        kv_bytes = sum(share.bytes for share in plan.shares.values())
        share_bytes = int(kv_bytes * RECURRENT_SHARE // (1 - RECURRENT_SHARE))  # a quarter of blocks + snapshots
        count = max(MIN_SNAPSHOTS, min(cfg.num_kv_blocks // SNAPSHOT_BLOCKS, share_bytes // snapshot_bytes))
    else:
        count = int(budget * RECURRENT_SHARE) // snapshot_bytes
        if count < 1:  # a match would adopt blocks with no state to resume from
            raise ValueError(f"kv_cache_memory of {budget} bytes keeps no recurrent-state snapshot "
                             f"({snapshot_bytes} bytes each, out of a {RECURRENT_SHARE:.0%} share): give at "
                             f"least {-(-snapshot_bytes // RECURRENT_SHARE):.0f} bytes, or turn the prefix cache off")
        plan = replace(_plan_kv(cfg, spec, dtype, budget - count * snapshot_bytes, hybrid), budget=budget)
    return replace(plan, shares={**plan.shares, "recurrent": Share(count, snapshot_bytes)})


def _plan_kv(cfg: EngineConfig, spec: ModelSpec, dtype: torch.dtype, budget: int | None, hybrid: bool) -> MemoryPlan:
    layer = KVPool.bytes_per_block(1, cfg.block_size, spec.num_kv_heads, spec.head_dim, dtype, cfg.kv_cache_dtype)
    if not hybrid:
        return split_budget(budget, layer, spec.num_layers, num_blocks=cfg.num_kv_blocks)
    window = max(spec.layer_windows)
    least = -(-(window + min(cfg.chunked_prefill_size, cfg.max_num_batched_tokens)) // cfg.block_size) + 2
    window_layers = sum(1 for w in spec.layer_windows if w)
    return split_budget(budget, layer, spec.num_layers, window_layers, window, least, cfg.window_pages_ratio,
                        cfg.num_kv_blocks)


def kv_budget(configured: int | None, device: torch.device) -> int:
    """kv_cache_memory, else GPU_MEMORY_SHARE of a GPU's free memory, else a quarter of the
    available memory (at most CPU_KV_BYTES_CAP)."""
    if configured is not None:
        return configured
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * GPU_MEMORY_SHARE)
    return min(CPU_KV_BYTES_CAP, available_memory() // 4)


def available_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

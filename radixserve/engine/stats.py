"""EngineStats: one typed snapshot of the engine's counters and gauges (Engine.snapshot()).

`as_dict()` is the flat JSON clients have always read (`stats()`, /get_server_info,
/debug/stats); the metrics read the fields."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from radixserve.core.agent_hints import KINDS, AgentHints
from radixserve.engine.cpu_share import CpuSnapshot

if TYPE_CHECKING:  # both import torch; the stats are read without it (the cluster's ingress, the metrics)
    from radixserve.engine.kv_transfer import TransferStats
    from radixserve.kv_tier.tiering import TierStats


@dataclass(frozen=True)
class CacheStats:
    """The prefix cache's side, present when the cache is on."""

    restored_prompt_tokens: int  # prompt tokens restored from the second tier
    tier_hits: int  # matches that restored at least one block
    restored_blocks: int
    evictions: dict[str, int]  # blocks by reason: demoted, dropped, tier_dropped, flushed
    sessions_open: int
    pool_cached_bytes: int
    pins: int


@dataclass(frozen=True)
class HintStats:
    """Agent hints (core/agent_hints.py): requests that gave each kind, what they hold."""

    requests: dict[str, int]  # kind -> requests that gave it (speculative prefills themselves not counted)
    ttl_held_blocks: int  # pool blocks on prefixes held by ttl_s / priority holds now
    ttl_holds: int  # such holds now
    speculative_prefills: int  # prefill-only warm-ups the server ran after a reply
    speculative_prefill_tokens: int  # prompt tokens they computed (the rest was cached already)


class HintCounters:
    """The engine's running counts behind HintStats."""

    def __init__(self) -> None:
        self.requests = {kind: 0 for kind in KINDS}
        self.speculative_prefills = 0
        self.speculative_prefill_tokens = 0

    def admitted(self, hints: AgentHints) -> None:
        if hints.warmup:
            self.speculative_prefills += 1
            return
        for kind in hints.kinds():
            self.requests[kind] += 1

    def warmed(self, tokens: int) -> None:
        self.speculative_prefill_tokens += tokens

    def snapshot(self, sessions: Any) -> HintStats:
        holds = sessions.holds if sessions is not None else None
        return HintStats(dict(self.requests), holds.held_blocks() if holds is not None else 0,
                         len(holds) if holds is not None else 0, self.speculative_prefills,
                         self.speculative_prefill_tokens)


@dataclass(frozen=True)
class EngineStats:
    prompt_tokens: int
    cached_prompt_tokens: int
    generated_tokens: int
    computed_tokens: int
    preemptions: int
    deferred_for_sharing: int
    steps: int
    running: int
    waiting: int  # requests waiting to be scheduled, those waiting on a tier prefetch included
    blocks_total: int
    blocks_free: int
    blocks_cached: int
    blocks_evictable: int
    evicted_blocks: int
    cache_nodes: int
    kv_cache_dtype: str  # the KV pool's element type: float32, bfloat16, int8 (codes with per-token scales)
    kv_bytes_per_token: int  # bytes one cached token takes in the pool, all layers, scales included
    weight_dtype: str  # how the weights are held: float32, bfloat16, int8, int4, gguf:Q4_1+Q8_0, ...
    weight_bytes: int  # bytes the model's weights take in memory (quantized codes and scales included)
    spec_drafts: int
    spec_draft_tokens: int
    spec_accepted_tokens: int
    spec_acceptance_rate: float
    spec_pauses: int
    spec_tree_drafts: int  # drafts a cached sequence of the request's namespace contributed to (suffix drafting)
    spec_accepted_length: float  # tokens a verification appends on average (accepted + the one after)
    spec_branched_drafts: int  # drafts verified as a tree with branches (speculative_tree_width > 1)
    spec_branch_hits: int  # of those, verifications that accepted a node off the tree's main chain
    spec_forced_drafts: int  # jump-forward: a grammar's forced text verified in one step
    spec_forced_tokens: int  # forced tokens drafted
    spec_forced_accepted: int  # of those, accepted
    schedule_s: float  # seconds spent so far in each part of a step
    model_s: float
    postprocess_s: float
    cpu: CpuSnapshot | None = None  # the cores steps use (engine/cpu_share.py)
    cache: CacheStats | None = None
    tier: TierStats | None = None
    transfer: TransferStats | None = None  # an engine with a prefill or decode role (kv_transfer.py)
    hints: HintStats | None = None
    # hybrid KV (sliding-window models): the window layers' pages (core/window_pages.py); 0 without
    window_pages_total: int = 0
    window_pages_attached: int = 0  # pages holding a block's window-layer KV
    window_pages_trimmed: int = 0  # cumulative: pages dropped from blocks no window reads any more
    window_page_bytes: int = 0  # one page's bytes over the window layers (kv_bytes_per_token: the full layers')
    # models with recurrent layers (execution/recurrent_state.py); 0 without
    recurrent_state_bytes: int = 0  # the states' tensors: a slot per request the pool has room for, snapshots
    recurrent_request_bytes: int = 0  # one request's states, all recurrent layers
    recurrent_snapshots_total: int = 0  # room for the cache's snapshots of them (core/recurrent_snapshots.py)
    recurrent_snapshots_kept: int = 0  # snapshots tree nodes keep now
    recurrent_snapshot_saves: int = 0  # cumulative: states saved
    recurrent_snapshot_restores: int = 0  # cumulative: requests started from a kept state (prefix hits)
    recurrent_snapshots_evicted: int = 0  # cumulative: kept snapshots that gave their room to a new one
    recurrent_snapshots_in_tier: int = 0  # snapshots kept in the second tier's state slots now
    recurrent_snapshot_tier_restores: int = 0  # cumulative: of the restores, those read from the tier

    @property
    def blocks_used(self) -> int:
        """Blocks held by requests or the cache."""
        return self.blocks_total - self.blocks_free

    def as_dict(self) -> dict[str, Any]:
        """The flat dictionary of `Engine.stats()`, keys in their documented order."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            if f.name in ("schedule_s", "model_s", "postprocess_s", "cpu", "cache", "tier", "transfer", "hints") or (
                    f.name.startswith(("window_page", "recurrent_"))):
                continue
            out[f.name] = getattr(self, f.name)
        if self.cache is not None:
            c = self.cache
            out.update(restored_prompt_tokens=c.restored_prompt_tokens, tier_hits=c.tier_hits,
                       restored_blocks=c.restored_blocks)
            out.update({f"evicted_blocks_{reason}": n for reason, n in c.evictions.items()})
            out.update(sessions_open=c.sessions_open, pool_cached_bytes=c.pool_cached_bytes, pins=c.pins)
            if self.tier is not None:
                out.update(dataclasses.asdict(self.tier))
        if self.transfer is not None:
            out.update(self.transfer.as_dict())
        if self.hints is not None:
            h = self.hints
            out.update({f"hint_requests_{kind}": n for kind, n in h.requests.items()})
            out.update(hint_ttl_held_blocks=h.ttl_held_blocks, hint_ttl_holds=h.ttl_holds,
                       speculative_prefills=h.speculative_prefills,
                       speculative_prefill_tokens=h.speculative_prefill_tokens)
        if self.window_pages_total:  # a hybrid KV engine
            out.update(window_pages_total=self.window_pages_total, window_pages_attached=self.window_pages_attached,
                       window_pages_trimmed=self.window_pages_trimmed, window_page_bytes=self.window_page_bytes)
        if self.recurrent_request_bytes:  # a model with recurrent layers
            out.update({f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                        if f.name.startswith("recurrent_")})
        if self.cpu is not None:
            out.update(cpu_usable_cores=self.cpu.usable_cores, cpu_threads=self.cpu.threads,
                       cpu_others_cores=self.cpu.others_cores, cpu_team_reductions=self.cpu.reductions)
        out.update(schedule_s=self.schedule_s, model_s=self.model_s, postprocess_s=self.postprocess_s)
        return out

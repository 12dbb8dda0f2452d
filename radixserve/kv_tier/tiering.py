"""Tiering: sets up the second KV tier (slots, bytes, persistence, prefetch) from an
EngineConfig, runs each step's tier copies, and holds back requests whose restore would
read the disk until their pages are in (prefetch.py; the scheduler keeps them PREFETCHING).
Anything that cannot be set up
(an unwritable directory, a full disk) degrades to one tier with a log line saying why; it
never stops the engine."""

from __future__ import annotations

import atexit
import dataclasses
import hashlib
import logging
import os
from collections.abc import Callable
from typing import Any

import torch

from radixserve.attention.kv_pool import KVPool
from radixserve.config import EngineConfig
from radixserve.kv_tier.index import KVCopy, KVTier, TierEntry
from radixserve.kv_tier.persist import TierPersister
from radixserve.kv_tier.prefetch import TierPrefetcher
from radixserve.kv_tier.store import TierStore

log = logging.getLogger("radixserve.tiering")

DEFAULT_TIER_BYTES = 2 << 30  # a tier asked for by directory alone (kv_offload_dir, kv_persist_dir)
STATE_BLOCKS = 8  # recurrent layers: one state slot per this many block slots, in the same bytes
STATE_SHARE = 0.25  # ... and never more than this share of them
_SAMPLES_PER_TENSOR = 4096


@dataclasses.dataclass(frozen=True)
class TierStats:
    tier_blocks_total: int  # slots of the tier
    tier_blocks_used: int  # slots the cache holds
    tier_bytes: int
    tier_persist_failed: int  # 1 when the persisted tier could not be written
    tier_prefetched_blocks: int  # slots read in for held requests
    tier_prefetch_holds: int  # requests held so far
    tier_warmed_blocks: int  # slots faulted in for writing


@dataclasses.dataclass
class Tiering:
    slots: KVTier | None = None
    window_slots: KVTier | None = None  # hybrid KV: slots of window pages (store.window_data)
    state_slots: KVTier | None = None  # recurrent layers: slots of state snapshots (store.state_data)
    store: TierStore | None = None
    persister: TierPersister | None = None
    prefetch: TierPrefetcher | None = None
    disabled_reason: str | None = None
    loaded_blocks: int = 0  # blocks found on disk at start and adopted
    loaded_states: int = 0  # recurrent-state snapshots likewise

    @classmethod
    def build(cls, config: EngineConfig, model: torch.nn.Module, block_shape: tuple[int, ...],
              dtype: torch.dtype, layout: dict[str, Any], page_shape: tuple[int, ...] = (),
              window_ratio: float = 0.0, state_bytes: int = 0) -> "Tiering":
        """A tier of slots of one pool block each: block_shape elements of dtype (the pool's
        storage: int8 pages are uint8 bytes to the tier). Hybrid KV (`page_shape`): beside
        them, window_ratio window-page slots per block slot (page_shape each), in the same
        mapping (the file, where there is one) and the same kv_offload_memory; `layout`'s
        layer_windows (each layer's window, 0 for a full layer) then goes into a persisted
        index's header (hybrid_kv), so an index is read only under the same split. Recurrent
        layers (`state_bytes`, one snapshot): one state slot per STATE_BLOCKS block slots (at
        most STATE_SHARE of the bytes), out of the same kv_offload_memory (and named in a
        persisted index's header)."""
        size = config.kv_offload_memory
        if size is None and config.kv_persist_dir is None and config.kv_offload_dir is None:
            return cls()
        if size is None:
            size = DEFAULT_TIER_BYTES
            log.info("KV tier: kv_offload_memory not set, so the tier takes the default %.2f GiB", size / 2**30)
        element = torch.empty((), dtype=dtype).element_size()
        per_block = element * int(torch.Size(block_shape).numel())
        per_page = element * int(torch.Size(page_shape).numel()) if page_shape else 0
        num_slots = int(size // (per_block + window_ratio * per_page + state_bytes / STATE_BLOCKS))
        num_window_slots = max(1, int(num_slots * window_ratio)) if per_page else 0
        num_state_slots = max(1, num_slots // STATE_BLOCKS) if state_bytes else 0
        if num_state_slots > 1 and num_state_slots * state_bytes > size * STATE_SHARE:  # large states: capped
            num_state_slots = max(1, int(size * STATE_SHARE) // state_bytes)
            num_slots = int((size - num_state_slots * state_bytes) // (per_block + window_ratio * per_page))
            num_window_slots = max(1, int(num_slots * window_ratio)) if per_page else 0
        if num_slots < 1:
            return cls._degrade(f"kv_offload_memory of {size} bytes holds no block ({per_block} bytes each)")
        directory = config.kv_persist_dir or config.kv_offload_dir
        try:
            if directory:
                os.makedirs(directory, exist_ok=True)
            store = TierStore(num_slots, block_shape, dtype, directory, num_window_slots, page_shape,
                              num_state_slots, state_bytes)
        except (OSError, ValueError) as exc:
            return cls._degrade(f"cannot create a {size}-byte tier in {directory}: {type(exc).__name__}: {exc}")
        tiering = cls(KVTier(num_slots), KVTier(num_window_slots) if num_window_slots else None,
                      KVTier(num_state_slots) if num_state_slots else None, store,
                      prefetch=TierPrefetcher.start(store))
        if config.kv_persist_dir:
            layout = dict(layout)
            layer_windows = layout.pop("layer_windows", None)
            header = {"fingerprint": model_fingerprint(model, dtype, layout), "block_size": config.block_size,
                      "kv_cache_dtype": layout.get("kv_cache_dtype")}  # named apart, so a log says it differs
            if num_window_slots:  # a slot holds the full layers only: named apart too
                header["hybrid_kv"] = {"layer_windows": layer_windows}
            if num_state_slots:  # recurrent-state snapshots in the same file
                header["recurrent_states"] = {"slots": num_state_slots, "slot_bytes": state_bytes,
                                              "offset": store.state_offset}
            tiering.persister = TierPersister(config.kv_persist_dir, store, header)
            atexit.register(tiering.close)  # the last index write, also when nobody calls close()
        log.info("KV tier: %d blocks (%.2f GiB) in %s%s%s", num_slots, num_slots * per_block / 2**30,
                 store.path or "memory", ", persisted" if tiering.persister else "",
                 f", {num_window_slots} window pages ({num_window_slots * per_page / 2**30:.2f} GiB)"
                 if num_window_slots else "")
        return tiering

    @classmethod
    def _degrade(cls, reason: str) -> "Tiering":
        log.warning("KV tier disabled, running with one tier (the pool): %s", reason)
        return cls(disabled_reason=reason)

    @property
    def persisted(self) -> bool:
        """Whether every cached block gets a tier copy that is kept on disk (the cache
        writes through and reports what each slot holds)."""
        return self.persister is not None

    def load(self, adopt: Callable[[list[TierEntry]], list[TierEntry]],
             adopt_states: Callable[[list[tuple]], list[tuple]] | None = None) -> int:
        """Hand what a previous run persisted to `adopt` (the radix cache's
        load_tier_entries, before any request) and keep what it kept, then its recurrent
        states to `adopt_states` (at the nodes rebuilt); returns blocks adopted."""
        if self.persister is None:
            return 0
        kept = adopt(self.persister.load())
        self.persister.adopt(kept)
        states = adopt_states(self.persister.loaded_states) if adopt_states is not None else []
        self.persister.adopt_states(states)
        self.loaded_blocks = len(kept)
        self.loaded_states = len(states)
        if kept:
            log.info("KV persist: %d block(s) from a previous run are in the tier", len(kept))
        return len(kept)

    def execute(self, pool: KVPool, copies: list[KVCopy], events: list[tuple[str, Any]]) -> None:
        """Run tier copies in order, then hand what they changed to the persistence thread."""
        if self.store is None:
            return
        if copies:
            self.store.run(pool, copies)
        if self.persister is not None:
            self.persister.submit(events)
        if self.prefetch is not None:
            self.prefetch.warm(self.slots)
            if self.window_slots is not None:
                self.prefetch.warm(self.window_slots, window_pages=True)

    # ---- requests held for a prefetch (engine thread; core/kv_manager.py's TierPrefetch) --

    def hold(self, key: str, slots: list[int], window_slots: list[int] = (), state_slots: list[int] = ()) -> bool:
        """Hold back the request named `key` while the prefetch thread reads these tier
        slots, window slots and recurrent state slots (those its restore will read) where
        some of their pages are not in memory; True when held."""
        if self.prefetch is None or self.store.path is None:
            return False  # an anonymous tier is in memory (its prefetcher only warms slots)
        return self.prefetch.hold(key, slots, window_slots, state_slots)

    def ready(self, wait_s: float = 0.0) -> list[str]:
        """Keys of held requests that may run now (see TierPrefetcher.ready)."""
        return self.prefetch.ready(wait_s) if self.prefetch is not None else []

    def unhold(self, key: str) -> bool:
        return self.prefetch is not None and self.prefetch.unhold(key)

    def drop_cached_pages(self) -> int:
        """Drop the tier file's pages from memory (TierStore.drop_cached_pages) once the prefetch
        thread has run what it was sent: a warm-up running later reads pages back in (its faults
        read ahead into the slots beside). Returns how many pages stay in; measurements and tests."""
        if self.store is None:
            return 0
        if self.prefetch is not None and not self.prefetch.wait_idle():
            raise RuntimeError("the KV tier prefetch thread did not finish its jobs in time")
        return self.store.drop_cached_pages()

    @property
    def num_held(self) -> int:
        return self.prefetch.num_held if self.prefetch is not None else 0

    def stats(self, tier_blocks: int) -> TierStats | None:
        """Counters of the tier, `tier_blocks` of whose slots the cache holds (None: no tier)."""
        if self.store is None:
            return None
        prefetch = self.prefetch
        return TierStats(
            tier_blocks_total=self.slots.num_slots,
            tier_blocks_used=tier_blocks,
            tier_bytes=tier_blocks * self.store.slot_bytes,
            tier_persist_failed=int(self.persister is not None and self.persister.failed is not None),
            tier_prefetched_blocks=prefetch.read_blocks if prefetch is not None else 0,
            tier_prefetch_holds=prefetch.holds if prefetch is not None else 0,
            tier_warmed_blocks=prefetch.warmed_blocks if prefetch is not None else 0,
        )

    def flush(self, timeout_s: float = 30.0) -> bool:
        return self.persister.flush(timeout_s) if self.persister is not None else True

    def close(self) -> None:
        if self.persister is not None:
            self.persister.close()
            self.persister = None
        if self.prefetch is not None:
            self.prefetch.close()
        if self.store is not None:  # after the threads that read it
            self.store.close()
            self.store = None


def model_fingerprint(model: torch.nn.Module, dtype: torch.dtype, layout: dict[str, Any]) -> str:
    """A digest of the KV layout, the dtype and the weights (each tensor's name, shape and
    an evenly spaced sample of its values), so a cache is never used with another model."""
    h = hashlib.sha256(repr((str(dtype), sorted(layout.items()))).encode())
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            flat = tensor.detach().reshape(-1)
            step = max(1, flat.numel() // _SAMPLES_PER_TENSOR)
            sample = flat[::step][:_SAMPLES_PER_TENSOR].to(torch.float32).cpu().contiguous()
            h.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
            h.update(sample.numpy().tobytes())
    return h.hexdigest()

"""KVManager: the one door to KV memory (plain Python, no tensors).

The scheduler, the engine, KV transfer (engine/kv_transfer.py) and KV import
(engine/kv_import.py) reach the pool, the tree and the tier only through it. Behind it: the
block pool (reference-counted pool blocks), the prefix cache (RadixCache, or NoPrefixCache
when caching is off: same interface, holds nothing), the cache components a model adds (one
per kind of cached state beside the full blocks: sliding-window pages, recurrent-state
snapshots), the sessions
(eviction hints) and, where the tier is file-backed, its prefetcher (requests whose restore
would read the disk wait, with status PREFETCHING, until their pages are in). The scheduler
asks in terms of a request: match and lock its cached prefix, grow its block table, release
it (its computed blocks go into the cache, its session advances), restore its tier blocks.

    scheduler ──> KVManager ──> BlockPool         allocate, share, free
    engine    ──>           ├─> RadixCache        match, lock, insert, restore, evict
    transfer  ──>           │     ├─ FullBlocks   the pool's blocks     (core/full_blocks.py)
    import    ──>           │     └─ TierSlots    the second tier's     (core/tier_slots.py)
                            ├─> components        SlidingWindow, RecurrentSnapshots (components_for)
                            ├─> SessionTable      expire, advance
                            └─> TierPrefetch      hold, ready, unhold (kv_tier/, by protocol)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from radixserve.core.block_pool import BlockPool
from radixserve.core.cache_component import CacheComponent
from radixserve.core.kv_events import KVEvent
from radixserve.core.no_prefix_cache import NoPrefixCache
from radixserve.core.radix_cache import MatchResult, RadixCache, RadixNode
from radixserve.core.recurrent_snapshots import RecurrentSnapshots, SnapshotOp
from radixserve.core.request import Request
from radixserve.core.sessions import SessionTable
from radixserve.core.sliding_window import SlidingWindow
from radixserve.kv_tier.index import KVCopy, TierEntry


def components_for(pool: BlockPool, block_size: int, max_chunk_tokens: int = 0,
                   caching: bool = True) -> list[CacheComponent]:
    """The cache components a pool needs beside its full blocks: one line per kind of state."""
    components: list[CacheComponent] = []
    if pool.window is not None:
        components.append(SlidingWindow(pool, block_size, max_chunk_tokens))
    if pool.snapshots and caching:
        components.append(RecurrentSnapshots(pool.snapshots, block_size, max_chunk_tokens))
    return components


class TierPrefetch(Protocol):
    """Reads second-tier slots into memory off the engine thread (kv_tier/tiering.py)."""

    def hold(self, key: str, slots: list[int], window_slots: list[int] = (), state_slots: list[int] = ()) -> bool:
        """Start reading these slots (and window slots, recurrent state slots) if any page of
        them is out of memory; True when the request named `key` must wait for them."""

    def ready(self, wait_s: float = 0.0) -> list[str]:
        """Keys whose slots are in now (or whose hold ran out); may wait up to wait_s."""

    def unhold(self, key: str) -> bool:
        """Forget a held key; False if it is not held."""


class NoPrefetch:
    """A tier that is never out of memory (or no tier): nothing waits."""

    def hold(self, key: str, slots: list[int], window_slots: list[int] = (), state_slots: list[int] = ()) -> bool:
        return False

    def ready(self, wait_s: float = 0.0) -> list[str]:
        return []

    def unhold(self, key: str) -> bool:
        return False


@dataclass(frozen=True)
class KVUsage:
    """The pool's and the cache's counters and gauges (engine stats)."""

    blocks_total: int
    blocks_free: int
    blocks_cached: int
    blocks_evictable: int
    evicted_blocks: int
    cache_nodes: int
    tier_blocks: int
    tier_hits: int
    restored_blocks: int
    evictions: dict[str, int] = field(default_factory=dict)
    window: dict[str, int] = field(default_factory=dict)  # hybrid KV: window_pages_{total,attached,trimmed}
    recurrent: dict[str, int] = field(default_factory=dict)  # recurrent layers: recurrent_snapshot* counters


class KVManager:
    def __init__(
        self, pool: BlockPool, cache: RadixCache | NoPrefixCache | None, block_size: int,
        sessions: SessionTable | None = None, prefetch: TierPrefetch | None = None, max_chunk_tokens: int = 0,
        components: list[CacheComponent] | None = None,
    ):
        self.pool = pool
        self.max_chunk_tokens = max_chunk_tokens  # the most tokens one request computes in a step
        self.cache = cache if cache is not None else NoPrefixCache(block_size)
        self.block_size = block_size
        self.sessions = sessions
        self.prefetch = prefetch if cache is not None and prefetch is not None else NoPrefetch()
        self.components = (components if components is not None
                           else components_for(pool, block_size, max_chunk_tokens, self.cache.caching))
        for c in self.components:
            c.attach(self.cache)
        self.cache.components = self.components
        # Blocks held outside the queues, e.g. a KV export awaiting its ack (engine/kv_transfer.py):
        # each value has a block_table (a reference per block) and a locked cache_node, like a
        # running request, and counts as one in check_integrity.
        self.external_holds: dict[str, Any] = {}

    @property
    def caching(self) -> bool:
        """Whether prefixes are cached at all (no cache: every request computes everything)."""
        return self.cache.caching

    # ---- each step ----------------------------------------------------------------

    def begin_step(self) -> None:
        if self.sessions is not None:
            self.sessions.expire()
        for c in self.components:
            c.before_step()

    def chunk_limit(self, request: Request, num_tokens: int) -> int:
        """How many of `num_tokens` the request's next chunk may compute (a recurrent model's
        prompt chunk stops where its state is to be saved)."""
        for c in self.components:
            num_tokens = c.chunk_limit(request, num_tokens)
        return num_tokens

    @property
    def snapshots(self) -> RecurrentSnapshots | None:
        """The recurrent-state snapshots component (None: the model has no recurrent layers)."""
        return next((c for c in self.components if isinstance(c, RecurrentSnapshots)), None)

    def snapshot_positions(self) -> dict[int, int]:
        """Recurrent-state snapshots the runner holds and where each stands (integrity checks)."""
        return {s: p for c in self.components if isinstance(c, RecurrentSnapshots) for s, p in c.positions().items()}

    def tier_snapshot_positions(self) -> dict[int, int]:
        """Recurrent-state snapshots in the tier's state slots and where each stands."""
        snapshots = self.snapshots
        return snapshots.tier_positions() if snapshots is not None else {}

    def take_snapshot_ops(self) -> list[SnapshotOp]:
        """The recurrent-state snapshot operations queued since the last call, for the runner
        to apply in order before the step's forward pass."""
        return [op for c in self.components if isinstance(c, RecurrentSnapshots) for op in c.take_ops()]

    def take_copies(self) -> list[KVCopy]:
        """The tier copies decided since the last call, to run in order before anything
        reuses the blocks they read (the one place they are drained)."""
        return self.cache.take_copies()

    def take_tier_events(self) -> list[tuple[str, object]]:
        """What the tier's slots hold now (blocks, then recurrent states), for its persister."""
        snapshots = self.snapshots
        return self.cache.take_tier_events() + (snapshots.take_tier_events() if snapshots is not None else [])

    def take_events(self, *followers: Any) -> list[KVEvent]:
        """The cache's block events since the last call, then each follower's (an object with
        events(cache, window): a group followed by difference, engine/kv_events.py)."""
        events = self.cache.event_log.take()
        for follower in followers:
            events += follower.events(self.cache, self.pool.window)
        return events

    def load_tier(self, entries: list[TierEntry]) -> list[TierEntry]:
        """Adopt a persisted tier's entries (before any request runs); returns those adopted."""
        return self.cache.load_tier_entries(entries)

    def load_tier_states(self, states: list[tuple]) -> list[tuple]:
        """Adopt a persisted tier's recurrent states at the nodes load_tier rebuilt."""
        snapshots = self.snapshots
        return snapshots.load_tier(states) if snapshots is not None else []

    # ---- a new request: prefetch its tier pages -------------------------------------

    def hold_for_prefetch(self, request: Request) -> bool:
        """True when the request's restore would read tier pages that are not in memory:
        they are being read in, and the request waits until `prefetched` names it."""
        if isinstance(self.prefetch, NoPrefetch):
            return False
        tokens = request.token_ids[: request.reusable_prefix_len()]
        slots = self.cache.tier_only_slots(tokens, request.cache_salt)
        windows = self.cache.tier_only_window_slots(tokens, request.cache_salt) if slots else []
        states = self._tier_state(tokens, request.cache_salt)
        return self.prefetch.hold(request.request_id, slots, windows, states)

    def _tier_state(self, tokens: list[int], salt: str | None) -> list[int]:
        """Recurrent layers: the tier state slot a request with this prefix would start from
        (the deepest kept state of its match, when only the tier keeps it), read-only."""
        snapshots = self.snapshots
        if snapshots is None or snapshots.tier is None:
            return []
        matched, node = self.cache.peek_prefix(tokens, salt)
        found = snapshots.deepest(node, matched) if node is not None and not node.is_root else None
        return [found[1]] if found is not None and found[0] < 0 else []

    def prefetched(self, wait_s: float = 0.0) -> list[str]:
        """Ids of held requests that may run now (see TierPrefetch.ready)."""
        return self.prefetch.ready(wait_s)

    def unhold(self, request: Request) -> None:
        self.prefetch.unhold(request.request_id)

    # ---- admission --------------------------------------------------------------

    def cached_prefix_len(self, request: Request) -> int:
        """Tokens of the request's reusable prefix in the cache, changing nothing."""
        return self.cache.peek_prefix(request.token_ids[: request.reusable_prefix_len()], request.cache_salt)[0]

    def peek_prefix(self, token_ids: list[int], salt: str | None = None) -> tuple[int, RadixNode | None]:
        """(cached tokens, the node the match reaches), changing nothing."""
        return self.cache.peek_prefix(token_ids, salt)

    def match_and_lock(self, request: Request) -> MatchResult:
        """The request's longest cached prefix, locked against eviction (empty: no cache),
        cut where a component keeps its state no further (hybrid KV: the window before its
        end must be resident)."""
        tokens = request.token_ids[: request.reusable_prefix_len()]
        match = self.cache.match_prefix(tokens, request.cache_salt)
        found = len(match.blocks) + match.num_tier_blocks
        if found and self.components:
            usable = min(c.usable_blocks(match) for c in self.components)
            if usable < found:
                match = self.cache.match_prefix(tokens[: usable * self.block_size], request.cache_salt)
        self.cache.lock(match.node)
        return match

    def unlock(self, match: MatchResult) -> None:
        self.cache.unlock(match.node)

    def fits(self, request: Request, match: MatchResult, output_tokens: int = 1, reserved: int = 0,
             alone: bool = False) -> bool:
        """Whether the rest of the request plus `output_tokens` generated tokens fits in what
        is free or evictable beside `reserved` blocks (admission control: an admitted
        request is not preempted at once). `alone`: no other request runs (hybrid KV: the
        windows on cached paths in use may go too, else nothing could ever run)."""
        need = -(-(request.num_tokens + max(output_tokens, 1)) // self.block_size) - len(match.blocks)
        if not all(c.fits(request, match, alone) for c in self.components):
            return False
        return need + reserved <= self.pool.num_free_blocks + self.cache.num_evictable_blocks

    def adopt_match(self, request: Request, match: MatchResult) -> None:
        """Give the request the match's blocks (restoring its tier-only part into the pool
        first) and its lock; the request's computed tokens become the matched ones."""
        blocks = self.cache.restore(match) if match.num_tier_blocks else match.blocks
        self.pool.share(blocks)
        request.block_table = list(blocks)
        request.cache_node = match.node
        for c in self.components:
            c.adopted(request, blocks)

    # ---- running ----------------------------------------------------------------

    def grow(self, request: Request, num_tokens: int) -> bool:
        """Give the request blocks for its first num_tokens tokens, evicting cached blocks if needed."""
        need = -(-num_tokens // self.block_size) - len(request.block_table)
        if need <= 0:
            return True
        for c in self.components:
            c.make_room(need)  # hybrid: cached windows go, never an entry for a page
        while need > self.pool.num_free_blocks:
            if not self.cache.evict(need - self.pool.num_free_blocks):
                break
        if need > self.pool.num_free:
            return False
        self._extend(request, self.pool.allocate(need))
        return True

    def grow_from_free(self, request: Request, num_tokens: int, keep_free: int) -> bool:
        """Blocks for num_tokens tokens from free blocks only (never evicting), leaving
        keep_free blocks free; False (nothing taken) when they are not there."""
        need = -(-num_tokens // self.block_size) - len(request.block_table)
        if need <= 0:
            return True
        if need > self.pool.num_free - keep_free:
            return False
        self._extend(request, self.pool.allocate(need))
        return True

    def _extend(self, request: Request, blocks: list[int]) -> None:
        request.block_table.extend(blocks)
        for c in self.components:
            c.extended(request, blocks)

    def shrink(self, request: Request) -> None:
        """Drop the blocks past the request's tokens (tail first): only rejected draft
        tokens used them, and they were never published to the cache."""
        keep = -(-request.num_tokens // self.block_size)
        extra = request.block_table[keep:]
        if extra:
            del request.block_table[keep:]
            for c in self.components:
                c.shrunk(request, extra)
            self.pool.free(reversed(extra))

    def insert_computed(self, request: Request) -> None:
        """Publish the request's computed full blocks to the cache and move its lock to
        the node they end at."""
        full = request.num_computed_tokens // self.block_size
        if not full or not self.cache.caching:
            return
        node = self.cache.insert(request.token_ids, request.block_table[:full], request.cache_salt)
        for c in self.components:
            c.inserted(request, node)
        if node is not request.cache_node:
            self.cache.lock(node)
            if request.cache_node is not None:
                self.cache.unlock(request.cache_node)
            request.cache_node = node

    def release(self, request: Request) -> RadixNode | None:
        """Hand the request's computed full blocks to the cache (its session advances to
        where they end), then drop its references (tail first) and its lock. Returns the
        node where its cached prefix ends (None: it never matched: a preempted request's)."""
        full = request.num_computed_tokens // self.block_size
        node = request.cache_node
        if full:
            node = self.cache.insert(request.token_ids, request.block_table[:full], request.cache_salt)
        if self.sessions is not None and request.session_id is not None and node is not None:
            self.sessions.advance(request.cache_salt, request.session_id, node)
        if request.cache_node is not None:
            self.cache.unlock(request.cache_node)
        request.cache_node = None
        for c in self.components:
            c.released(request, node)
        self.pool.free(reversed(request.block_table))
        request.block_table = []
        return node

    def trim_windows(self, running: list[Request]) -> None:
        """After a step: each component follows the running requests' progress (hybrid KV:
        blocks that fell out of a request's window lose their page unless the cache keeps it)."""
        for c in self.components:
            c.after_step(running)

    def flush(self, namespace: str | None = None) -> int:
        """Drop every unlocked cache entry (only under salt `namespace` and its sub-salts,
        when given); returns the number of pool blocks freed."""
        return self.cache.flush(namespace)

    # ---- agent hints on cached prefixes ----------------------------------------------

    def pin(self, token_ids: list[int], salt: str | None, ttl_s: float) -> int:
        """Keep the cached part of this prompt ahead of other entries for ttl_s seconds;
        returns how many of its tokens are cached and pinned."""
        match = self.cache.match_prefix(token_ids, salt)
        if match.node.is_root or self.sessions is None:
            return 0
        self.sessions.pin(match.node, ttl_s)
        return (len(match.blocks) + match.num_tier_blocks) * self.block_size

    def release_hints(self, salt: str | None, session_id: str | None, token_ids: list[int] | None) -> int:
        """Drop the session's hold and the TTL holds and pins on its context and on
        `token_ids`' cached path; returns how many."""
        if self.sessions is None:
            return 0
        node = self.cache.peek_prefix(token_ids, salt)[1] if token_ids is not None else None
        return self.sessions.release(salt, session_id, node)

    # ---- KV transfer and import (engine/kv_transfer.py, engine/kv_import.py) -----------

    def cached_pool_blocks(self, token_ids: list[int], salt: str | None) -> int:
        """Leading full blocks of the prompt the tree holds in its pool (read-only). Hybrid
        KV: never the last window's blocks before the prompt's full blocks end (their window
        pages come with a handoff, so the receiver's match reaches its end). Recurrent layers:
        only up to the deepest state kept there (the handoff's state then comes with blocks after it)."""
        bs = self.block_size
        full = len(token_ids) // bs
        tokens, node = self.cache.peek_prefix(token_ids[:full * bs], salt)
        blocks = self._pool_blocks(tokens, node)
        if self.snapshots is not None:  # recurrent layers: blocks past the deepest kept state are no use alone
            state = self.snapshots.deepest(node, blocks * bs) if blocks else None
            blocks = state[2] // bs if state is not None else 0
        window = self.pool.window
        return min(blocks, window.first_needed(full * bs)) if window is not None else blocks

    def _pool_blocks(self, tokens: int, node: RadixNode | None) -> int:
        """Of a peeked match of `tokens` ending in `node`, the leading blocks in the pool."""
        bs = self.block_size
        if node is None or node.is_root or node.in_pool:
            blocks = tokens // bs  # residency is top-connected: the whole match is in the pool
        else:
            while not node.is_root and not node.in_pool:
                node = node.parent  # the tier-only tail would need restoring: it does not count
            blocks = 0
            while not node.is_root:
                blocks += len(node.tokens) // bs
                node = node.parent
        return blocks

    def hold_prefix(self, token_ids: list[int], salt: str | None, more_than: int) -> MatchResult | None:
        """Reference and lock the pool blocks of the prompt's cached prefix when there are
        more than `more_than` of them (an export: release with drop_hold); else None."""
        match = self.cache.match_prefix(token_ids, salt)
        if len(match.blocks) <= more_than:
            return None
        self.cache.lock(match.node)
        self.pool.share(match.blocks)
        return match

    def drop_hold(self, hold_id: str, hold: Any) -> None:
        """Forget an external hold: drop its block references (tail first) and its lock."""
        self.external_holds.pop(hold_id, None)
        self.cache.unlock(hold.cache_node)
        self.pool.free(reversed(hold.block_table))

    def window_pages(self, blocks: list[int]) -> tuple[list[bool], list[int]]:
        """Hybrid KV: which of these blocks have a window page, and those pages in order."""
        window = self.pool.window
        mask = [window.has_page(b) for b in blocks]
        return mask, [window.page_of[b] for b, m in zip(blocks, mask) if m]

    def match_prefix(self, token_ids: list[int], salt: str | None) -> MatchResult:
        """The prompt's longest cached prefix (recency marked; no lock, no reference)."""
        return self.cache.match_prefix(token_ids, salt)

    def reserve(self, match: MatchResult, num_blocks: int,
                window_mask: list[bool] | None = None) -> tuple[list[int], list[int]]:
        """Lock the match and take up to `num_blocks` new blocks after it (evicting other
        entries for them): (blocks, their window pages where `window_mask` gives one); ([], [])
        with nothing held if none could be had."""
        self.cache.lock(match.node)  # the matched prefix must not be evicted to make room
        free = self.pool.num_free_blocks
        if num_blocks > free:
            self.cache.evict(num_blocks - free)
        num_blocks = min(num_blocks, self.pool.num_free_blocks)
        windows = None
        if self.pool.window is not None:  # hybrid KV: a page for each block whose window page came
            windows = window_mask[:num_blocks]
            if not all(c.make_room(sum(windows)) for c in self.components):
                num_blocks = 0
        if num_blocks <= 0:
            self.cache.unlock(match.node)
            return [], []
        blocks = self.pool.allocate(num_blocks, windows)
        if windows is None:
            return blocks, []
        page_of = self.pool.window.page_of
        return blocks, [page_of[b] for b, w in zip(blocks, windows) if w]

    def insert(self, token_ids: list[int], blocks: list[int], salt: str | None) -> RadixNode:
        """Store computed blocks in the tree (it takes its own references)."""
        return self.cache.insert(token_ids, blocks, salt)

    def exported_state(self, node: RadixNode, limit: int) -> tuple[int, int, int] | None:
        """(memory row or -1, tier state slot or -1, position) of the deepest recurrent state
        kept on `node`'s path up to token `limit`, for a KV handoff (None: none kept, or no
        recurrent layers)."""
        snapshots = self.snapshots
        return snapshots.deepest(node, limit) if snapshots is not None and not node.is_root else None

    def import_state(self, token_ids: list[int], salt: str | None, position: int, data: Any) -> bool:
        """Keep a recurrent state another engine sent (bytes `data`) at the node of the tree
        that ends at `position` of `token_ids` (whose blocks the tree holds); whether kept."""
        snapshots = self.snapshots
        if snapshots is None or position <= 0 or position % self.block_size:
            return False
        cached, node = self.cache.peek_prefix(token_ids[:position], salt)
        if cached < position:
            return False
        at = self.cache.node_at(node, position // self.block_size)
        return at is not None and snapshots.load(at, data)

    # ---- accounting -------------------------------------------------------------

    def usage(self) -> KVUsage:
        cache, window = self.cache, self.pool.window
        pages = {} if window is None else dict(window_pages_total=window.num_pages,
                                               window_pages_attached=window.num_attached,
                                               window_pages_trimmed=window.trimmed)
        snapshots = next((c for c in self.components if isinstance(c, RecurrentSnapshots)), None)
        recurrent = {} if snapshots is None else dict(
            recurrent_snapshots_total=snapshots.capacity, recurrent_snapshots_kept=snapshots.num_kept,
            recurrent_snapshot_saves=snapshots.saved, recurrent_snapshot_restores=snapshots.restored,
            recurrent_snapshots_evicted=snapshots.evicted_snapshots, recurrent_snapshots_in_tier=snapshots.num_in_tier,
            recurrent_snapshot_tier_restores=snapshots.tier_restores)
        return KVUsage(self.pool.num_blocks, self.pool.num_free_blocks, cache.num_cached_blocks,
                       cache.num_evictable_blocks, cache.evicted_blocks, cache.num_nodes, cache.num_tier_blocks,
                       cache.tier_hits, cache.restored_blocks, dict(cache.evictions), pages, recurrent)

    def check_integrity(self, running: list[Request], waiting: list[Request]) -> None:
        """Raise AssertionError unless every block reference and node lock is accounted for:
        free + cached + in use == total, ref counts equal their holders, locks equal users;
        then each component's own check."""
        running = [*running, *self.external_holds.values()]
        expected = [0] * self.pool.num_blocks
        for request in running:
            for b in request.block_table:
                expected[b] += 1
        for request in waiting:
            if request.block_table or request.cache_node is not None:
                raise AssertionError(f"waiting {request} holds blocks or a lock")
        for b in self.cache.held_blocks():
            expected[b] += 1
        self.cache.check_integrity()
        self._check_locks(running)
        if self.sessions is not None:
            self.sessions.check_integrity()
        self.pool.check_integrity(expected)
        for c in self.components:
            c.check_integrity(expected, running)

    def _check_locks(self, running: list[Request]) -> None:
        expected: dict[int, int] = {}
        for request in running:
            node = request.cache_node
            while node is not None and not node.is_root:
                expected[node.node_id] = expected.get(node.node_id, 0) + 1
                node = node.parent
        for node in self.cache.nodes():
            if node.lock_ref != expected.get(node.node_id, 0):
                raise AssertionError(f"{node} lock {node.lock_ref}, held by {expected.get(node.node_id, 0)} requests")

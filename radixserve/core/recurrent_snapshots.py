"""RecurrentSnapshots: the cache component for a model's recurrent-layer states (plain Python).

A recurrent layer (a short convolution, Gated DeltaNet) keeps one state per request instead
of K/V per token; a prefix of cached blocks serves such a model only together with the state
its recurrent layers held at that prefix's end. This component decides which tree nodes keep
a snapshot of those states (the state at the node's end, a block boundary) and hands the
runner the operations on them as ids (`SnapshotOp`): the tensors live in the runner's
RecurrentStatePool (execution/recurrent_state.py), which applies the queued operations, in
order, at the start of the next step that runs.

Where snapshots are taken (where agents resume), for each running request:
  - the end of its prompt's last whole block before the last token (a retry, n > 1, the
    next question on the same prompt resume there);
  - every `interval` tokens of a long prompt (chunk boundaries: a later prompt that leaves
    this one part way recomputes at most one interval);
  - the end of the tree's match when the match was cut (a branch point: the tree holds the
    blocks, another request diverged there, the next one to come resumes there);
  - while it decodes, every block boundary into one rolling snapshot of its own (a boundary a
    verified draft ran past too: the runner keeps that state for the next step); when it
    leaves, the last one is kept at its reply's end (the next turn resumes there).
A prompt chunk passes the first of these positions ahead of it and stops at the second
(`chunk_limit`): the runner's layers keep the state at the one passed inside the chunk (a KEEP
op), and the state stands at the other between two steps (layers that cannot keep a state
inside a chunk, `inner_saves` off: the chunk stops at the first).

A match is cut to the deepest node on its path that keeps a snapshot (`usable_blocks`); the
request then starts from that snapshot (a RESTORE op) instead of from zeros.

Budget: `capacity` snapshots (the memory plan's "recurrent" share). A new one that finds no
free room takes the place of the least valuable kept snapshot: the tokens a match ending there
would recompute without it (back to the snapshot above it on its path) over the clock ticks
since it was last saved or restored (hyperbolic: recency counts as much as size), divided by
PASSED_DISCOUNT once it is passed: a request resumed from a snapshot below it on its path, so
the conversation has moved on and only a retry of an older turn would come back to it (it is
no longer passed once a request resumes from it again). A node's lock does not keep its
snapshot: a request that matched it queued its RESTORE at adoption, and operations apply in
order, so it reads the state before a later DROP and SAVE reuse the id (running requests lock
every node of their paths: the states agents resume from would otherwise all be out of reach
while they run). Nothing kept at all: not taken.
A node that leaves the tree drops its snapshot; one whose blocks move to the second tier keeps
it (a match through the tier restores the blocks and resumes from it).

Integrity: every snapshot id is free, kept by exactly one live node, or held by one
running request (not yet in the tree); held ones belong to running requests only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from radixserve.core.cache_component import CacheComponent
from radixserve.core.kv_events import POOL, RECURRENT, TIER
from radixserve.core.radix_cache import MatchResult, RadixNode
from radixserve.core.request import Request

SAVE, RESTORE, DROP, KEEP, LOAD = "save", "restore", "drop", "keep", "load"
PASSED_DISCOUNT = 8  # a passed snapshot's value is divided by this
TO_TIER, TIER_RESTORE = "to_tier", "tier_restore"


@dataclass(frozen=True)
class SnapshotOp:
    """SAVE: copy `request`'s states (standing at token `position`) into snapshot `snapshot`;
    RESTORE: start `request`'s states from it (its next chunk starts at `position`); DROP:
    forget it; KEEP (no snapshot id): `request`'s next chunk passes `position`, keep the state
    there too (a SAVE at `position` after that step takes it); LOAD: fill snapshot `snapshot`
    from bytes another engine sent (a KV handoff); TO_TIER: copy snapshot `snapshot` into the
    second tier's state slot `slot` (its node's blocks left the pool, or the tier writes
    through); TIER_RESTORE: start `request`'s states from tier slot `slot` (standing at `position`)."""

    kind: str
    snapshot: int
    request: Request | None = None
    position: int = 0
    data: Any = None  # LOAD: the state's bytes (RecurrentStatePool.snapshot_data), standing at `position`
    slot: int = -1  # TO_TIER, TIER_RESTORE: the second tier's state slot


@dataclass
class _Held:
    """One running request's snapshot plan: positions still to save, saved ones not yet in
    the tree, and its rolling reply snapshot (position, id)."""

    request: Request
    wanted: list[int]
    seen: int  # where its computed tokens ended at the last look (before_step, adoption)
    decoding: bool = False  # it was past its prompt then: the step after was a decode (maybe drafted)
    pending: list[tuple[int, int]] = field(default_factory=list)
    rolling: tuple[int, int] | None = None
    keep: int | None = None  # a position its next chunk passes, whose state the runner keeps (KEEP)


class RecurrentSnapshots(CacheComponent):
    name = "recurrent"

    def __init__(self, capacity: int, block_size: int, interval: int):
        self.capacity = capacity
        self.block_size = block_size
        self.interval = max(block_size, interval // block_size * block_size)
        self._free = list(reversed(range(capacity)))
        self._of_node: dict[int, int] = {}  # node id -> its snapshot (the state at its end)
        self._node: dict[int, RadixNode] = {}  # snapshot -> its node
        self._used: dict[int, int] = {}  # snapshot -> recency tick of its last save or restore
        self._passed: set[int] = set()  # kept snapshots above one a request resumed from (on its path)
        self._held: dict[int, _Held] = {}  # id(request) -> its plan
        self._ops: list[SnapshotOp] = []
        self.saved = self.restored = self.evicted_snapshots = self.refused = 0
        # the runner keeps a state inside a prompt chunk (its layers honour Segment.keep_after):
        # a chunk then passes one saved position instead of stopping there (no extra step)
        self.inner_saves = False
        # the second tier's state slots (use_tier): a node whose blocks left the pool keeps its
        # snapshot there, and its memory row is freed
        self.tier = None  # a KVTier of state slots, or None
        self.write_through = False  # a persisted tier: every kept snapshot gets a tier copy too
        self._tier_of: dict[int, int] = {}  # node id -> its tier state slot
        self._tier_node: dict[int, RadixNode] = {}  # tier state slot -> its node
        # for a persisted tier: ("state", (slot, salt, digest of its node's last block, position)) / ("state_free", slot)
        self.tier_events: list[tuple[str, object]] = []
        self.tier_restores = 0

    # ---- what the runner reads -----------------------------------------------------

    def take_ops(self) -> list[SnapshotOp]:
        """The operations queued since the last call, to apply in order before the step."""
        ops, self._ops = self._ops, []
        return ops

    @property
    def num_kept(self) -> int:
        """Snapshots the tree keeps in memory."""
        return len(self._node)

    @property
    def num_in_tier(self) -> int:
        """Snapshots the tree keeps in the second tier."""
        return len(self._tier_node)

    def use_tier(self, tier: Any, write_through: bool = False) -> None:
        """Keep snapshots of nodes whose blocks left the pool in these tier state slots (a
        KVTier); `write_through` (a persisted tier): every snapshot kept gets a copy there."""
        self.tier, self.write_through = tier, write_through

    def take_tier_events(self) -> list[tuple[str, object]]:
        events, self.tier_events = self.tier_events, []
        return events

    @property
    def num_used(self) -> int:
        return self.capacity - len(self._free)

    def positions(self) -> dict[int, int]:
        """Where each saved snapshot's state stands (kept: its node's end; held: where it was
        saved), leaving out those a queued operation still changes: what the runner's rows
        must say once the queue is applied."""
        out = {snapshot: _path_tokens(node) for snapshot, node in self._node.items()}
        for held in self._held.values():
            out.update((snapshot, position) for position, snapshot in held.pending)
            if held.rolling is not None:
                out[held.rolling[1]] = held.rolling[0]
        for op in self._ops:
            out.pop(op.snapshot, None)
        return out

    def tier_positions(self) -> dict[int, int]:
        """Where each tier state slot's state stands (its node's end), leaving out those a
        queued TO_TIER still writes: what the runner's record of the slots must say."""
        out = {slot: _path_tokens(node) for slot, node in self._tier_node.items()}
        for op in self._ops:
            if op.kind == TO_TIER:
                out.pop(op.slot, None)
        return out

    # ---- the tree's side -------------------------------------------------------------

    def dropped(self, node: RadixNode) -> None:
        """A node that leaves the tree drops its snapshot, in memory and in the tier."""
        snapshot = self._of_node.get(node.node_id)
        if snapshot is not None:
            self._unbind(snapshot)
            self._drop(snapshot)
        if node.node_id in self._tier_of:
            self._free_tier(self._tier_of[node.node_id])

    def evicted(self, node: RadixNode) -> None:
        """Its blocks left the pool: one that moved to the tier (node.slots) takes its snapshot
        along into a tier state slot (when one is free or can be taken from one worth less) and
        frees its memory row; a match through the tier resumes from it there."""
        snapshot = self._of_node.get(node.node_id)
        if snapshot is None or not node.slots or self.tier is None:
            return
        if node.node_id not in self._tier_of and not self._to_tier(node, snapshot):
            return  # no tier slot: the memory row stays
        self._unbind(snapshot)
        self._drop(snapshot)

    def load_tier(self, entries: list[tuple[int, str | None, int, int]]) -> list[tuple[int, str | None, int, int]]:
        """Adopt a persisted tier's states (slot, salt, digest of its node's last block,
        position), each at the tier-only node the tree rebuilt for that block (before any
        request); returns those adopted."""
        if self.tier is None:
            return []
        by_digest = {}
        for root in self.cache._roots.values():
            stack = [root]
            while stack:
                node = stack.pop()
                stack.extend(node.children.values())
                if node.digests:
                    by_digest[(node.salt, node.digests[-1])] = node
        adopted, used = [], set()
        for slot, salt, digest, position in entries:
            node = by_digest.get((salt, digest))
            if (node is None or slot in used or not 0 <= slot < self.tier.num_slots or node.node_id in self._tier_of
                    or _path_tokens(node) != position):
                continue
            used.add(slot)
            self._bind_tier(node, slot)
            adopted.append((slot, salt, digest, position))
        self.tier.take(used)
        return adopted

    def deepest(self, node: RadixNode, limit: int) -> tuple[int, int, int] | None:
        """(memory row or -1, tier state slot or -1, position) of the deepest snapshot kept on
        `node`'s path at or before token `limit` (None: none)."""
        end = _path_tokens(node)
        while not node.is_root:
            row, slot = self._of_node.get(node.node_id, -1), self._tier_of.get(node.node_id, -1)
            if end <= limit and (row >= 0 or slot >= 0):
                return row, slot, end
            end -= len(node.tokens)
            node = node.parent
        return None

    def load(self, node: RadixNode, data: Any) -> bool:
        """Keep a state another engine computed (a KV handoff's, its bytes `data`) at `node`'s
        end, unless one is kept there already or no room is left; whether it was kept."""
        if node.node_id in self._of_node or not node.blocks:
            return False
        snapshot = self._room()
        if snapshot is None:
            return False
        self._ops.append(SnapshotOp(LOAD, snapshot, position=_path_tokens(node), data=data))
        self._used[snapshot] = self.cache.now()
        self._bind(node, snapshot)
        return True

    # ---- a request's life ------------------------------------------------------------

    def usable_blocks(self, match: MatchResult) -> int:
        """Up to the deepest node of the match's path that keeps a snapshot, in memory or in
        the tier (0: none)."""
        node, end = match.node, len(match.blocks) + match.num_tier_blocks
        while not node.is_root:
            if node.node_id in self._of_node or node.node_id in self._tier_of:
                return end
            end -= len(node.tokens) // self.block_size
            node = node.parent
        return 0

    def adopted(self, request: Request, blocks: list[int]) -> None:
        start = len(blocks) * self.block_size
        if start:
            node = request.cache_node
            snapshot = self._of_node.get(node.node_id)
            if snapshot is not None:
                self._ops.append(SnapshotOp(RESTORE, snapshot, request, start))
                self._used[snapshot] = self.cache.now()
                self._pass_above(node)
                self._passed.discard(snapshot)
            elif node.node_id in self._tier_of:
                self._ops.append(SnapshotOp(TIER_RESTORE, -1, request, start, slot=self._tier_of[node.node_id]))
                self.tier_restores += 1
            else:
                raise RuntimeError(f"{request} adopted {start} cached tokens whose recurrent state is not kept")
            self.restored += 1
        self._held[id(request)] = _Held(request, self._wanted(request, start), start)

    def chunk_limit(self, request: Request, num_tokens: int) -> int:
        """A prompt chunk stops at the next position where the request's state is saved; with
        inner saves it passes the first such position (the runner keeps the state there: KEEP)
        and stops at the second."""
        held = self._held.get(id(request))
        if held is None:
            return num_tokens
        computed = request.num_computed_tokens
        inside = [p for p in held.wanted if computed < p < computed + num_tokens]
        if not inside:
            return num_tokens
        if not self.inner_saves:
            return inside[0] - computed
        held.keep = inside[0]
        self._ops.append(SnapshotOp(KEEP, -1, request, inside[0]))
        return inside[1] - computed if len(inside) > 1 else num_tokens

    def before_step(self) -> None:
        """Between two steps (the states stand where the requests' computed tokens end):
        save those due, and put the saved ones the tree now holds the blocks of into it."""
        for held in self._held.values():
            self._save_due(held)
            if held.request.cache_node is not None:
                self._attach(held, held.request.cache_node)

    def released(self, request: Request, node: RadixNode | None) -> None:
        held = self._held.pop(id(request), None)
        if held is None:
            return
        self._save_due(held)
        if held.rolling is not None:
            held.pending.append(held.rolling)
            held.rolling = None
        if node is not None and not node.is_root:
            self._attach(held, node)
        for _, snapshot in held.pending:  # past what the tree holds: nobody can resume there
            self._drop(snapshot)

    def check_integrity(self, refs: list[int], running: list) -> None:
        held = [s for h in self._held.values() for s in [*(s for _, s in h.pending),
                                                         *([h.rolling[1]] if h.rolling else [])]]
        ids = self._free + list(self._node) + held
        if sorted(ids) != list(range(self.capacity)):
            raise AssertionError(f"recurrent snapshots: free {self._free}, kept {sorted(self._node)}, "
                                 f"held {held}: not each of {self.capacity} once")
        for snapshot, node in self._node.items():
            if not node.alive or not (node.blocks or node.slots) or self._of_node.get(node.node_id) != snapshot:
                raise AssertionError(f"recurrent snapshot {snapshot} kept by {node}: not a live node of it")
        if len(self._of_node) != len(self._node):
            raise AssertionError("recurrent snapshots: a node names a snapshot it does not keep")
        if not self._passed <= set(self._node):
            raise AssertionError(f"recurrent snapshots passed but not kept: {sorted(self._passed - set(self._node))}")
        if self.tier is not None:
            self.tier.check_integrity(list(self._tier_node))
            for slot, node in self._tier_node.items():
                if not node.alive or not (node.blocks or node.slots) or self._tier_of.get(node.node_id) != slot:
                    raise AssertionError(f"tier recurrent snapshot {slot} kept by {node}: not a live node of it")
            if len(self._tier_of) != len(self._tier_node):
                raise AssertionError("recurrent snapshots: a node names a tier slot it does not keep")
        elif self._tier_of:
            raise AssertionError("recurrent snapshots in a tier without one")
        live = {id(r) for r in running}
        for key, h in self._held.items():
            if key not in live:
                raise AssertionError(f"recurrent snapshots held by {h.request}, which is not running")
            if any(p % self.block_size or p > h.request.num_computed_tokens for p, _ in h.pending):
                raise AssertionError(f"{h.request}: a held snapshot past its computed tokens or off a block end")

    # ---- helpers ---------------------------------------------------------------------

    def _wanted(self, request: Request, start: int) -> list[int]:
        """The positions past `start` where the request's prompt state is saved: chunk
        boundaries every interval, the tree's match end (a branch point) and the end of the
        last whole block before its last token."""
        bs = self.block_size
        last = (request.num_tokens - 1) // bs * bs
        tokens = request.token_ids[: request.reusable_prefix_len()]
        branch = self.cache.peek_prefix(tokens, request.cache_salt)[0] // bs * bs
        wanted = set(range((start // self.interval + 1) * self.interval, last, self.interval))
        wanted.update((last, branch))
        return sorted(p for p in wanted if p > start)

    def _save_due(self, held: _Held) -> None:
        request = held.request
        position = request.num_computed_tokens
        keep, held.keep = held.keep, None
        if keep is not None and held.seen < keep < position and keep in held.wanted:
            held.wanted.remove(keep)  # passed inside the last chunk, its state kept by the runner
            snapshot = self._room()
            if snapshot is not None:
                self._save(request, snapshot, keep)
                held.pending.append((keep, snapshot))
        if position in held.wanted:
            held.wanted.remove(position)
            snapshot = self._room()
            if snapshot is not None:
                self._save(request, snapshot, position)
                held.pending.append((position, snapshot))
        else:
            self._save_rolling(held, position)
        held.seen, held.decoding = position, not request.in_prefill

    def _save_rolling(self, held: _Held, position: int) -> None:
        """While it decodes: the state at the last block boundary, where it stands or where its
        last step's accepted draft ran past (the runner keeps that one: RecurrentStatePool.settle)."""
        boundary = position // self.block_size * self.block_size
        if held.request.in_prefill or boundary <= 0 or (held.rolling is not None and held.rolling[0] >= boundary):
            return
        if boundary < position and not (held.decoding and boundary > held.seen):
            return  # passed by a prompt chunk, or steps ago: no state of it is left
        snapshot = held.rolling[1] if held.rolling is not None else self._room()
        if snapshot is not None:
            self._save(held.request, snapshot, boundary)
            held.rolling = (boundary, snapshot)

    def _save(self, request: Request, snapshot: int, position: int) -> None:
        self._ops.append(SnapshotOp(SAVE, snapshot, request, position))
        self._used[snapshot] = self.cache.now()
        self.saved += 1

    def _attach(self, held: _Held, node: RadixNode) -> None:
        """Saved snapshots at or before the end of `node`'s path go into the tree, each at the
        node ending at its position (split there if need be); one already kept there wins."""
        if not held.pending:
            return
        end = _path_tokens(node)
        keep = []
        for position, snapshot in held.pending:
            if position > end:
                keep.append((position, snapshot))
                continue
            at = self.cache.node_at(node, position // self.block_size)
            if at is None or at.node_id in self._of_node or not at.blocks:
                self._drop(snapshot)
                continue
            self._bind(at, snapshot)
        held.pending = keep

    def _room(self) -> int | None:
        """A free snapshot id, taking the least valuable kept one's place if none is free."""
        if self._free:
            return self._free.pop()
        now = self.cache.now()
        best, victim = None, None
        for snapshot, node in self._node.items():
            value = self._saved_tokens(node) / (now - self._used.get(snapshot, 0) + 2)
            if snapshot in self._passed:
                value /= PASSED_DISCOUNT
            if best is None or (node.rank, value) < best:
                best, victim = (node.rank, value), snapshot
        if victim is None:  # no snapshot kept at all (capacity taken by running requests)
            self.refused += 1
            return None
        self._unbind(victim)
        self._ops.append(SnapshotOp(DROP, victim))
        self.evicted_snapshots += 1
        return victim

    def _pass_above(self, node: RadixNode) -> None:
        """A request resumed from `node`'s snapshot: those above it on its path are passed."""
        above = node.parent
        while not above.is_root:
            snapshot = self._of_node.get(above.node_id)
            if snapshot is not None:
                self._passed.add(snapshot)
            above = above.parent

    def _saved_tokens(self, node: RadixNode) -> int:
        """Tokens from the snapshot above `node` on its path (or the root) to its end."""
        tokens, above = len(node.tokens), node.parent
        while not above.is_root and above.node_id not in self._of_node and above.node_id not in self._tier_of:
            tokens += len(above.tokens)
            above = above.parent
        return tokens

    def _bind(self, node: RadixNode, snapshot: int) -> None:
        self._of_node[node.node_id] = snapshot
        self._node[snapshot] = node
        self._event(node, stored=True)
        if self.write_through and node.slots and node.node_id not in self._tier_of:
            self._to_tier(node, snapshot)

    def _to_tier(self, node: RadixNode, snapshot: int) -> bool:
        """Copy the node's snapshot into a tier state slot (taking the least valuable tier
        snapshot's place if none is free); whether it found one."""
        slot = self._tier_room(node)
        if slot is None:
            return False
        self._ops.append(SnapshotOp(TO_TIER, snapshot, position=_path_tokens(node), slot=slot))
        self._bind_tier(node, slot)
        if node.digests:  # what a persisted tier's index says of the slot
            self.tier_events.append(("state", (slot, node.salt, node.digests[-1], _path_tokens(node))))
        return True

    def _bind_tier(self, node: RadixNode, slot: int) -> None:
        self._tier_of[node.node_id] = slot
        self._tier_node[slot] = node
        self._event(node, stored=True, medium=TIER)

    def _free_tier(self, slot: int) -> None:
        node = self._tier_node.pop(slot)
        del self._tier_of[node.node_id]
        self.tier.free([slot])
        self.tier_events.append(("state_free", slot))
        self._event(node, stored=False, medium=TIER)

    def _tier_room(self, node: RadixNode) -> int | None:
        """A free tier state slot, else the place of the least valuable tier snapshot of an
        unlocked node worth less than `node`'s (None: none)."""
        if self.tier.num_free:
            return self.tier.allocate(1)[0]
        now = self.cache.now()
        worth = (node.rank, self._saved_tokens(node) / math.log2(2))
        best, victim = None, None
        for slot, other in self._tier_node.items():
            if other.lock_ref or other is node:
                continue
            value = (other.rank, self._saved_tokens(other) / math.log2(now - other.last_access + 2))
            if value < worth and (best is None or value < best):
                best, victim = value, slot
        if victim is None:
            return None
        self._free_tier(victim)
        self.evicted_snapshots += 1
        return self.tier.allocate(1)[0]

    def _unbind(self, snapshot: int) -> None:
        self._passed.discard(snapshot)
        node = self._node.pop(snapshot)
        del self._of_node[node.node_id]
        self._event(node, stored=False)

    def _drop(self, snapshot: int) -> None:
        self._ops.append(SnapshotOp(DROP, snapshot))
        self._used.pop(snapshot, None)
        self._free.append(snapshot)

    def _event(self, node: RadixNode, stored: bool, medium: str = POOL) -> None:
        """The snapshot's node named by its last block (RECURRENT group, in its medium: the
        pool's memory rows, or the tier's state slots)."""
        if not node.digests:
            return
        log = self.cache.event_log
        if stored:
            parent = node.digests[-2] if len(node.digests) > 1 else (
                None if node.parent.is_root else node.parent.digests[-1])
            log.stored(node.digests[-1:], parent, node.tokens[-self.block_size:], medium, node.salt, RECURRENT)
        else:
            log.removed(node.digests[-1:], medium, RECURRENT)


def _path_tokens(node: RadixNode) -> int:
    tokens = 0
    while not node.is_root:
        tokens += len(node.tokens)
        node = node.parent
    return tokens

"""RecurrentStatePool: the per-request states of a model's recurrent layers (LFM2's short
convolutions), beside the KV pool: slot i of every recurrent layer's state tensors belongs to
one running request.

A request takes a slot the first time one of its chunks runs and gives it back once it is no
longer running (finished, aborted or preempted: its next chunk after a preemption starts at
token 0 again). Its state stands at a token position, the end of its last chunk; a chunk must
start there or at 0 (a fresh state, zeros). A chunk starting anywhere else would need the state
of a prefix this pool never saw (a prefix-cache hit that the cache has no snapshot for): that is
refused loudly, never computed wrong. The scheduling side sees none of this.

A drafted chunk (a decode and its draft tokens) keeps its states after every row until the
draft is verified; `settle` then keeps the state after the accepted tokens only, and the state
at the last block boundary the accepted tokens ran past (`block_size`), which a snapshot may
take before the next step (a reply's end is kept at a block boundary).

Snapshots are states kept by id apart from any request (`save_snapshot`, `restore_snapshot`):
the tensor half of a prefix cache for these layers, whose other half (which positions to keep,
which to evict, where a match is cut) belongs to the cache (core/recurrent_snapshots.py). Its
operations are applied, in order, once the cache's changes are run and before the step (`apply`),
while the slots of requests that left are still held (begin_step frees them after). Besides
saves, restores and drops: a KEEP asks the coming chunk's layers for the state at a position
inside it (Segment.keep_after, for the SAVE after the step); a LOAD fills a snapshot from bytes
another engine sent; TO_TIER copies a snapshot's bytes into the second tier's state slot
(`tier_store`) and TIER_RESTORE starts a request from one (`snapshot_data` is the byte layout).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from radixserve.core.plan import ScheduledChunk
from radixserve.core.recurrent_snapshots import DROP, KEEP, LOAD, RESTORE, SAVE, TIER_RESTORE, TO_TIER, SnapshotOp
from radixserve.core.request import Request, RequestStatus
from radixserve.model.recurrent_step import RecurrentStep, Segment, StateShape

_INITIAL_SLOTS = 8  # doubled as more requests run at once


@dataclass
class _Holder:
    request: Request
    slot: int
    position: int  # tokens the slot's state has consumed
    # a verified draft that ran past a block boundary before its end, or a prompt chunk told to
    # keep a position it passed (KEEP): the state there (position, per layer its tensors), for a
    # snapshot there (kept until the next begin_step)
    boundary: tuple[int, dict[int, tuple[torch.Tensor, ...]]] | None = None
    keep_at: int = 0  # the position its running chunk keeps the state at (0: none)


class RecurrentStatePool:
    def __init__(self, shapes: dict[int, tuple[StateShape, ...]], dtype: torch.dtype, device: torch.device,
                 initial_slots: int = _INITIAL_SLOTS, inner_saves: bool = False):
        self.shapes = shapes  # per recurrent layer, one request's state tensors: (shape, dtype or None)
        self.dtype = dtype
        self.device = device
        self.states: dict[int, tuple[torch.Tensor, ...]] = {}
        self.capacity = 0
        self.free: list[int] = []
        self.holders: dict[str, _Holder] = {}  # request id -> its slot
        self._step: RecurrentStep | None = None
        self._grow(initial_slots)
        self.snapshots: dict[int, tuple[torch.Tensor, ...]] = {}  # per layer, [snapshot_capacity, ...]
        self.snapshot_capacity = 0
        self.snapshot_positions: dict[int, int] = {}  # saved snapshot -> the token position it stands at
        self.max_snapshots: int | None = None  # the cache's snapshot ids are below this (room never grows past it)
        self.block_size = 0  # settle keeps the state at a block boundary a draft ran past (0: none)
        self.inner_saves = inner_saves  # every recurrent layer keeps a state inside a segment (keep_after)
        self._keep: dict[str, int] = {}  # request id -> a position its coming chunk keeps (KEEP ops)
        # the second tier's state slots (kv_tier/store.py: state_data [slots, slot_bytes] uint8, and
        # state_seq, odd while a slot is written), for TO_TIER and TIER_RESTORE ops
        self.tier_store = None
        self.tier_positions: dict[int, int] = {}  # tier state slot -> the position its state stands at

    @classmethod
    def for_model(cls, model: torch.nn.Module, dtype: torch.dtype, device: torch.device) -> "RecurrentStatePool | None":
        """The pool of a model's recurrent layers (the modules with `state_shapes`: ShortConv,
        GatedDeltaNet), or None for a model that has none."""
        layers = [m for m in model.modules() if hasattr(m, "state_shapes")]
        shapes = {m.layer_index: m.state_shapes() for m in layers}
        inner = all(getattr(m, "keeps_inner_states", False) for m in layers)
        return cls(shapes, dtype, device, inner_saves=inner) if shapes else None

    @property
    def slot_bytes(self) -> int:
        """One request's state, all layers."""
        return state_bytes(self.shapes, self.dtype)

    @property
    def nbytes(self) -> int:
        """The requests' slots and the snapshots' room."""
        return self.slot_bytes * (self.capacity + self.snapshot_capacity)

    @property
    def num_used(self) -> int:
        return len(self.holders)

    def begin_step(self, chunks: list[ScheduledChunk], chunk_starts: list[int]) -> RecurrentStep:
        """The step's RecurrentStep for chunks laid out from `chunk_starts` in the batch.
        Slots of requests no longer running are freed first."""
        for request_id in [r for r, h in self.holders.items() if h.request.status is not RequestStatus.RUNNING]:
            self.release(request_id)
        for holder in self.holders.values():
            holder.boundary = None  # the snapshot operations before this step had their chance
            holder.keep_at = 0
        keep, self._keep = self._keep, {}
        single_rows: list[int] = []
        single_slots: list[int] = []
        segments: list[Segment] = []
        for chunk, first_row in zip(chunks, chunk_starts):
            slot = self._slot_for(chunk)
            if chunk.num_tokens == 1:
                single_rows.append(first_row)
                single_slots.append(slot)
            else:
                at = keep.get(chunk.request.request_id, 0)
                inside = not chunk.draft and chunk.start < at < chunk.start + chunk.num_tokens
                segments.append(Segment(first_row, chunk.num_tokens, slot, keep_history=bool(chunk.draft),
                                        keep_after=at - chunk.start if inside else 0))
                self.holders[chunk.request.request_id].keep_at = at if inside else 0
            self.holders[chunk.request.request_id].position = chunk.start + chunk.num_tokens
        self._step = RecurrentStep(
            self.states,
            torch.tensor(single_rows, dtype=torch.int64, device=self.device),
            torch.tensor(single_slots, dtype=torch.int64, device=self.device),
            segments,
        )
        return self._step

    def settle(self, verified: list[tuple[ScheduledChunk, list[int]]]) -> None:
        """After a step's drafts are verified: each drafted chunk's request keeps the state
        after its accepted rows (its decode token and the accepted draft tokens: as many as
        the tokens it appends)."""
        step = self._step
        for chunk, tokens in verified:
            holder = self.holders[chunk.request.request_id]
            kept = len(tokens)
            end = chunk.start + kept
            boundary = end // self.block_size * self.block_size if self.block_size else 0
            rows = boundary - chunk.start if chunk.start < boundary < end else None
            passed = {}
            for layer, tensors in self.states.items():
                history = step.history.pop((layer, holder.slot))
                for state, states in zip(tensors, history):
                    state[holder.slot] = states[kept]
                if rows is not None:
                    passed[layer] = tuple(states[rows].clone() for states in history)
            holder.position = end
            holder.boundary = (boundary, passed) if rows is not None else None
        step.history.clear()

    # ---- snapshots: states kept apart from any request, by id (the cache's to decide) ----

    def apply(self, ops: list[SnapshotOp]) -> None:
        """The cache's snapshot operations, in the order it queued them (before begin_step)."""
        self._take_kept()
        handlers = {KEEP: self._keep_op, SAVE: self._save_op, RESTORE: self._restore_op, LOAD: self._load_op,
                    TO_TIER: self._to_tier_op, TIER_RESTORE: self._tier_restore_op,
                    DROP: lambda op: self.drop_snapshot(op.snapshot)}
        for op in ops:
            if op.kind not in handlers:
                raise ValueError(f"unknown snapshot operation {op.kind!r}")
            handlers[op.kind](op)

    def _keep_op(self, op: SnapshotOp) -> None:
        if not self.inner_saves:
            raise RuntimeError("a state inside a chunk was asked of layers that cannot keep one")
        self._keep[op.request.request_id] = op.position

    def _save_op(self, op: SnapshotOp) -> None:
        holder = self.holders.get(op.request.request_id)
        passed = holder.boundary if holder is not None else None
        if holder is None or holder.request is not op.request or (
                holder.position != op.position and (passed is None or passed[0] != op.position)):
            at = "no state" if holder is None else f"a state at token {holder.position}"
            raise RuntimeError(f"snapshot {op.snapshot} of request {op.request.request_id!r} at token "
                               f"{op.position}: its recurrent layers hold {at}")
        if holder.position == op.position:
            self.save_snapshot(op.request.request_id, op.snapshot)
        else:  # the block boundary its last draft ran past, or a position its last chunk passed (KEEP)
            self._save(passed[1], op.snapshot, op.position)

    def _restore_op(self, op: SnapshotOp) -> None:
        if self.restore_snapshot(op.request, op.snapshot) != op.position:
            raise RuntimeError(f"snapshot {op.snapshot} stands at token {self.snapshot_positions[op.snapshot]}, "
                               f"request {op.request.request_id!r} resumes at {op.position}")

    def _load_op(self, op: SnapshotOp) -> None:
        self.load_snapshot(op.snapshot, op.data, op.position)

    def _to_tier_op(self, op: SnapshotOp) -> None:
        if self.snapshot_positions.get(op.snapshot) != op.position:
            raise RuntimeError(f"snapshot {op.snapshot} stands at {self.snapshot_positions.get(op.snapshot)}, "
                               f"its tier copy at {op.position}")
        self._to_tier(op.snapshot, op.slot)

    def _tier_restore_op(self, op: SnapshotOp) -> None:
        if self.tier_positions.get(op.slot) != op.position:
            raise RuntimeError(f"tier state slot {op.slot} stands at {self.tier_positions.get(op.slot)}, "
                               f"request {op.request.request_id!r} resumes at {op.position}")
        holder = self.holders.get(op.request.request_id)
        if holder is None or holder.request is not op.request:
            self.release(op.request.request_id)
            holder = self._take(op.request)
        self._write({layer: tuple(t[holder.slot] for t in tensors) for layer, tensors in self.states.items()},
                    self.tier_store.state_data[op.slot])
        holder.position = op.position

    def _take_kept(self) -> None:
        """The states the last step's layers kept inside prompt chunks (Segment.keep_after),
        each as its holder's boundary state, for the SAVE that follows."""
        step = self._step
        if step is None or not step.kept:
            return
        for holder in self.holders.values():
            if holder.keep_at and (next(iter(self.states)), holder.slot) in step.kept:
                holder.boundary = (holder.keep_at, {layer: step.kept[(layer, holder.slot)] for layer in self.states})
                holder.keep_at = 0
        step.kept.clear()

    def save_snapshot(self, request_id: str, snapshot: int) -> int:
        """Copy a request's states, as they stand, into snapshot `snapshot` (made room for);
        returns the token position they stand at. Call between steps: before the step that
        moves the request on, or after the one that finished it (its slot is kept until the
        next begin_step)."""
        holder = self.holders[request_id]
        self._save({layer: tuple(t[holder.slot] for t in tensors) for layer, tensors in self.states.items()},
                   snapshot, holder.position)
        return holder.position

    def _save(self, states: dict[int, tuple[torch.Tensor, ...]], snapshot: int, position: int) -> None:
        self._snapshot_room(snapshot + 1)
        for layer, tensors in states.items():
            for kept, state in zip(self.snapshots[layer], tensors):
                kept[snapshot] = state
        self.snapshot_positions[snapshot] = position

    def restore_snapshot(self, request: Request, snapshot: int) -> int:
        """Start a request's states from snapshot `snapshot` (its next chunk then starts at the
        snapshot's position, returned) instead of from zeros."""
        if snapshot not in self.snapshot_positions:
            raise ValueError(f"no recurrent-state snapshot {snapshot} was saved")
        holder = self.holders.get(request.request_id)
        if holder is None or holder.request is not request:
            self.release(request.request_id)
            holder = self._take(request)
        for layer, tensors in self.states.items():
            for kept, state in zip(self.snapshots[layer], tensors):
                state[holder.slot] = kept[snapshot]
        holder.position = self.snapshot_positions[snapshot]
        return holder.position

    def snapshot_data(self, snapshot: int) -> torch.Tensor:
        """A saved snapshot's states as bytes (uint8 [slot_bytes], every layer's tensors in
        turn): what a KV handoff or the second tier carries."""
        parts = [kept[snapshot].reshape(-1).view(torch.uint8) for layer in sorted(self.snapshots)
                 for kept in self.snapshots[layer]]
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.uint8)

    def load_snapshot(self, snapshot: int, data: torch.Tensor, position: int) -> None:
        """Fill snapshot `snapshot` from bytes snapshot_data gave (of this model's layout),
        standing at token `position`."""
        self._snapshot_room(snapshot + 1)
        self._write({layer: tuple(kept[snapshot] for kept in tensors) for layer, tensors in self.snapshots.items()},
                    data)
        self.snapshot_positions[snapshot] = position

    def _write(self, rows: dict[int, tuple[torch.Tensor, ...]], data: torch.Tensor) -> None:
        """One request's states (per layer its row of each state tensor) from snapshot_data's bytes."""
        data = torch.as_tensor(data, dtype=torch.uint8).reshape(-1)
        if data.numel() != self.slot_bytes:
            raise ValueError(f"a recurrent state of {data.numel()} bytes, this model's is {self.slot_bytes}")
        at = 0
        for layer in sorted(rows):
            for row in rows[layer]:
                n = row.numel() * row.element_size()
                row.reshape(-1).view(torch.uint8).copy_(data[at:at + n].to(row.device))
                at += n

    def _to_tier(self, snapshot: int, slot: int) -> None:
        store = self.tier_store
        store.state_seq[slot] += 1  # odd: being written (the persistence thread checks)
        store.state_data[slot].copy_(self.snapshot_data(snapshot).cpu())
        store.state_seq[slot] += 1
        self.tier_positions[slot] = self.snapshot_positions[snapshot]

    def check_snapshots(self, expected: dict[int, int], tier: dict[int, int] | None = None) -> None:
        """Raise AssertionError unless each of these snapshots is saved and stands at its
        position (and each of the `tier` state slots)."""
        wrong = {s: self.snapshot_positions.get(s) for s, p in expected.items() if self.snapshot_positions.get(s) != p}
        if wrong:
            raise AssertionError(f"recurrent-state snapshots stand at {wrong}, the cache says {expected}")
        wrong = {s: self.tier_positions.get(s) for s, p in (tier or {}).items() if self.tier_positions.get(s) != p}
        if wrong:
            raise AssertionError(f"recurrent states in tier slots stand at {wrong}, the cache says {tier}")

    def drop_snapshot(self, snapshot: int) -> None:
        self.snapshot_positions.pop(snapshot, None)

    def _snapshot_room(self, count: int) -> None:
        if self.snapshot_capacity >= count:
            return
        capacity = max(count, 2 * self.snapshot_capacity, _INITIAL_SLOTS)
        if self.max_snapshots is not None:
            capacity = max(count, min(capacity, self.max_snapshots))
        grown = {}
        for layer, shapes in self.shapes.items():
            tensors = tuple(torch.zeros(capacity, *shape, dtype=dtype or self.dtype, device=self.device)
                            for shape, dtype in shapes)
            for new, old in zip(tensors, self.snapshots.get(layer, ())):
                new[: old.shape[0]] = old
            grown[layer] = tensors
        self.snapshots = grown
        self.snapshot_capacity = capacity

    def release(self, request_id: str) -> None:
        holder = self.holders.pop(request_id, None)
        if holder is not None:
            self.free.append(holder.slot)

    def _slot_for(self, chunk: ScheduledChunk) -> int:
        request = chunk.request
        holder = self.holders.get(request.request_id)
        if holder is not None and holder.request is not request:  # an id reused by a new request
            self.release(request.request_id)
            holder = None
        if chunk.start == 0:
            if holder is None:
                holder = self._take(request)
            for tensors in self.states.values():
                for state in tensors:
                    state[holder.slot].zero_()
            return holder.slot
        if holder is None or holder.position != chunk.start:
            at = "no state" if holder is None else f"a state at token {holder.position}"
            raise RuntimeError(
                f"request {request.request_id!r} computes from token {chunk.start} but its recurrent layers "
                f"hold {at} (a prefix hit whose state is not kept, or drafts left unsettled)")
        return holder.slot

    def _take(self, request: Request) -> _Holder:
        if not self.free:
            self._grow(self.capacity * 2)
        holder = _Holder(request, self.free.pop(), 0)
        self.holders[request.request_id] = holder
        return holder

    def _grow(self, capacity: int) -> None:
        """Room for `capacity` requests, the states held so far copied over."""
        grown = {}
        for layer, shapes in self.shapes.items():
            tensors = tuple(torch.zeros(capacity, *shape, dtype=dtype or self.dtype, device=self.device)
                            for shape, dtype in shapes)
            for new, old in zip(tensors, self.states.get(layer, ())):
                new[: old.shape[0]] = old
            grown[layer] = tensors
        self.states = grown
        self.free.extend(reversed(range(self.capacity, capacity)))
        self.capacity = capacity


def state_bytes(shapes: dict[int, tuple[StateShape, ...]], dtype: torch.dtype) -> int:
    """One request's states over these layers' shapes (a state's own dtype, else `dtype`)."""
    return sum(_itemsize(d or dtype) * _numel(shape) for layer in shapes.values() for shape, d in layer)


def model_state_bytes(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """One request's recurrent states in `model` (0: it has no recurrent layers)."""
    return state_bytes({m.layer_index: m.state_shapes() for m in model.modules() if hasattr(m, "state_shapes")}, dtype)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n

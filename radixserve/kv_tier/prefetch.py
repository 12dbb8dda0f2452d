"""TierPrefetcher: a thread that faults the second tier's slots into memory ahead of the
engine thread's copies, so that no step waits on the disk.

Restores. A request whose prefix match reaches blocks that live only in a file-backed tier,
some of whose pages are not in memory (mincore), is held back at admission: the scheduler
runs it (PREFETCHING, then WAITING) once this thread has read those slots in (readahead for all of
them, then MADV_POPULATE_READ each, or pread where the kernel has no populate), or once
`max_hold_s` has passed. Other requests step on meanwhile. A request whose pages are in
memory is never held. Hybrid KV: the window slots its restore reads are read in with them;
recurrent layers: the state slot it starts from.

Saves. The thread keeps the next slots the tier will hand out faulted in for writing
(MADV_POPULATE_WRITE): the first write to a page costs a fault (in a file mapping, with
the filesystem's bookkeeping), which the engine thread's copy would otherwise take. Hybrid
KV: the next window slots too (a saved window is ~16 MB on Gemma 3 270M, float32).

Safety. The engine thread alone changes the tree, the pool, the tier's free list and the
bytes of the slots. This thread gets slot ids and only faults pages in: it never writes a
byte, and faulting a page in never changes what it holds. A slot that is freed and reused
while it is read just has its old or new bytes brought in: harmless either way.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from radixserve.kv_tier.index import KVTier
from radixserve.kv_tier.store import TierStore

log = logging.getLogger("radixserve.tier_prefetch")

MAX_HOLD_S = 2.0  # a request is queued after this long even if its pages are not all in
WARM_WINDOW_BYTES = 128 << 20  # the next slots the tier hands out, kept faulted in for writing
_READ, _WARM, _IDLE, _STOP = 0, 1, 2, -1  # job priorities: reads (a request waits), warming, then wait_idle's mark


@dataclass(eq=False)
class _Held:
    key: str  # the held request's id
    done: threading.Event
    deadline: float


@dataclass(eq=False)
class _WarmAhead:
    """The next free slots of one tier (block slots, or hybrid KV's window slots), kept
    faulted in for writing."""

    count: int  # how many of the next free slots
    span: Callable[[int], tuple[int, int]]  # a slot's (address, length)
    slots: set[int] = field(default_factory=set)  # those sent to the thread so far
    version: int = -1  # the tier's free-list version they were read at


def _ahead_count(num_slots: int, slot_bytes: int) -> int:
    return max(1, min(num_slots // 4, WARM_WINDOW_BYTES // slot_bytes))


class TierPrefetcher:
    def __init__(self, store: TierStore, max_hold_s: float = MAX_HOLD_S):
        self.store = store
        self.pages = store.pages
        self.max_hold_s = max_hold_s
        self.read_blocks = 0  # slots read in for held requests (written by the thread)
        self.warmed_blocks = 0  # slots faulted in for writing (written by the thread)
        self.warmed_window_pages = 0  # window slots faulted in for writing (written by the thread)
        self.holds = 0  # requests held so far
        self._held: list[_Held] = []  # engine thread only
        self._ahead = {False: _WarmAhead(_ahead_count(store.num_slots, store.slot_bytes), store.slot_span)}
        if store.num_window_slots:
            self._ahead[True] = _WarmAhead(_ahead_count(store.num_window_slots, store.window_slot_bytes),
                                           store.window_span)
        self._jobs: queue.PriorityQueue[tuple[int, int, Any]] = queue.PriorityQueue()
        self._seq = itertools.count()
        self._any_done = threading.Event()
        self._failed = False
        self._closed = False
        # The thread holds no reference to the prefetcher: it ends when the engine drops it.
        self._thread = threading.Thread(target=_serve, args=(weakref.ref(self), self._jobs),
                                        name="radixserve-kv-prefetch", daemon=True)
        self._thread.start()
        weakref.finalize(self, self._jobs.put, (_STOP, -1, None))

    @classmethod
    def start(cls, store: TierStore) -> "TierPrefetcher | None":
        """A prefetcher for `store`, or None where page calls are unavailable."""
        return cls(store) if store.pages.available else None

    @property
    def window_slots(self) -> int:
        """How many of the next free block slots are kept faulted in."""
        return self._ahead[False].count

    @property
    def num_held(self) -> int:
        return len(self._held)

    # ---- engine thread ----------------------------------------------------------------

    def hold(self, key: str, slots: list[int], window_slots: list[int] = (), state_slots: list[int] = ()) -> bool:
        """Hold the request named `key` back if any of these tier slots, window slots or
        recurrent state slots (the ones its restore will read) has pages out of memory, and
        start reading those; True when held."""
        if self.store.path is None or not (slots or state_slots) or self._closed:
            return False
        spans = ([self.store.slot_span(s) for s in slots] + [self.store.window_span(w) for w in window_slots]
                 + [self.store.state_span(s) for s in state_slots])
        try:
            missing = [i for i, span in enumerate(spans) if self.pages.missing_pages(*span)]
        except OSError as exc:  # no residency to go by: the restore reads the tier itself
            log.warning("KV tier prefetch: mincore failed (%s); not holding", exc)
            return False
        if not missing:
            return False
        done = threading.Event()
        self._held.append(_Held(key, done, time.monotonic() + self.max_hold_s))
        self.holds += 1
        blocks = sum(i < len(slots) for i in missing)
        self._jobs.put((_READ, next(self._seq), ((blocks, [spans[i] for i in missing]), done)))
        return True

    def ready(self, wait_s: float = 0.0) -> list[str]:
        """Keys of held requests whose slots are in memory (or whose hold ran out), in the order
        they were held. With wait_s, first waits up to that long for one when none is."""
        if not self._held:
            return []
        if wait_s > 0 and not any(h.done.is_set() for h in self._held):
            until = min(h.deadline for h in self._held) - time.monotonic()
            self._any_done.wait(max(0.0, min(wait_s, until)))
        self._any_done.clear()  # before the flags are read: no completion is missed
        now = time.monotonic()
        out = [h for h in self._held if h.done.is_set() or now >= h.deadline or self._closed]
        if out:
            self._held = [h for h in self._held if h not in out]
        return [h.key for h in out]

    def unhold(self, key: str) -> bool:
        """Forget a held request (it is aborted); False if it is not held."""
        for i, h in enumerate(self._held):
            if h.key == key:
                del self._held[i]
                return True
        return False

    def warm(self, tier: KVTier, window_pages: bool = False) -> None:
        """Keep the next slots `tier` hands out faulted in for writing (call after the
        copies of a step: only slots that newly entered that window are sent).
        `window_pages`: `tier` holds the store's window slots (hybrid KV)."""
        ahead = self._ahead[window_pages]
        if tier.version == ahead.version:
            return
        ahead.version = tier.version
        window = tier.peek_free(ahead.count)
        new = [s for s in window if s not in ahead.slots]
        ahead.slots = set(window)
        if new:
            self._jobs.put((_WARM, next(self._seq), ((new, window_pages), None)))

    def wait_idle(self, timeout_s: float = 10.0) -> bool:
        """Wait until the thread has run every read and warm-up sent so far; False on timeout."""
        done = threading.Event()
        self._jobs.put((_IDLE, next(self._seq), ([], done)))
        return done.wait(timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the thread; from now on nothing is held (what is held is ready)."""
        self._closed = True
        self._jobs.put((_STOP, next(self._seq), None))
        self._thread.join(timeout_s)

    # ---- prefetch thread ------------------------------------------------------------

    def _do(self, kind: int, slots: Any, done: threading.Event | None) -> None:
        try:
            if kind == _READ:
                self._read(*slots)
            elif kind == _WARM:
                self._warm(*slots)
        except Exception as exc:  # a hint failed: the engine thread's copy will fault the pages in
            if not self._failed:
                self._failed = True
                log.warning("KV tier prefetch failed (%s: %s); steps read the tier themselves",
                            type(exc).__name__, exc)
        finally:
            if done is not None:
                done.set()
                self._any_done.set()

    def _read(self, blocks: int, spans: list[tuple[int, int]]) -> None:
        """Read in the spans of `blocks` slots and of window slots (after them)."""
        for span in spans:
            self.pages.will_need(*span)  # all reads queued at once
        buf = None
        for addr, length in spans:
            if not self.pages.populate(addr, length, write=False):
                buf = buf if buf is not None else bytearray(max(self.store.slot_bytes, self.store.window_slot_bytes))
                self.store.read_span(addr, length, buf)
        self.read_blocks += blocks

    def _warm(self, slots: list[int], window_pages: bool) -> None:
        span = self._ahead[window_pages].span
        for s in slots:
            if not self.pages.populate(*span(s), write=True):
                return
        if window_pages:
            self.warmed_window_pages += len(slots)
        else:
            self.warmed_blocks += len(slots)


def _serve(ref: "weakref.ref[TierPrefetcher]", jobs: queue.PriorityQueue) -> None:
    """The prefetch thread: run jobs until told to stop or the prefetcher is gone."""
    while True:
        kind, _, item = jobs.get()
        prefetcher = ref() if kind != _STOP else None
        if prefetcher is None:
            return
        prefetcher._do(kind, *item)
        del prefetcher

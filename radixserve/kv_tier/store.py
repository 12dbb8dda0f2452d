"""TierStore: the bytes of the second KV tier, one slot per block, and the copies in and out.

On CPU the pool already is RAM, so the tier is a file on local disk mapped into memory
(the OS pages it in and out): restoring a block is a copy out of the page cache, or a
disk read when it was paged out (README: restore vs recompute, measured). Without a
directory it is anonymous memory. Slot s holds tensor data[s] of the pool's block shape.
Hybrid KV: after the block slots, in the same mapping (so in the same file, persisted
with it), window slot w holds window_data[w], one window page (the window layers' K/V of
a block). Recurrent layers: after those, state slot s holds state_data[s], the bytes of one
recurrent-state snapshot (written and read by the runner's RecurrentStatePool).

Every slot (and window slot) has a sequence counter, odd while the engine thread writes
it, so the persistence thread can tell whether the bytes it checksummed are the ones it
was told of.
Other threads may fault slots in (prefetch.py), checksum them and write them back
(persist.py); only the engine thread writes their bytes, in run().
"""

from __future__ import annotations

import mmap
import os
import weakref
from collections.abc import Iterable

import torch

from radixserve.attention.kv_pool import KVPool
from radixserve.kv_tier.index import KVCopy
from radixserve.kv_tier.mapped_pages import PAGE, MappedPages, page_span

TIER_FILE = "kv_tier.bin"


class TierStore:
    def __init__(self, num_slots: int, block_shape: tuple[int, ...], dtype: torch.dtype, directory: str | None,
                 num_window_slots: int = 0, page_shape: tuple[int, ...] = (), num_state_slots: int = 0,
                 state_bytes: int = 0):
        element = torch.empty((), dtype=dtype).element_size()
        self.num_slots = num_slots
        self.slot_bytes = element * int(torch.Size(block_shape).numel())
        # hybrid KV: window pages in slots of their own, after the block slots
        self.num_window_slots = num_window_slots
        self.window_slot_bytes = element * int(torch.Size(page_shape).numel()) if num_window_slots else 0
        self.window_offset = num_slots * self.slot_bytes  # where the window slots start
        # recurrent layers: one request's states per state slot (a snapshot's bytes), after those
        self.num_state_slots = num_state_slots if state_bytes else 0
        self.state_slot_bytes = state_bytes if self.num_state_slots else 0
        self.state_offset = self.window_offset + num_window_slots * self.window_slot_bytes
        size = self.state_offset + self.num_state_slots * self.state_slot_bytes
        self.path = os.path.join(directory, TIER_FILE) if directory else None
        self._memory, self._fd = _map(self.path, size)
        self._close_fd = weakref.finalize(self, os.close, self._fd) if self._fd is not None else None
        flat = torch.frombuffer(self._memory, dtype=torch.uint8, count=size)
        self.data = flat[:self.window_offset].view(dtype).view(num_slots, *block_shape)
        self.window_data = (flat[self.window_offset:self.state_offset].view(dtype).view(num_window_slots, *page_shape)
                            if num_window_slots else None)
        self.state_data = (flat[self.state_offset:].view(self.num_state_slots, self.state_slot_bytes)
                           if self.num_state_slots else None)
        self.state_seq = [0] * self.num_state_slots
        self._base = self.data.data_ptr()  # the mapping's address, for page calls
        self.seq = [0] * num_slots
        self.window_seq = [0] * num_window_slots
        self.pages = MappedPages()

    def run(self, pool: KVPool, copies: list[KVCopy]) -> None:
        """Execute tier copies in order (the engine thread, before the forward pass): runs
        of the same direction touching distinct slots and blocks go in one batch."""
        for to_tier, batch in _batches(copies):
            blocks, slots = [c.block for c in batch], [c.slot for c in batch]
            windows = [c for c in batch if c.page >= 0 and c.window_slot >= 0]
            if to_tier:
                wslots = [c.window_slot for c in windows]
                for s in slots:
                    self.seq[s] += 1  # odd: being written
                for w in wslots:
                    self.window_seq[w] += 1
                pool.copy_blocks_out(blocks, self.data, slots)
                if windows:
                    pool.copy_pages_out([c.page for c in windows], self.window_data, wslots)
                for s in slots:
                    self.seq[s] += 1
                for w in wslots:
                    self.window_seq[w] += 1
            else:
                pool.copy_blocks_in(slots, self.data, blocks)
                if windows:
                    pool.copy_pages_in([c.window_slot for c in windows], self.window_data, [c.page for c in windows])

    def slot_view(self, slot: int) -> memoryview:
        start = slot * self.slot_bytes
        return memoryview(self._memory)[start:start + self.slot_bytes]

    def window_view(self, window_slot: int) -> memoryview:
        start = self.window_offset + window_slot * self.window_slot_bytes
        return memoryview(self._memory)[start:start + self.window_slot_bytes]

    def state_view(self, state_slot: int) -> memoryview:
        start = self.state_offset + state_slot * self.state_slot_bytes
        return memoryview(self._memory)[start:start + self.state_slot_bytes]

    def slot_span(self, slot: int, count: int = 1) -> tuple[int, int]:
        """(address, length) of `count` slots from `slot` in this process's mapping."""
        return self._base + slot * self.slot_bytes, count * self.slot_bytes

    def window_span(self, window_slot: int, count: int = 1) -> tuple[int, int]:
        """(address, length) of `count` window slots from `window_slot` in this process's mapping."""
        return self._base + self.window_offset + window_slot * self.window_slot_bytes, count * self.window_slot_bytes

    def read_span(self, addr: int, length: int, buf: bytearray) -> None:
        """Read a file-backed span (slot_span, window_span) with pread (into the page cache,
        and `buf`, at least `length` bytes, discarded)."""
        os.preadv(self._fd, [memoryview(buf)[:length]], addr - self._base)

    def state_span(self, state_slot: int, count: int = 1) -> tuple[int, int]:
        return self._base + self.state_offset + state_slot * self.state_slot_bytes, count * self.state_slot_bytes

    def sync(self, slots: Iterable[int] | None = None, window_slots: Iterable[int] = (),
             state_slots: Iterable[int] = ()) -> None:
        """Write dirty pages of a file-backed tier to disk and wait: those of `slots` and
        `window_slots`, or the whole file. Releases the GIL while it waits (mmap.flush would
        hold it)."""
        if self.path is None:
            return
        if slots is None or not self.pages.available:
            os.fsync(self._fd)
            return
        for first, count in slot_runs(slots):
            self.pages.sync(*self.slot_span(first, count))
        for first, count in slot_runs(window_slots):
            self.pages.sync(*self.window_span(first, count))
        for first, count in slot_runs(state_slots):
            self.pages.sync(*self.state_span(first, count))

    def drop_cached_pages(self) -> int:
        """Write a file-backed tier to disk and drop its pages from memory (this process's
        mapping and the page cache), as after a restart or under memory pressure; returns
        how many of its pages are still in memory (measurements and tests use it)."""
        if self.path is None:
            return 0
        os.fsync(self._fd)
        self._memory.madvise(mmap.MADV_DONTNEED)  # unmapped; a shared mapping keeps its data
        os.fsync(self._fd)
        os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return self.resident_pages()

    def resident_pages(self, slots: Iterable[int] | None = None) -> int:
        """Pages of these slots (all when None) that are in memory."""
        total = missing = 0
        for first, count in slot_runs(range(self.num_slots) if slots is None else slots):
            addr, length = self.slot_span(first, count)
            total += page_span(addr, length)[1] // PAGE
            missing += self.pages.missing_pages(addr, length)
        return total - missing

    def close(self) -> None:
        """Unmap (callers stop the threads that use the store first)."""
        self.data = self.window_data = self.state_data = None
        if self._close_fd is not None:
            self._close_fd()
        try:
            self._memory.close()
        except BufferError:  # a tensor view still refers to it; the mapping goes with the process
            pass


def slot_runs(slots: Iterable[int]) -> list[tuple[int, int]]:
    """(first, count) runs of consecutive slot ids, ascending."""
    runs: list[tuple[int, int]] = []
    for s in sorted(set(slots)):
        if runs and runs[-1][0] + runs[-1][1] == s:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((s, 1))
    return runs


def _batches(copies: list[KVCopy]):
    """(to_tier, copies) runs of consecutive copies that can run as one batch (no slot, block,
    window page or window slot twice)."""
    batch: list[KVCopy] = []
    for c in copies:
        if batch and (c.to_tier != batch[0].to_tier or any(
                c.slot == b.slot or c.block == b.block or (c.page >= 0 and c.page == b.page)
                or (c.window_slot >= 0 and c.window_slot == b.window_slot) for b in batch)):
            yield batch[0].to_tier, batch
            batch = []
        batch.append(c)
    if batch:
        yield batch[0].to_tier, batch


def _map(path: str | None, size: int) -> tuple[mmap.mmap, int | None]:
    """A shared mapping of `size` bytes and the file descriptor it maps (kept open for
    fsync and pread): of a file at `path` (created or resized, its blocks reserved up front
    so a full disk fails here and not on a later page write), or anonymous (no descriptor)."""
    if path is None:
        return mmap.mmap(-1, size), None
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if os.fstat(fd).st_size != size:
            os.ftruncate(fd, size)
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, 0, size)
        return mmap.mmap(fd, size), fd
    except BaseException:
        os.close(fd)
        raise

"""TierStore: the bytes of the second KV tier, one slot per block, and the copies in and out.

On CPU the pool already is RAM, so the tier is a file on local disk mapped into memory
(the OS pages it in and out): restoring a block is a copy out of the page cache, or a
disk read when it was paged out (README: restore vs recompute, measured). Without a
directory it is anonymous memory. Slot s holds tensor data[s] of the pool's block shape.

Every slot has a sequence counter, odd while the engine thread writes the slot, so the
persistence thread can tell whether the bytes it checksummed are the ones it was told of.
"""

from __future__ import annotations

import mmap
import os

import torch

from radixserve.attention.kv_pool import KVPool
from radixserve.core.kv_tier import KVCopy

TIER_FILE = "kv_tier.bin"


class TierStore:
    def __init__(self, num_slots: int, block_shape: tuple[int, ...], dtype: torch.dtype, directory: str | None):
        element = torch.empty((), dtype=dtype).element_size()
        self.num_slots = num_slots
        self.slot_bytes = element * int(torch.Size(block_shape).numel())
        size = num_slots * self.slot_bytes
        self.path = os.path.join(directory, TIER_FILE) if directory else None
        self._memory = _map(self.path, size)
        flat = torch.frombuffer(self._memory, dtype=torch.uint8, count=size)
        self.data = flat.view(dtype).view(num_slots, *block_shape)
        self.seq = [0] * num_slots

    def run(self, pool: KVPool, copies: list[KVCopy]) -> None:
        """Execute tier copies in order (the engine thread, before the forward pass): runs
        of the same direction touching distinct slots and blocks go in one batch."""
        for to_tier, blocks, slots in _batches(copies):
            if to_tier:
                for s in slots:
                    self.seq[s] += 1  # odd: being written
                pool.copy_blocks_out(blocks, self.data, slots)
                for s in slots:
                    self.seq[s] += 1
            else:
                pool.copy_blocks_in(slots, self.data, blocks)

    def slot_view(self, slot: int) -> memoryview:
        start = slot * self.slot_bytes
        return memoryview(self._memory)[start:start + self.slot_bytes]

    def sync(self) -> None:
        """Write dirty pages of a file-backed tier to disk."""
        if self.path is not None:
            self._memory.flush()

    def close(self) -> None:
        self.data = None
        try:
            self._memory.close()
        except BufferError:  # a tensor view still refers to it; the mapping goes with the process
            pass


def _batches(copies: list[KVCopy]):
    """(to_tier, blocks, slots) runs of consecutive copies that can run as one batch."""
    batch: list[KVCopy] = []
    for c in copies:
        if batch and (c.to_tier != batch[0].to_tier or any(c.slot == b.slot or c.block == b.block for b in batch)):
            yield batch[0].to_tier, [b.block for b in batch], [b.slot for b in batch]
            batch = []
        batch.append(c)
    if batch:
        yield batch[0].to_tier, [b.block for b in batch], [b.slot for b in batch]


def _map(path: str | None, size: int) -> mmap.mmap:
    """A shared mapping of `size` bytes: of a file at `path` (created or resized, its blocks
    reserved up front so a full disk fails here and not on a later page write), or anonymous."""
    if path is None:
        return mmap.mmap(-1, size)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        if os.fstat(fd).st_size != size:
            os.ftruncate(fd, size)
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, 0, size)
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)

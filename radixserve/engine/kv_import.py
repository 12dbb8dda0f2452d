"""The decode side's import of a KV handoff, in phases, so the byte copy can leave the engine thread:

    reserve (engine thread)  match the tree again, lock the matched prefix, allocate the blocks the
                             tree lacks; they are held like an export (kv.external_holds: a reference
                             each, the lock), in no request's block table and not in the tree, so no
                             step reads or hands them out while they fill
    copy    (any one thread) the handoff's bytes into those blocks (PendingImport.copy)
    commit  (engine thread)  insert them into the tree and drop the reservation; only then is the
                             request admitted, and its steps read them
    cancel  (engine thread)  a copy that failed, a request that went away, a reservation past its
                             deadline: free the blocks, unlock the prefix

Engine.admit_handoff given a plain KVHandoff runs the three on the engine thread (offline use).
Plain Python over the engine's pool and tree; KVTransfer (kv_transfer.py) keeps the counters.
"""

from __future__ import annotations

import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from radixserve.core.hashing import chain_hashes, root_hash

if TYPE_CHECKING:
    from radixserve.engine import Engine

Handoff = Any  # a kv_transfer.KVHandoff (not imported: kv_transfer imports this module)


@dataclass
class ImportResult:
    inserted: int = 0  # blocks copied into the pool and the tree
    already_held: int = 0  # blocks sent that the tree had by then
    failed: str | None = None  # why the handoff could not be used (the request computes it)
    state_kept: bool = False  # its recurrent state went into the tree (at its position's node)


@dataclass
class PendingImport:
    """A handoff's reserved blocks. `state` moves reserved -> copying -> copied | failed on the
    copying thread, then committed | cancelled on the engine thread (reserved -> cancelled too).
    While in kv.external_holds it counts in check_integrity like a running request."""

    handoff: Handoff
    hold_id: str
    pool: Any  # the runner's KV pool
    prefix_blocks: list[int]  # the blocks of the `have` leading blocks the tree held (locked)
    block_table: list[int]  # the reserved blocks, one reference each
    cache_node: Any  # the matched prefix's node, locked until commit or cancel (None: nothing matched)
    skip: int  # blocks the handoff carries that the tree held at reservation (not copied)
    deadline: float
    nbytes: int = 0
    state: str = "reserved"
    error: str | None = None
    copy_ms: float = 0.0
    pages: list[int] = field(default_factory=list)  # hybrid KV: the window pages of the reserved blocks sent with one
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def have(self) -> int:
        return len(self.prefix_blocks)

    def copy(self) -> None:
        """Write the bytes into the reserved blocks, once, on any thread but while the engine runs."""
        if not self._move("reserved", "copying"):
            return  # cancelled before it started, or copied already
        t0 = time.perf_counter()
        try:
            if self.block_table:
                _write_blocks(self.pool, self.block_table, self.handoff, self.skip, self.pages)
            outcome = "copied"
        except Exception as exc:  # the request computes its prompt instead
            self.error = f"copying the blocks in failed: {type(exc).__name__}: {exc}"
            outcome = "failed"
        self.copy_ms = (time.perf_counter() - t0) * 1000.0
        self.handoff.data = None  # the bytes are in the pool (or useless): let them go
        self._move("copying", outcome)

    def _move(self, old: str | tuple[str, ...], new: str) -> bool:
        with self._lock:
            if self.state not in ((old,) if isinstance(old, str) else old):
                return False
            self.state = new
            return True


def reserve(engine: "Engine", handoff: Handoff, hold_id: str, deadline: float) -> PendingImport | ImportResult:
    """The reservation of the blocks the tree lacks, or the (failed) ImportResult of a handoff
    that cannot be used. Engine thread."""
    reason = incompatible(engine, handoff)
    if reason is not None:
        return ImportResult(failed=reason)
    kv = engine.kv
    bs, start, end = handoff.block_size, handoff.start_block, handoff.start_block + handoff.num_blocks
    match = kv.match_prefix(handoff.token_ids[:end * bs], handoff.cache_salt)
    have = len(match.blocks)
    if have < start:
        return ImportResult(failed=f"the tree holds {have} leading blocks, the handoff starts at {start}")
    skip = min(have, end) - start
    todo = end - start - skip
    pending = PendingImport(handoff, hold_id, engine.runner.pool, list(match.blocks), [], None, skip, deadline,
                            handoff.nbytes)
    if todo <= 0:
        pending.state = "copied"  # nothing to copy, nothing held
        return pending
    # the matched prefix is locked (not evicted to make room, nor until commit); hybrid KV: a
    # window page for each block whose window page came
    mask = handoff.window_mask[skip:] if getattr(handoff, "window_mask", None) is not None else None
    pending.block_table, pending.pages = kv.reserve(match, todo, mask)
    if not pending.block_table:
        return ImportResult(0, skip, failed="no free block for the handoff")
    pending.cache_node = match.node
    return pending


def commit(engine: "Engine", pending: PendingImport) -> ImportResult:
    """Insert a copied reservation's blocks into the tree and drop the reservation. A reservation
    that did not copy is cancelled instead (failed). Engine thread."""
    if not pending._move("copied", "committed"):
        state, error = pending.state, pending.error
        if not cancel(engine, pending):
            return ImportResult(failed=f"the reservation is {state}, not copied")
        return ImportResult(failed=error or f"the reservation was {state}, not copied")
    h = pending.handoff
    if pending.block_table:
        blocks = pending.prefix_blocks + pending.block_table
        engine.kv.insert(h.token_ids[:len(blocks) * h.block_size], blocks, h.cache_salt)
        _drop(engine, pending)  # the tree holds its own references now
    state = getattr(h, "state_data", None)  # where the tree holds its blocks (a salted path: the tenant's)
    kept = state is not None and engine.kv.import_state(
        h.token_ids, h.cache_salt, h.state_position, torch.from_numpy(np.array(state, dtype=np.uint8)))
    return ImportResult(len(pending.block_table), pending.skip, state_kept=kept)


def cancel(engine: "Engine", pending: PendingImport) -> bool:
    """Free a reservation that will not be committed; False if it is being copied (it is freed
    later: by its owner once the copy ends, or past its deadline) or was settled already."""
    if not pending._move(("reserved", "copied", "failed"), "cancelled"):
        return False
    if pending.block_table:
        _drop(engine, pending)
    return True


def incompatible(engine: "Engine", handoff: Handoff) -> str | None:
    """Why this engine cannot take the handoff's blocks, or None."""
    pool = engine.runner.pool
    if not engine.kv.caching:
        return "the prefix cache is off"
    if handoff.block_size != engine.config.block_size:
        return f"block size {handoff.block_size} != {engine.config.block_size}"
    if tuple(handoff.block_shape) != tuple(pool.block_shape()) or handoff.dtype != str(pool.kv.dtype):
        return f"block layout {handoff.block_shape} {handoff.dtype} != {pool.block_shape()} {pool.kv.dtype}"
    if not isinstance(handoff.data, np.ndarray) or handoff.data.shape != (handoff.num_blocks, block_bytes(pool)):
        return "the handoff carries no block data of this pool's block size"
    page_shape = getattr(handoff, "page_shape", None)
    if pool.hybrid != (page_shape is not None):
        return ("the handoff keeps window layers apart (hybrid KV) and this engine does not" if page_shape is not None
                else "this engine keeps window layers apart (hybrid KV) and the handoff does not")
    if pool.hybrid:
        mask = handoff.window_mask
        if tuple(page_shape) != tuple(pool.page_shape()):
            return f"window page layout {page_shape} != {pool.page_shape()}"
        if (not isinstance(mask, list) or len(mask) != handoff.num_blocks
                or not isinstance(handoff.window_data, np.ndarray)
                or handoff.window_data.shape != (sum(mask), page_bytes(pool))):
            return "the handoff's window pages do not match its blocks"
    state = getattr(handoff, "state_data", None)
    states = engine.runner.states
    if state is not None:
        if states is None:
            return "the handoff carries a recurrent state and this model has no recurrent layers"
        if not isinstance(state, np.ndarray) or state.dtype != np.uint8 or state.size != states.slot_bytes:
            return f"a recurrent state of {getattr(state, 'size', '?')} bytes, this model's is {states.slot_bytes}"
        position, bs = handoff.state_position, handoff.block_size
        if not 0 < position <= (handoff.start_block + handoff.num_blocks) * bs or position % bs:
            return f"a recurrent state at token {position}, not a block end of the blocks it names"
    bs, start, n = handoff.block_size, handoff.start_block, handoff.num_blocks
    tokens = handoff.token_ids[:(start + n) * bs]
    if len(tokens) < (start + n) * bs:
        return "the handoff names more blocks than its prompt has"
    if chain_hashes(root_hash(handoff.cache_salt), tokens, bs)[start:] != list(handoff.block_hashes):
        return "block hashes do not match the prompt"
    return None


def block_bytes(pool: Any) -> int:
    return int(torch.Size(pool.block_shape()).numel()) * pool.kv.element_size()


def page_bytes(pool: Any) -> int:
    return int(torch.Size(pool.page_shape()).numel()) * pool.window_kv.element_size()


def _drop(engine: "Engine", pending: PendingImport) -> None:
    engine.kv.drop_hold(pending.hold_id, pending)


def _write_blocks(pool: Any, blocks: list[int], handoff: Handoff, skip: int, pages: list[int]) -> None:
    data = np.ascontiguousarray(handoff.data[skip:skip + len(blocks)])
    with warnings.catch_warnings():  # a read-only view of Ray's object store: only read here,
        warnings.simplefilter("ignore", UserWarning)  # so no copy is made of it first
        src = torch.from_numpy(data).to(pool.kv.device)
    src = src.view(pool.kv.dtype).view(len(blocks), *pool.block_shape())
    pool.copy_blocks_in(list(range(len(blocks))), src, blocks)
    if pool.hybrid:  # the window pages of the blocks that brought one (reserve gave exactly those a page)
        window = handoff.window_mask[skip:skip + len(blocks)]
        first = sum(handoff.window_mask[:skip])
        if len(pages) != sum(window):
            raise RuntimeError(f"{len(pages)} window pages reserved for {sum(window)} sent")
        if pages:
            data = np.ascontiguousarray(handoff.window_data[first:first + len(pages)])
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                psrc = torch.from_numpy(data).to(pool.window_kv.device)
            psrc = psrc.view(pool.window_kv.dtype).view(len(pages), *pool.page_shape())
            pool.copy_pages_in(list(range(len(pages))), psrc, pages)
    if pool.kv.device.type == "cuda":  # the engine thread's next step reads them on its own stream
        torch.cuda.synchronize(pool.kv.device)

"""KV handoff between two engines of one model: prefill/decode disaggregation.

The prefill engine computes a prompt through its own radix cache and samples the first
token; the decode engine, which has already matched the prompt against its own tree, gets
only the full blocks it lacks, inserts them into its tree (so its later turns hit them)
and goes on from the first token, computing the tail that is not a full block itself:

    prompt:             | b0 | b1 | b2 | b3 | tail | + first token (sampled by prefill)
    decode tree has:    | b0 | b1 |                     skip_blocks = 2
    handoff carries:              | b2 | b3 |           bytes per block, the pool's unit
    decode computes:                        | tail + first token | -> second token ...

A block moves as the pool's own per-block storage (KVPool.copy_blocks_out / in, the seam the
second tier uses), viewed as bytes: any KV dtype moves the same way. Hybrid KV (both engines
keep window layers apart): a block's bytes are its full layers, and each block that has a
window page sends it too (window_mask, window_data), so the window before the prompt's end
arrives with it; the decode side never skips those blocks (cached_blocks). Blocks are named by
their chained hashes (core/hashing.py); the decode side checks them against the token ids.
The prefill side holds the exported blocks (one reference each and a lock, like a running
request) until `release` or until `hold_s` passes, whichever comes first.

Plain Python over the engine's pool and tree on the engine thread, but for an import's byte copy,
which may run on another thread (kv_import.py: reserve, copy, commit); the transport (Ray in
radixserve.cluster) only carries KVHandoff objects.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from radixserve.core.hashing import chain_hashes, root_hash
from radixserve.engine.kv_import import ImportResult, PendingImport, block_bytes, cancel, commit, page_bytes, reserve

if TYPE_CHECKING:
    from radixserve.engine import Engine

DEFAULT_HOLD_S = 30.0


@dataclass
class KVHandoff:
    """What the prefill side sends: the prompt, its first token, and the KV bytes of the
    full blocks [start_block, start_block + num_blocks) of the prompt."""

    handoff_id: str
    token_ids: list[int]  # the prompt
    first_token: int
    cache_salt: str | None
    block_size: int
    start_block: int  # the leading blocks the decode side said it holds (not sent)
    block_hashes: list[int]  # chained hash of each block sent
    block_shape: tuple[int, ...]  # the pool's per-block shape
    dtype: str  # the pool's dtype, e.g. "torch.float32"
    data: Any = None  # uint8 array [num_blocks, bytes per block]; a Ray ObjectRef while in transit
    first_logprob: Any = None
    source: str | None = None  # the replica that holds the blocks (where `release` goes)
    export_ms: float = 0.0
    # hybrid KV: the window layers' page of each block sent that has one (window_mask), in order
    page_shape: tuple[int, ...] | None = None
    window_mask: list[bool] | None = None
    window_data: Any = None  # uint8 array [sum(window_mask), bytes per page]
    # recurrent layers: the state kept at the deepest position of the sent prefix the prefill
    # tree keeps one (a block end), as bytes (RecurrentStatePool.snapshot_data)
    state_position: int = 0
    state_data: Any = None  # uint8 array [bytes of one request's states]

    @property
    def num_blocks(self) -> int:
        return len(self.block_hashes)

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def nbytes(self) -> int:
        window = int(self.window_data.nbytes) if isinstance(self.window_data, np.ndarray) else 0
        state = int(self.state_data.nbytes) if isinstance(self.state_data, np.ndarray) else 0
        return (int(self.data.nbytes) if isinstance(self.data, np.ndarray) else 0) + window + state


class TransferFailed:
    """Stands for a handoff that never arrived (timeout, a dead prefill replica, a bad payload):
    the decode side computes the prompt itself, and counts it."""

    def __init__(self, reason: str):
        self.reason = reason

    def __repr__(self) -> str:
        return f"TransferFailed({self.reason!r})"


@dataclass
class TransferStats:
    """Counters of both roles (an engine may play either); Engine.snapshot() carries a copy."""

    block_size: int
    exports: int = 0
    sent_blocks: int = 0
    sent_bytes: int = 0
    export_ms: float = 0.0
    holds: int = 0  # exports holding their blocks now (a gauge, filled in by snapshot())
    holds_expired: int = 0
    imports: int = 0
    received_blocks: int = 0
    received_bytes: int = 0
    import_ms: float = 0.0  # copying received bytes into the pool (off the engine thread when reserved first)
    import_engine_ms: float = 0.0  # the engine thread's share of imports (reserve, commit; a synchronous copy)
    imports_pending: int = 0  # reservations not yet committed or cancelled (a gauge, filled in by snapshot())
    blocks_already_held: int = 0  # blocks a handoff carried that the decode tree had meanwhile
    skipped_blocks: int = 0  # blocks the decode side held before asking (never sent)
    sent_states: int = 0  # recurrent states sent with handoffs
    received_states: int = 0  # of those received, kept in this tree
    fallback_recomputes: int = 0  # handoffs that did not arrive or could not be used
    fallback_tokens: int = 0  # prompt tokens the decode side computed for them
    remote_prefills: int = 0  # jobs sent to a prefill replica (retries included)
    prefill_retries: int = 0  # of those, resent after the prefill replica died
    backlog_local_prefills: int = 0  # prompts computed on the decode side: the prefill role was backed up
    prefill_backlog_tokens: int = 0  # prompt tokens this decode side has waiting at prefill replicas (a gauge)
    fetch_ms: float = 0.0  # waiting for handoff bytes to arrive (the transport's share)

    @property
    def sent_tokens(self) -> int:
        return self.sent_blocks * self.block_size

    @property
    def received_tokens(self) -> int:
        return self.received_blocks * self.block_size

    def as_dict(self) -> dict[str, Any]:
        """The flat keys of Engine.stats(): every field (but block_size) as kv_<name>, token counts too."""
        out = {f"kv_{k}": v for k, v in dataclasses.asdict(self).items() if k != "block_size"}
        out.update(kv_sent_tokens=self.sent_tokens, kv_received_tokens=self.received_tokens)
        out["kv_export_holds"] = out.pop("kv_holds")
        return out


@dataclass
class _Hold:
    """An export's references: a block_table and a locked cache_node, as Scheduler counts them."""

    block_table: list[int]
    cache_node: Any
    deadline: float


class KVTransfer:
    """One engine's side of KV handoffs: exports it holds, imports it made, their counters."""

    def __init__(self, engine: "Engine", hold_s: float = DEFAULT_HOLD_S):
        self.engine = engine
        self.hold_s = hold_s
        self.stats = TransferStats(engine.config.block_size)
        self.enabled = False  # True once the engine plays a role (or did a transfer): stats report it
        self._ids = itertools.count()
        self._prefix = uuid.uuid4().hex[:8]

    # ---- both sides ---------------------------------------------------------------------

    def cached_blocks(self, token_ids: list[int], salt: str | None) -> int:
        """Leading full blocks of the prompt this engine's tree holds in its pool (read-only).
        Hybrid KV: never the last window's blocks before the prompt's full blocks end (their
        window pages come with the handoff, so the decode side's match reaches its end)."""
        return self.engine.kv.cached_pool_blocks(token_ids, salt)

    # ---- prefill side -------------------------------------------------------------------

    def export(
        self, token_ids: list[int], salt: str | None, skip_blocks: int, first_token: int,
        first_logprob: Any = None, now: float | None = None,
    ) -> KVHandoff:
        """The handoff of a computed prompt: the bytes of its full blocks from `skip_blocks`
        on, held (referenced and locked) until release() or hold_s. Blocks the tree no
        longer holds (evicted meanwhile) end the handoff early: the decode side computes them.
        Hybrid KV: each block's full layers, and the window page of each that has one."""
        t0 = time.perf_counter()
        self.enabled = True
        now = time.monotonic() if now is None else now
        self.expire(now)
        engine, kv = self.engine, self.engine.kv
        bs = engine.config.block_size
        pool = engine.runner.pool
        handoff_id = f"{self._prefix}-{next(self._ids)}"
        full = _full_blocks(token_ids, bs)
        blocks: list[int] = []
        state = None
        if full > skip_blocks:
            match = kv.hold_prefix(token_ids[:full * bs], salt, more_than=skip_blocks)
            if match is not None:
                kv.external_holds[handoff_id] = _Hold(list(match.blocks), match.node, now + self.hold_s)
                blocks = match.blocks[skip_blocks:]
                state = kv.exported_state(match.node, len(match.blocks) * bs)  # where the sent blocks end
        hashes = chain_hashes(root_hash(salt), token_ids[:(skip_blocks + len(blocks)) * bs], bs)[skip_blocks:]
        handoff = KVHandoff(
            handoff_id, list(token_ids), first_token, salt, bs, skip_blocks, hashes, tuple(pool.block_shape()),
            str(pool.kv.dtype), _read_blocks(pool, blocks), first_logprob,
        )
        if pool.hybrid:
            handoff.page_shape = tuple(pool.page_shape())
            handoff.window_mask, pages = kv.window_pages(blocks)
            handoff.window_data = _read_pages(pool, pages)
        if state is not None:
            handoff.state_position, handoff.state_data = state[2], _read_state(engine, *state)
            self.stats.sent_states += 1
        handoff.export_ms = (time.perf_counter() - t0) * 1000.0
        self.stats.exports += 1
        self.stats.sent_blocks += len(blocks)
        self.stats.sent_bytes += handoff.nbytes
        self.stats.export_ms += handoff.export_ms
        return handoff

    def release(self, handoff_id: str) -> bool:
        """The decode side has the blocks: drop the export's references and lock."""
        holds = self.engine.kv.external_holds
        if not isinstance(holds.get(handoff_id), _Hold):
            return False
        self.engine.kv.drop_hold(handoff_id, holds[handoff_id])
        return True

    def expire(self, now: float | None = None) -> int:
        """Release the exports whose ack did not come within hold_s; returns how many."""
        now = time.monotonic() if now is None else now
        holds = self.engine.kv.external_holds
        late = [h for h, hold in holds.items() if isinstance(hold, _Hold) and hold.deadline <= now]
        for handoff_id in late:
            self.release(handoff_id)
        self.stats.holds_expired += len(late)
        for stale in [h for h in holds.values() if isinstance(h, PendingImport) and h.deadline <= now]:
            self.cancel(stale)  # its owner never came back (one being copied stays until it ends)
        return len(late)

    def snapshot(self) -> TransferStats | None:
        """A copy of the counters with the holds now; None while this engine plays no role."""
        if not self.enabled:
            return None
        return dataclasses.replace(self.stats, holds=self.num_holds, imports_pending=self.num_pending)

    @property
    def num_holds(self) -> int:
        return sum(1 for h in self.engine.kv.external_holds.values() if isinstance(h, _Hold))

    @property
    def num_pending(self) -> int:
        return sum(1 for h in self.engine.kv.external_holds.values() if isinstance(h, PendingImport))

    # ---- decode side --------------------------------------------------------------------

    def take(self, handoff: "KVHandoff | PendingImport | TransferFailed | None", token_ids: list[int],
             cache_salt: str | None = None) -> KVHandoff | None:
        """The handoff a request of `token_ids` in namespace `cache_salt` goes on from, its blocks
        now in the tree; None: the request computes its prompt here (counted, unless `handoff` is
        None). A handoff of other tokens or of another namespace is not used. A reservation is
        committed, or cancelled when it does not fit. Engine thread."""
        if handoff is None:
            return None
        source = handoff.handoff if isinstance(handoff, PendingImport) else handoff
        usable = (isinstance(source, KVHandoff) and source.token_ids == list(token_ids)
                  and source.cache_salt == cache_salt)
        if isinstance(handoff, PendingImport):
            if usable:
                usable = self.commit(handoff).failed is None
            else:
                self.cancel(handoff)
        elif usable:
            usable = self.import_blocks(handoff).failed is None
        if not usable:
            self.count_fallback(len(token_ids))
            return None
        return source

    def import_blocks(self, handoff: KVHandoff) -> ImportResult:
        """Insert the handoff's blocks that this tree lacks into the pool and the tree, all on
        this thread (reserve, copy, commit). The tree is matched again first: blocks it gained
        since are not copied; a tree that lost blocks before the handoff's start (a gap) cannot
        take it (`failed`)."""
        pending = self.reserve(handoff)
        if isinstance(pending, ImportResult):
            return pending
        pending.copy()
        self.stats.import_engine_ms += pending.copy_ms  # here the copy ran on the engine thread
        return self.commit(pending)

    def reserve(self, handoff: KVHandoff, now: float | None = None) -> PendingImport | ImportResult:
        """Reserve the blocks the tree lacks for the handoff's bytes (PendingImport.copy fills
        them on any thread; then commit or cancel here), or a failed ImportResult. Engine thread."""
        t0 = time.perf_counter()
        self.enabled = True
        now = time.monotonic() if now is None else now
        self.expire(now)
        hold_id = f"import-{handoff.handoff_id}-{next(self._ids)}"
        result = reserve(self.engine, handoff, hold_id, now + self.hold_s)
        if isinstance(result, PendingImport) and result.block_table:
            self.engine.kv.external_holds[hold_id] = result
        self.stats.import_engine_ms += (time.perf_counter() - t0) * 1000.0
        return result

    def commit(self, pending: PendingImport) -> ImportResult:
        """Insert a copied reservation into the tree (counted); cancel one that did not copy."""
        t0 = time.perf_counter()
        result = commit(self.engine, pending)
        self.stats.import_ms += pending.copy_ms
        if result.failed is None:
            self.stats.imports += 1
            self.stats.received_blocks += result.inserted
            self.stats.received_bytes += pending.nbytes
            self.stats.blocks_already_held += result.already_held
            self.stats.skipped_blocks += pending.handoff.start_block
            self.stats.received_states += int(result.state_kept)
        self.stats.import_engine_ms += (time.perf_counter() - t0) * 1000.0
        return result

    def cancel(self, pending: PendingImport) -> bool:
        """Free a reservation that will not be committed (no-op once settled). Engine thread."""
        return cancel(self.engine, pending)

    def count_fallback(self, num_prompt_tokens: int) -> None:
        self.enabled = True
        self.stats.fallback_recomputes += 1
        self.stats.fallback_tokens += num_prompt_tokens


def _full_blocks(token_ids: list[int], block_size: int) -> int:
    """Full blocks of a prompt whose K/V a computed prompt leaves in the tree."""
    return len(token_ids) // block_size


def _read_blocks(pool: Any, blocks: list[int]) -> np.ndarray:
    """The blocks' bytes, [len(blocks), bytes per block], in the pool's own per-block storage."""
    shape = pool.block_shape()
    dest = torch.empty((len(blocks), *shape), dtype=pool.kv.dtype, device=pool.kv.device)
    if blocks:
        pool.copy_blocks_out(blocks, dest, list(range(len(blocks))))
    return dest.view(torch.uint8).reshape(len(blocks), block_bytes(pool)).cpu().numpy()


def _read_state(engine: "Engine", row: int, slot: int, position: int) -> np.ndarray:
    """A kept recurrent state's bytes: the runner's row (once the queued snapshot operations
    have run), else its copy in the tier's state slot."""
    states = engine.runner.states
    states.apply(engine.kv.take_snapshot_ops())
    if row < 0:
        return engine.tiering.store.state_data[slot].numpy().copy()
    if states.snapshot_positions.get(row) != position:
        raise RuntimeError(f"recurrent snapshot {row} stands at {states.snapshot_positions.get(row)}, "
                           f"the cache keeps it at {position}")
    return states.snapshot_data(row).cpu().numpy()


def _read_pages(pool: Any, pages: list[int]) -> np.ndarray:
    """Window pages' bytes, [len(pages), bytes per page] (hybrid KV)."""
    shape = pool.page_shape()
    dest = torch.empty((len(pages), *shape), dtype=pool.window_kv.dtype, device=pool.window_kv.device)
    if pages:
        pool.copy_pages_out(pages, dest, list(range(len(pages))))
    return dest.view(torch.uint8).reshape(len(pages), page_bytes(pool)).cpu().numpy()

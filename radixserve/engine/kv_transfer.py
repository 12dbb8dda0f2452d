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
second tier uses), viewed as bytes: any KV dtype moves the same way. Blocks are named by
their chained hashes (core/hashing.py); the decode side checks them against the token ids.
The prefill side holds the exported blocks (one reference each and a lock, like a running
request) until `release` or until `hold_s` passes, whichever comes first.

Plain Python over the engine's pool and tree on the engine thread; the transport (Ray in
radixserve.cluster) only carries KVHandoff objects.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
import uuid
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from radixserve.core.hashing import chain_hashes, root_hash

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

    @property
    def num_blocks(self) -> int:
        return len(self.block_hashes)

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes) if isinstance(self.data, np.ndarray) else 0


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
    import_ms: float = 0.0
    blocks_already_held: int = 0  # blocks a handoff carried that the decode tree had meanwhile
    skipped_blocks: int = 0  # blocks the decode side held before asking (never sent)
    fallback_recomputes: int = 0  # handoffs that did not arrive or could not be used
    fallback_tokens: int = 0  # prompt tokens the decode side computed for them
    remote_prefills: int = 0  # jobs sent to a prefill replica (retries included)
    prefill_retries: int = 0  # of those, resent after the prefill replica died
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


@dataclass
class ImportResult:
    inserted: int = 0  # blocks copied into the pool and the tree
    already_held: int = 0  # blocks sent that the tree had by then
    failed: str | None = None  # why the handoff could not be used (the request computes it)


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
        """Leading full blocks of the prompt this engine's tree holds in its pool (read-only)."""
        cache = self.engine.cache
        if cache is None:
            return 0
        bs = cache.block_size
        tokens, node = cache.peek_prefix(token_ids[:_full_blocks(token_ids, bs) * bs], salt)
        if node is None or node.is_root or node.in_pool:
            return tokens // bs  # residency is top-connected: the whole match is in the pool
        while not node.is_root and not node.in_pool:
            node = node.parent  # the tier-only tail would need restoring: it does not count
        blocks = 0
        while not node.is_root:
            blocks += len(node.tokens) // bs
            node = node.parent
        return blocks

    # ---- prefill side -------------------------------------------------------------------

    def export(
        self, token_ids: list[int], salt: str | None, skip_blocks: int, first_token: int,
        first_logprob: Any = None, now: float | None = None,
    ) -> KVHandoff:
        """The handoff of a computed prompt: the bytes of its full blocks from `skip_blocks`
        on, held (referenced and locked) until release() or hold_s. Blocks the tree no
        longer holds (evicted meanwhile) end the handoff early: the decode side computes them."""
        t0 = time.perf_counter()
        self.enabled = True
        now = time.monotonic() if now is None else now
        self.expire(now)
        engine, cache = self.engine, self.engine.cache
        bs = engine.config.block_size
        pool = engine.runner.pool
        handoff_id = f"{self._prefix}-{next(self._ids)}"
        full = _full_blocks(token_ids, bs)
        blocks: list[int] = []
        if cache is not None and full > skip_blocks:
            match = cache.match_prefix(token_ids[:full * bs], salt)
            if len(match.blocks) > skip_blocks:
                cache.lock(match.node)
                engine.pool.share(match.blocks)
                engine.kv.external_holds[handoff_id] = _Hold(list(match.blocks), match.node, now + self.hold_s)
                blocks = match.blocks[skip_blocks:]
        hashes = chain_hashes(root_hash(salt), token_ids[:(skip_blocks + len(blocks)) * bs], bs)[skip_blocks:]
        handoff = KVHandoff(
            handoff_id, list(token_ids), first_token, salt, bs, skip_blocks, hashes, tuple(pool.block_shape()),
            str(pool.kv.dtype), _read_blocks(pool, blocks), first_logprob,
        )
        handoff.export_ms = (time.perf_counter() - t0) * 1000.0
        self.stats.exports += 1
        self.stats.sent_blocks += len(blocks)
        self.stats.sent_bytes += handoff.nbytes
        self.stats.export_ms += handoff.export_ms
        return handoff

    def release(self, handoff_id: str) -> bool:
        """The decode side has the blocks: drop the export's references and lock."""
        hold = self.engine.kv.external_holds.pop(handoff_id, None)
        if hold is None:
            return False
        self.engine.cache.unlock(hold.cache_node)
        self.engine.pool.free(reversed(hold.block_table))
        return True

    def expire(self, now: float | None = None) -> int:
        """Release the exports whose ack did not come within hold_s; returns how many."""
        now = time.monotonic() if now is None else now
        holds = self.engine.kv.external_holds
        late = [h for h, hold in holds.items() if isinstance(hold, _Hold) and hold.deadline <= now]
        for handoff_id in late:
            self.release(handoff_id)
        self.stats.holds_expired += len(late)
        return len(late)

    def snapshot(self) -> TransferStats | None:
        """A copy of the counters with the holds now; None while this engine plays no role."""
        if not self.enabled:
            return None
        return dataclasses.replace(self.stats, holds=self.num_holds)

    @property
    def num_holds(self) -> int:
        return sum(1 for h in self.engine.kv.external_holds.values() if isinstance(h, _Hold))

    # ---- decode side --------------------------------------------------------------------

    def import_blocks(self, handoff: KVHandoff) -> ImportResult:
        """Insert the handoff's blocks that this tree lacks into the pool and the tree. The
        tree is matched again first: blocks it gained since are not copied; a tree that lost
        blocks before the handoff's start (a gap) cannot take it (`failed`)."""
        t0 = time.perf_counter()
        self.enabled = True
        result = self._import(handoff)
        self.stats.import_ms += (time.perf_counter() - t0) * 1000.0
        if result.failed is None:
            self.stats.imports += 1
            self.stats.received_blocks += result.inserted
            self.stats.received_bytes += handoff.nbytes
            self.stats.blocks_already_held += result.already_held
            self.stats.skipped_blocks += handoff.start_block
        return result

    def count_fallback(self, num_prompt_tokens: int) -> None:
        self.enabled = True
        self.stats.fallback_recomputes += 1
        self.stats.fallback_tokens += num_prompt_tokens

    def _import(self, handoff: KVHandoff) -> ImportResult:
        engine, cache = self.engine, self.engine.cache
        reason = self._incompatible(handoff)
        if reason is not None:
            return ImportResult(failed=reason)
        bs, start, n = handoff.block_size, handoff.start_block, handoff.num_blocks
        end = start + n
        match = cache.match_prefix(handoff.token_ids[:end * bs], handoff.cache_salt)
        have = len(match.blocks)
        if have < start:
            return ImportResult(failed=f"the tree holds {have} leading blocks, the handoff starts at {start}")
        skip = min(have, end) - start
        todo = end - start - skip
        if todo <= 0:
            return ImportResult(0, skip)
        cache.lock(match.node)  # the matched prefix must not be evicted to make room
        try:
            if todo > engine.pool.num_free:
                cache.evict(todo - engine.pool.num_free)
            todo = min(todo, engine.pool.num_free)
            if todo <= 0:
                return ImportResult(0, skip, failed="no free block for the handoff")
            new = engine.pool.allocate(todo)
            try:
                _write_blocks(engine.runner.pool, new, handoff, skip)
            except Exception as exc:  # nothing is in the tree yet: give the blocks back
                engine.pool.free(reversed(new))
                return ImportResult(0, skip, failed=f"copying the blocks in failed: {type(exc).__name__}: {exc}")
            cache.insert(handoff.token_ids[:(have + todo) * bs], list(match.blocks[:have]) + new, handoff.cache_salt)
            engine.pool.free(reversed(new))  # the tree holds them now
        finally:
            cache.unlock(match.node)
        return ImportResult(todo, skip)

    def _incompatible(self, handoff: KVHandoff) -> str | None:
        engine = self.engine
        pool = engine.runner.pool
        if engine.cache is None:
            return "the prefix cache is off"
        if handoff.block_size != engine.config.block_size:
            return f"block size {handoff.block_size} != {engine.config.block_size}"
        if tuple(handoff.block_shape) != tuple(pool.block_shape()) or handoff.dtype != str(pool.kv.dtype):
            return f"block layout {handoff.block_shape} {handoff.dtype} != {pool.block_shape()} {pool.kv.dtype}"
        if not isinstance(handoff.data, np.ndarray) or handoff.data.shape != (handoff.num_blocks, _block_bytes(pool)):
            return "the handoff carries no block data of this pool's block size"
        bs, start, n = handoff.block_size, handoff.start_block, handoff.num_blocks
        tokens = handoff.token_ids[:(start + n) * bs]
        if len(tokens) < (start + n) * bs:
            return "the handoff names more blocks than its prompt has"
        if chain_hashes(root_hash(handoff.cache_salt), tokens, bs)[start:] != list(handoff.block_hashes):
            return "block hashes do not match the prompt"
        return None


def _full_blocks(token_ids: list[int], block_size: int) -> int:
    """Full blocks of a prompt whose K/V a computed prompt leaves in the tree."""
    return len(token_ids) // block_size


def _block_bytes(pool: Any) -> int:
    return int(torch.Size(pool.block_shape()).numel()) * pool.kv.element_size()


def _read_blocks(pool: Any, blocks: list[int]) -> np.ndarray:
    """The blocks' bytes, [len(blocks), bytes per block], in the pool's own per-block storage."""
    shape = pool.block_shape()
    dest = torch.empty((len(blocks), *shape), dtype=pool.kv.dtype, device=pool.kv.device)
    if blocks:
        pool.copy_blocks_out(blocks, dest, list(range(len(blocks))))
    return dest.view(torch.uint8).reshape(len(blocks), _block_bytes(pool)).cpu().numpy()


def _write_blocks(pool: Any, blocks: list[int], handoff: KVHandoff, skip: int) -> None:
    data = np.ascontiguousarray(handoff.data[skip:skip + len(blocks)])
    with warnings.catch_warnings():  # a read-only view of Ray's object store: only read here,
        warnings.simplefilter("ignore", UserWarning)  # so no copy is made of it first
        src = torch.from_numpy(data).to(pool.kv.device)
    src = src.view(pool.kv.dtype).view(len(blocks), *pool.block_shape())
    pool.copy_blocks_in(list(range(len(blocks))), src, blocks)

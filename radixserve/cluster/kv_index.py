"""KVBlockIndex: which blocks each replica's prefix cache holds, as its KV event stream says
(plain Python, no Ray, no sockets: kv_subscriber.py feeds it).

Blocks are named as the replica publishes them (engine/kv_events.py wire_name): with the
"chained" scheme the cache's chained xxh3-128 hash as 16 big-endian bytes, with "chained64"
its low 64 bits. A request's blocks are named the same way from its token ids (core/hashing.py), so the
longest run of a request's leading blocks that a replica holds (in any medium: the pool, or
the second tier it restores from) is that replica's cached prefix, in blocks.

Per replica the index also keeps the stream's position: the next sequence number it expects.
A batch past it is a gap (the subscriber replays from the expected number); a batch before it
stamped later than the last one applied is a restart (the replica's publisher started over:
its state is rebuilt from a replay of the new stream); anything else before it was applied
already (a replay's overlap with the live stream).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from radixserve.core.hashing import chain_hashes, root_hash
from radixserve.engine.kv_events import HASH_SCHEMES, wire_name


def wire_hashes(token_ids: Sequence[int], block_size: int, salt: str | None = None,
                scheme: str = "chained") -> list[Any]:
    """The names a replica publishes for the whole blocks of these token ids (its cache salt
    `salt`: the tenant's namespace and the request's cache_salt, as the replica computes it)."""
    return [wire_name(h, scheme) for h in chain_hashes(root_hash(salt), list(token_ids), block_size)]


@dataclass
class ReplicaBlocks:
    """One replica's blocks by medium, and where its stream stands."""

    media: dict[str, set[Any]] = field(default_factory=dict)
    next_seq: int | None = None  # None: nothing applied yet
    last_ts: float = 0.0  # the publish time of the last batch applied
    restarts: int = 0

    def holds(self, block: Any) -> bool:
        return any(block in held for held in self.media.values())

    def all_blocks(self) -> set[Any]:
        return set().union(*self.media.values()) if self.media else set()


class KVBlockIndex:
    def __init__(self, block_size: int, scheme: str = "chained"):
        if scheme not in HASH_SCHEMES:
            raise ValueError(f"scheme must be one of {', '.join(HASH_SCHEMES)}, got {scheme!r}")
        self.block_size = block_size
        self.scheme = scheme
        self.replicas: dict[str, ReplicaBlocks] = {}

    # ---- the event stream ---------------------------------------------------------------

    def position(self, replica: str) -> int | None:
        state = self.replicas.get(replica)
        return state.next_seq if state is not None else None

    def accepts(self, replica: str, seq: int, ts: float) -> str:
        """What to do with batch `seq` published at `ts`: "apply", "skip" (applied already),
        "gap" (replay from position() first) or "restart" (reset, then replay from 0)."""
        expected = self.position(replica)
        if expected is None:
            return "apply" if seq == 0 else "gap"
        if seq == expected:
            return "apply"
        if seq > expected:
            return "gap"
        return "restart" if ts > self.replicas[replica].last_ts else "skip"

    def apply(self, replica: str, seq: int, events: list[Any], ts: float = 0.0) -> None:
        """Apply batch `seq` (decoded wire events) to the replica's blocks."""
        state = self.replicas.setdefault(replica, ReplicaBlocks())
        for event in events:
            kind = _kind(event)
            if kind == "AllBlocksCleared":
                state.media.clear()
            elif getattr(event, "group_idx", None) not in (None, 0):
                continue  # a window group's pages: routing follows the full-attention blocks
            elif kind == "BlockStored":
                state.media.setdefault(event.medium, set()).update(event.block_hashes)
            elif kind == "BlockRemoved":
                state.media.get(event.medium, set()).difference_update(event.block_hashes)
        state.next_seq = seq + 1
        state.last_ts = max(state.last_ts, ts)

    def reset(self, replica: str) -> None:
        """The replica's stream starts over (it restarted): forget its blocks and position."""
        state = self.replicas.setdefault(replica, ReplicaBlocks())
        state.media.clear()
        state.next_seq = None
        state.last_ts = 0.0
        state.restarts += 1

    def forget(self, replica: str) -> None:
        self.replicas.pop(replica, None)

    # ---- routing ------------------------------------------------------------------------

    def tracks(self, replica: str) -> bool:
        """Whether the replica's stream has been applied from its start (its view is whole)."""
        state = self.replicas.get(replica)
        return state is not None and state.next_seq is not None

    def match(self, replica: str, blocks: Iterable[Any]) -> int:
        """How many of the request's leading blocks the replica holds."""
        state = self.replicas.get(replica)
        if state is None:
            return 0
        n = 0
        for block in blocks:
            if not state.holds(block):
                break
            n += 1
        return n


def _kind(event: Any) -> str:
    return type(event).__name__  # the struct's name is its wire tag (engine/kv_events.py WireFormat)

"""KVEventPublisher: the radix cache's block events (core/kv_events.py) sent to external
routers and indexers in vLLM's published format, off the engine thread; and the one definition
of that format's structs (the cluster's subscriber decodes with the same ones).

Wire format, as vLLM publishes it (so its subscribers, NVIDIA Dynamo's KV router, llm-d's
indexer and kthena, decode it unchanged): a ZMQ PUB socket sends [topic, sequence number
(8 bytes, big endian), payload], the payload a msgpack KVEventBatch [ts, [events],
data_parallel_rank]. Each event (`wire_format` "map", the default, vLLM's form since its
KV-events change of 2026-05) is a map tagged by its "type" with named fields:
  BlockStored: block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
    lora_name, extra_keys, group_idx, kv_cache_spec_kind, kv_cache_spec_sliding_window
  BlockRemoved: block_hashes, medium, group_idx
  AllBlocksCleared
or ("array", for older consumers) a tagged array of the fields before lora_name:
["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium],
["BlockRemoved", block_hashes, medium], ["AllBlocksCleared"]. A replay socket (ROUTER)
answers a request [b"", start sequence (8 bytes)] with [b"", seq, payload] for every batch
still buffered from `start` on, then [b"", -1 (8 bytes, signed), b""].

Cache groups (group_idx, one per kind of cached state): 0 the full-attention blocks
("full_attention"), 1 a hybrid model's window pages ("sliding_window", with its window in
kv_cache_spec_sliding_window), 2 a recurrent model's state snapshots ("mamba": a node's
last block, where the cache keeps the state at its end, core/recurrent_snapshots.py). extra_keys: per block,
null, except a tenant namespace's first block: [salt] (its cache salt, as vLLM puts
cache_salt there). Hashes (`hash_scheme`): "chained": the cache's own chained xxh3-128
(core/hashing.py) as 16 big-endian bytes; "chained64": its low 64 bits as an integer (what
vLLM sends by default, and all Dynamo 1.6 decodes). Media, as consumers name them: the pool
the model reads is "GPU" (vLLM's and Dynamo's name for the primary, device tier, whatever
the device: a CPU engine's pool is still what its model reads), the second tier "CPU"
(memory: Dynamo's host tier) or "DISK" (a file, --kv-offload-dir).

The engine thread only hands each step's events over (a queue put); encoding and sending
happen on the publisher's thread, and a PUB socket drops for a subscriber too slow to keep
up (its high-water mark) rather than waiting, so no subscriber slows a step.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from typing import Any

import msgspec
import zmq

from radixserve.config import KV_EVENT_FORMATS as WIRE_FORMATS
from radixserve.config import KV_EVENT_HASHES as HASH_SCHEMES
from radixserve.core.kv_events import FULL, POOL, RECURRENT, TIER, WINDOW, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

logger = logging.getLogger(__name__)

END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)
GROUP_KINDS = {FULL: "full_attention", WINDOW: "sliding_window", RECURRENT: "mamba"}

# The published field lists, in order; the array form carries each event's first LEGACY fields.
STORED_FIELDS: list[tuple[str, Any]] = [
    ("block_hashes", list[Any]), ("parent_block_hash", Any), ("token_ids", list[int]), ("block_size", int),
    ("lora_id", int | None), ("medium", str | None), ("lora_name", str | None),
    ("extra_keys", list[list[Any] | None] | None), ("group_idx", int | None),
    ("kv_cache_spec_kind", str | None), ("kv_cache_spec_sliding_window", int | None),
]
REMOVED_FIELDS: list[tuple[str, Any]] = [("block_hashes", list[Any]), ("medium", str | None), ("group_idx", int | None)]
LEGACY = {"BlockStored": 6, "BlockRemoved": 2}


def wire_name(digest: int, hash_scheme: str):
    """A block's name on the wire: its chained hash (core/hashing.py) as 16 big-endian bytes
    ("chained"), or its low 64 bits as an integer ("chained64")."""
    if hash_scheme == "chained64":
        return digest & 0xFFFF_FFFF_FFFF_FFFF
    return digest.to_bytes(16, "big")


class WireFormat:
    """The structs of one form (map or array), built from the field lists above."""

    def __init__(self, form: str):
        if form not in WIRE_FORMATS:
            raise ValueError(f"kv_events_format must be one of {', '.join(WIRE_FORMATS)}, got {form!r}")
        array = form == "array"

        def event(name: str, fields: list[tuple[str, Any]]):
            kept = fields[:LEGACY[name]] if array and name in LEGACY else fields
            return msgspec.defstruct(name, kept, tag=name, array_like=array, gc=False)

        self.form = form
        self.BlockStored = event("BlockStored", STORED_FIELDS)
        self.BlockRemoved = event("BlockRemoved", REMOVED_FIELDS)
        self.AllBlocksCleared = event("AllBlocksCleared", [])
        union = self.BlockStored | self.BlockRemoved | self.AllBlocksCleared
        self.Batch = msgspec.defstruct("KVEventBatch", [("ts", float), ("events", list[union]),
                                                        ("data_parallel_rank", int | None, None)],
                                       array_like=True, gc=False)
        self.decoder = msgspec.msgpack.Decoder(type=self.Batch)

    def stored(self, hashes: list, parent, tokens: list[int], block_size: int, medium: str, group: int,
               window: int | None, salt: str | None):
        fields = [hashes, parent, tokens, block_size, None, medium]
        if self.form == "array":
            return self.BlockStored(*fields)
        extra = None if salt is None else [[salt]] + [None] * (len(hashes) - 1)
        return self.BlockStored(*fields, None, extra, group, GROUP_KINDS[group],
                                window if group == WINDOW else None)

    def removed(self, hashes: list, medium: str, group: int):
        if self.form == "array":
            return self.BlockRemoved(hashes, medium)
        return self.BlockRemoved(hashes, medium, group)


class KVEventPublisher:
    """Binds its sockets when made (a bad endpoint is refused then), sends from its own thread."""

    def __init__(self, endpoint: str, replay_endpoint: str | None, *, block_size: int, media: dict[str, str],
                 hash_scheme: str = "chained", topic: str = "", buffer_batches: int = 10_000,
                 data_parallel_rank: int | None = None, wire_format: str = "map", window: int | None = None):
        if hash_scheme not in HASH_SCHEMES:
            raise ValueError(f"kv_events_hash must be one of {', '.join(HASH_SCHEMES)}, got {hash_scheme!r}")
        self.block_size, self.media, self.hash_scheme = block_size, media, hash_scheme
        self.wire, self.window = WireFormat(wire_format), window
        self.topic, self.rank = topic.encode(), data_parallel_rank
        self._context = zmq.Context()
        try:
            self._pub = self._bound(zmq.PUB, endpoint, "kv_events_endpoint")
            self._replay = self._bound(zmq.ROUTER, replay_endpoint, "kv_events_replay_endpoint") \
                if replay_endpoint else None
        except ValueError:
            self._context.destroy(linger=0)
            raise
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)  # the port chosen for a "*"
        self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT) if self._replay else None
        self._encoder = msgspec.msgpack.Encoder()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._buffer: collections.deque[tuple[int, bytes]] = collections.deque(maxlen=buffer_batches)
        self.sequence = -1  # the last batch sent
        self.events_sent = 0
        self._thread = threading.Thread(target=self._run, name="radixserve-kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[KVEvent]) -> None:
        """Hand a step's events over (the engine thread; never blocks)."""
        if events:
            self._queue.put((time.time(), events))

    def flush(self, timeout: float = 5.0) -> None:
        """Wait until everything handed over so far has been sent."""
        done = threading.Event()
        self._queue.put(done)
        done.wait(timeout)

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout=5)
        self._context.destroy(linger=0)

    # ---- the publisher's thread -----------------------------------------------------

    def _run(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=0.05 if self._replay is not None else None)
            except queue.Empty:
                item = ()
            if item is None:
                return
            if isinstance(item, threading.Event):
                item.set()
            elif item:
                self._send(*item)
            self._answer_replays()

    def _send(self, ts: float, events: list[KVEvent]) -> None:
        wired = [w for w in (self._wire(e) for e in events) if w is not None]
        payload = self._encoder.encode(self.wire.Batch(ts, wired, self.rank))
        self.sequence += 1
        self._buffer.append((self.sequence, payload))
        try:
            self._pub.send_multipart([self.topic, self.sequence.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK)
        except zmq.Again:
            pass  # no subscriber able to take it now: it stays in the replay buffer
        self.events_sent += len(events)

    def _answer_replays(self) -> None:
        while self._replay is not None:
            try:
                identity, _, start = self._replay.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            first = int.from_bytes(start, "big") if len(start) == 8 else 0
            for seq, payload in list(self._buffer):
                if seq >= first:
                    self._replay.send_multipart([identity, b"", seq.to_bytes(8, "big"), payload])
            self._replay.send_multipart([identity, b"", END_OF_REPLAY, b""])

    def _wire(self, event: KVEvent):
        if isinstance(event, BlockStored):
            if event.group != FULL and self.wire.form == "array":
                return None  # the array form has no groups: older consumers see the full blocks only
            parent = None if event.parent_block_hash is None else self._hash(event.parent_block_hash)
            return self.wire.stored([self._hash(h) for h in event.block_hashes], parent, event.token_ids,
                                    self.block_size, self.media[event.medium], event.group, self.window, event.salt)
        if isinstance(event, BlockRemoved):
            if event.group != FULL and self.wire.form == "array":
                return None
            return self.wire.removed([self._hash(h) for h in event.block_hashes], self.media[event.medium],
                                     event.group)
        assert isinstance(event, AllBlocksCleared)
        return self.wire.AllBlocksCleared()

    def _hash(self, value: int):
        return wire_name(value, self.hash_scheme)

    def _bound(self, kind: int, endpoint: str, option: str):
        socket = self._context.socket(kind)
        socket.setsockopt(zmq.LINGER, 0)
        try:
            socket.bind(endpoint)
        except zmq.ZMQError as exc:
            socket.close(linger=0)
            raise ValueError(f"{option} {endpoint!r} cannot be bound: {exc}") from None
        return socket


def media_names(tier_on_disk: bool) -> dict[str, str]:
    """The medium each of the cache's places is published as (the consumers' names)."""
    return {POOL: "GPU", TIER: "DISK" if tier_on_disk else "CPU"}


class WindowGroupEvents:
    """A hybrid model's window group (group 1) as events: a cached block is in the group while
    it holds a window page (core/window_pages.py). Pages are trimmed and healed by the
    scheduler as windows slide, far from the cache's event log, so the group is followed by
    difference: each call compares the cached blocks holding pages with those published."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self.published: set[int] = set()

    def events(self, cache, window) -> list[KVEvent]:
        now: dict[int, tuple[int | None, list[int], str | None]] = {}
        bs = self.block_size
        for node in cache.nodes():
            if not node.blocks or len(node.digests) < len(node.blocks):
                continue
            first_parent = None if node.parent.is_root else node.parent.digests[-1]
            for i, b in enumerate(node.blocks):
                if window.has_page(b):
                    parent = node.digests[i - 1] if i else first_parent
                    now[node.digests[i]] = (parent, node.tokens[i * bs:(i + 1) * bs], node.salt)
        gone = [d for d in self.published if d not in now]
        out: list[KVEvent] = [BlockRemoved(gone, POOL, WINDOW)] if gone else []
        for digest, (parent, tokens, salt) in now.items():
            if digest not in self.published:
                out.append(BlockStored([digest], parent, tokens, POOL, WINDOW, salt if parent is None else None))
        self.published = set(now)
        return out

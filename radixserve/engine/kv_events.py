"""KVEventPublisher: the radix cache's block events (core/kv_events.py) sent to external
routers and indexers in vLLM's published format, off the engine thread.

Wire format, as vLLM publishes it (so its subscribers, NVIDIA Dynamo's KV router and llm-d's
indexer decode it unchanged): a ZMQ PUB socket sends [topic, sequence number (8 bytes, big
endian), payload], the payload a msgpack KVEventBatch [ts, [events], data_parallel_rank], each
event a tagged array: ["BlockStored", block_hashes, parent_block_hash, token_ids, block_size,
lora_id, medium], ["BlockRemoved", block_hashes, medium], ["AllBlocksCleared"]. A replay
socket (ROUTER) answers a request [b"", start sequence (8 bytes)] with [b"", seq, payload]
for every batch still buffered from `start` on, then [b"", -1 (8 bytes, signed), b""].

Hashes (`hash_scheme`): "chained": the cache's own chained xxh3-128 (core/hashing.py: each
block's hash is xxh3_128(parent hash as 16 little-endian bytes + its token ids as int64
little-endian), starting from 0, or from xxh3_128 of the cache salt in a tenant's
namespace) as 16 big-endian bytes; "chained64": its low 64 bits as an integer, for
indexers that keep integer hashes. Media: the pool is "GPU" or "CPU" (the device it lives
on), the second tier "CPU_TIER" (memory) or "DISK" (a file, --kv-offload-dir).

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

from radixserve.core.kv_events import POOL, TIER, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

logger = logging.getLogger(__name__)

HASH_SCHEMES = ("chained", "chained64")
END_OF_REPLAY = (-1).to_bytes(8, "big", signed=True)


class WireBlockStored(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag="BlockStored"):
    block_hashes: list[Any]
    parent_block_hash: Any
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class WireBlockRemoved(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag="BlockRemoved"):
    block_hashes: list[Any]
    medium: str | None


class WireAllBlocksCleared(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag="AllBlocksCleared"):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[WireBlockStored | WireBlockRemoved | WireAllBlocksCleared]
    data_parallel_rank: int | None = None


class KVEventPublisher:
    """Binds its sockets when made (a bad endpoint is refused then), sends from its own thread."""

    def __init__(self, endpoint: str, replay_endpoint: str | None, *, block_size: int, media: dict[str, str],
                 hash_scheme: str = "chained", topic: str = "", buffer_batches: int = 10_000,
                 data_parallel_rank: int | None = None):
        if hash_scheme not in HASH_SCHEMES:
            raise ValueError(f"kv_events_hash must be one of {', '.join(HASH_SCHEMES)}, got {hash_scheme!r}")
        self.block_size, self.media, self.hash_scheme = block_size, media, hash_scheme
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
        payload = self._encoder.encode(KVEventBatch(ts, [self._wire(e) for e in events], self.rank))
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
            parent = None if event.parent_block_hash is None else self._hash(event.parent_block_hash)
            return WireBlockStored([self._hash(h) for h in event.block_hashes], parent, event.token_ids,
                                   self.block_size, None, self.media[event.medium])
        if isinstance(event, BlockRemoved):
            return WireBlockRemoved([self._hash(h) for h in event.block_hashes], self.media[event.medium])
        assert isinstance(event, AllBlocksCleared)
        return WireAllBlocksCleared()

    def _hash(self, value: int):
        if self.hash_scheme == "chained64":
            return value & 0xFFFF_FFFF_FFFF_FFFF
        return value.to_bytes(16, "big")

    def _bound(self, kind: int, endpoint: str, option: str):
        socket = self._context.socket(kind)
        socket.setsockopt(zmq.LINGER, 0)
        try:
            socket.bind(endpoint)
        except zmq.ZMQError as exc:
            socket.close(linger=0)
            raise ValueError(f"{option} {endpoint!r} cannot be bound: {exc}") from None
        return socket


def media_names(device_type: str, tier_on_disk: bool) -> dict[str, str]:
    """The medium each of the cache's places is published as."""
    return {POOL: "GPU" if device_type == "cuda" else "CPU", TIER: "DISK" if tier_on_disk else "CPU_TIER"}

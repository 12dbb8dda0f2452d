"""KV events over ZMQ from a running engine, decoded as vLLM's published format decodes them
(pyzmq + msgspec, the structs written here as a subscriber writes them): a subscriber rebuilds
the engine's cached blocks, pool and tier apart, exactly, through eviction, tier traffic and a
flush; a restart begins with AllBlocksCleared and announces the persisted tier it adopted; the
replay socket fills what a late subscriber missed; a bad endpoint refuses the engine."""

from __future__ import annotations

import time
from typing import Any

import msgspec
import pytest
import zmq

from radixserve import Engine, SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[Any]
    parent_block_hash: Any
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[Any]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)


class Subscriber:
    """A SUB socket and a DEALER for replays; `blocks` is what it knows each medium holds."""

    def __init__(self, engine: Engine):
        publisher = engine.kv_events
        self.context = zmq.Context()
        self.sub = self.context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(publisher.endpoint)
        self.replay = self.context.socket(zmq.DEALER)
        self.replay.connect(publisher.replay_endpoint)
        self.blocks: dict[str, set] = {}
        self.next_seq = 0
        self.cleared = 0

    def catch_up(self, engine: Engine) -> None:
        """Apply everything published so far: the live stream, and a replay for any gap."""
        engine.kv_events.flush()
        while self.sub.poll(200):
            topic, seq, payload = self.sub.recv_multipart()
            seq = int.from_bytes(seq, "big")
            if seq > self.next_seq:
                self._replay_from(self.next_seq)
            if seq == self.next_seq:
                self._apply(DECODER.decode(payload))
                self.next_seq += 1
        if self.next_seq <= engine.kv_events.sequence:  # a late joiner saw nothing at all
            self._replay_from(self.next_seq)

    def close(self) -> None:
        self.context.destroy(linger=0)

    def _replay_from(self, start: int) -> None:
        self.replay.send_multipart([b"", start.to_bytes(8, "big")])
        while True:
            assert self.replay.poll(5000), "no replay answer"
            _, seq, payload = self.replay.recv_multipart()
            if not payload:
                return
            if int.from_bytes(seq, "big") == self.next_seq:
                self._apply(DECODER.decode(payload))
                self.next_seq += 1

    def _apply(self, batch: KVEventBatch) -> None:
        for e in batch.events:
            if isinstance(e, AllBlocksCleared):
                self.blocks.clear()
                self.cleared += 1
            elif isinstance(e, BlockStored):
                held = self.blocks.setdefault(e.medium, set())
                assert not held & set(e.block_hashes) and len(e.token_ids) == e.block_size * len(e.block_hashes)
                held.update(e.block_hashes)
            else:
                self.blocks[e.medium] -= set(e.block_hashes)


def engine_view(engine: Engine, tier_medium: str = "CPU_TIER") -> dict[str, set]:
    view: dict[str, set] = {"CPU": set(), tier_medium: set()}
    for node in engine.cache.nodes():
        names = [d.to_bytes(16, "big") for d in node.digests]
        if node.blocks:
            view["CPU"].update(names)
        if node.slots:
            view[tier_medium].update(names)
    return {medium: held for medium, held in view.items() if held}


def _known(sub: Subscriber) -> dict[str, set]:
    return {medium: held for medium, held in sub.blocks.items() if held}


def _prompts(seed: int, count: int) -> list[list[int]]:
    shared = [5 + i % 80 for i in range(40)]
    return [shared + [(seed * 31 + i * 7 + j) % 90 + 3 for j in range(24 + 8 * i)] for i in range(count)]


def test_a_subscriber_rebuilds_the_engines_blocks_through_eviction_tier_and_flush(tiny_model_dir):
    engine = Engine(str(tiny_model_dir("llama")), num_kv_blocks=24, kv_offload_memory=1 << 20,
                    kv_events_endpoint="tcp://127.0.0.1:*", kv_events_replay_endpoint="tcp://127.0.0.1:*")
    sub = Subscriber(engine)
    try:
        for round_ in range(4):  # the pool holds a fraction of these: blocks move to the tier and back
            engine.generate(_prompts(round_, 4), GREEDY)
            sub.catch_up(engine)
            assert _known(sub) == engine_view(engine), f"round {round_}"
        assert engine.cache.evicted_blocks and engine.cache.num_tier_blocks, "the workload moved blocks to the tier"
        engine.flush_cache()
        sub.catch_up(engine)
        assert _known(sub) == engine_view(engine) == {}
        assert sub.cleared == 1, "the engine began with AllBlocksCleared"
        engine.check_integrity()
    finally:
        sub.close()
        engine.close()


def test_a_restarted_engine_clears_and_announces_its_persisted_tier(tiny_model_dir, tmp_path):
    options = dict(num_kv_blocks=32, kv_persist_dir=str(tmp_path), kv_offload_memory=8 << 20,
                   kv_events_endpoint="tcp://127.0.0.1:*", kv_events_replay_endpoint="tcp://127.0.0.1:*")
    first = Engine(str(tiny_model_dir("llama")), **options)
    first.generate(_prompts(1, 2), GREEDY)
    first.close()
    second = Engine(str(tiny_model_dir("llama")), **options)
    sub = Subscriber(second)  # joins after the announcement: the replay brings it
    try:
        sub.catch_up(second)
        assert sub.cleared == 1
        view = engine_view(second, "DISK")
        assert view.get("DISK") and _known(sub) == view
    finally:
        sub.close()
        second.close()


def test_chained64_names_blocks_by_the_low_64_bits(tiny_model_dir):
    engine = Engine(str(tiny_model_dir("llama")), num_kv_blocks=24, kv_events_endpoint="tcp://127.0.0.1:*",
                    kv_events_replay_endpoint="tcp://127.0.0.1:*", kv_events_hash="chained64")
    sub = Subscriber(engine)
    try:
        engine.generate(_prompts(0, 1), GREEDY)
        sub.catch_up(engine)
        want = {d & (2**64 - 1) for node in engine.cache.nodes() for d in node.digests}
        assert sub.blocks["CPU"] == want and all(isinstance(h, int) for h in want)
    finally:
        sub.close()
        engine.close()


def test_a_bad_endpoint_or_option_is_refused(tiny_model_dir):
    path = str(tiny_model_dir("llama"))
    with pytest.raises(ValueError, match="cannot be bound"):
        Engine(path, kv_events_endpoint="nonsense://x")
    with pytest.raises(ValueError, match="set it too"):
        Engine(path, kv_events_replay_endpoint="tcp://127.0.0.1:*")
    with pytest.raises(ValueError, match="kv_events_hash"):
        Engine(path, kv_events_endpoint="tcp://127.0.0.1:*", kv_events_hash="sha256")


def test_publishing_never_waits_for_a_subscriber(tiny_model_dir):
    """No subscriber at all, then one that never reads: steps go on; the buffer keeps the batches."""
    engine = Engine(str(tiny_model_dir("llama")), num_kv_blocks=24, kv_events_endpoint="tcp://127.0.0.1:*")
    try:
        start = time.monotonic()
        for i in range(5):
            engine.generate(_prompts(i, 3), GREEDY)
        engine.kv_events.flush()
        assert engine.kv_events.sequence > 0 and engine.kv_events.events_sent > 0
        assert time.monotonic() - start < 60
    finally:
        engine.close()


def test_a_decode_engine_announces_a_handoffs_blocks_at_admission(tiny_model_dir):
    """The decode role: a request whose whole answer is the handoff's first token finishes at
    admission; the blocks it imported are announced then, not at the engine's next step."""
    directory = str(tiny_model_dir("llama"))
    prefill_engine = Engine(directory, num_kv_blocks=32)
    decode_engine = Engine(directory, num_kv_blocks=32, kv_events_endpoint="tcp://127.0.0.1:*",
                           kv_events_replay_endpoint="tcp://127.0.0.1:*")
    sub = Subscriber(decode_engine)
    try:
        prompt = [5 + i % 70 for i in range(40)]
        rid = prefill_engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        while prefill_engine.has_unfinished_requests():
            outputs = [o for o in prefill_engine.step() if o.request_id == rid and o.finished]
        handoff = prefill_engine.kv_transfer.export(prompt, None, 0, outputs[0].token_ids[0])
        prepared = decode_engine.prepare(prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        _, first = decode_engine.admit_handoff(prepared, handoff)
        assert first is not None and first.finished and not decode_engine.has_unfinished_requests()
        sub.catch_up(decode_engine)  # no step in between
        assert _known(sub) == engine_view(decode_engine) and len(_known(sub)["CPU"]) == len(prompt) // 16
        decode_engine.check_integrity()
    finally:
        sub.close()
        prefill_engine.close()
        decode_engine.close()

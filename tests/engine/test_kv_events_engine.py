"""KV events over ZMQ from a running engine, decoded as vLLM's published format decodes them
(pyzmq + msgspec, the structs written here from vLLM's published field list, as a subscriber
writes them, not imported from radixserve): a subscriber rebuilds the engine's cached blocks,
pool and tier apart, exactly, through eviction, tier traffic and a flush; a restart begins
with AllBlocksCleared and announces the persisted tier it adopted; the replay socket fills
what a late subscriber missed; a bad endpoint refuses the engine. The default form is vLLM's
current one (each event a map tagged by "type", with cache groups); the older arrays stay an
option. Gemma 3's window group: its blocks come and go as windows slide."""

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


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[Any]
    parent_block_hash: Any
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[list[Any] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[Any]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


class OldEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class OldBlockStored(OldEvent, tag="BlockStored"):
    block_hashes: list[Any]
    parent_block_hash: Any
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class OldBlockRemoved(OldEvent, tag="BlockRemoved"):
    block_hashes: list[Any]
    medium: str | None


class OldAllBlocksCleared(OldEvent, tag="AllBlocksCleared"):
    pass


class OldKVEventBatch(EventBatch):
    events: list[OldBlockStored | OldBlockRemoved | OldAllBlocksCleared]


DECODER = msgspec.msgpack.Decoder(type=KVEventBatch)
OLD_DECODER = msgspec.msgpack.Decoder(type=OldKVEventBatch)


class Subscriber:
    """A SUB socket and a DEALER for replays; `blocks` is what it knows each medium holds."""

    def __init__(self, engine: Engine, decoder=DECODER, group: int = 0):
        publisher = engine.kv_events
        self.decoder, self.group = decoder, group  # the cache group it follows
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
                self._apply(self.decoder.decode(payload))
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
                self._apply(self.decoder.decode(payload))
                self.next_seq += 1

    def _apply(self, batch: KVEventBatch) -> None:
        for e in batch.events:
            if (getattr(e, "group_idx", None) or 0) != self.group:
                continue
            if isinstance(e, (AllBlocksCleared, OldAllBlocksCleared)):
                self.blocks.clear()
                self.cleared += 1
            elif isinstance(e, (BlockStored, OldBlockStored)):
                held = self.blocks.setdefault(e.medium, set())
                assert not held & set(e.block_hashes) and len(e.token_ids) == e.block_size * len(e.block_hashes)
                held.update(e.block_hashes)
            else:
                self.blocks[e.medium] -= set(e.block_hashes)


def engine_view(engine: Engine, tier_medium: str = "CPU") -> dict[str, set]:
    view: dict[str, set] = {"GPU": set(), tier_medium: set()}
    for node in engine.cache.nodes():
        names = [d.to_bytes(16, "big") for d in node.digests]
        if node.blocks:
            view["GPU"].update(names)
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
        assert sub.blocks["GPU"] == want and all(isinstance(h, int) for h in want)
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
        assert _known(sub) == engine_view(decode_engine) and len(_known(sub)["GPU"]) == len(prompt) // 16
        decode_engine.check_integrity()
    finally:
        sub.close()
        prefill_engine.close()
        decode_engine.close()


def _window_view(engine: Engine) -> set:
    """The window group as the engine holds it: cached pool blocks that keep a window page."""
    window = engine.pool.window
    return {d.to_bytes(16, "big") for node in engine.cache.nodes()
            for b, d in zip(node.blocks, node.digests) if window.has_page(b)}


def test_the_default_model_publishes_every_field_of_the_current_format(real_model_dir):
    """SmolLM2: each event a map with vLLM's named fields; one full-attention group; the
    tenant's salt in extra_keys of its namespace's first block only."""
    engine = Engine(str(real_model_dir), num_kv_blocks=64, kv_events_endpoint="tcp://127.0.0.1:*",
                    kv_events_replay_endpoint="tcp://127.0.0.1:*")
    raw = zmq.Context().socket(zmq.SUB)
    try:
        raw.setsockopt(zmq.SUBSCRIBE, b"")
        raw.connect(engine.kv_events.endpoint)
        time.sleep(0.2)
        prompt = [100 + i for i in range(40)]
        engine.generate([prompt], GREEDY)
        engine.add_request(prompt, GREEDY, cache_salt="tenant-a")
        while engine.has_unfinished_requests():
            engine.step()
        engine.kv_events.flush()
        stored = []
        while raw.poll(500):
            _, _, payload = raw.recv_multipart()
            for event in msgspec.msgpack.decode(payload)[1]:
                assert isinstance(event, dict) and event["type"] in ("BlockStored", "BlockRemoved")
                stored += [event] if event["type"] == "BlockStored" else []
        assert stored and all(set(e) == {"type", *BlockStored.__struct_fields__} for e in stored)
        for e in stored:
            decoded = msgspec.convert(e, BlockStored)
            assert (decoded.block_size, decoded.lora_id, decoded.lora_name, decoded.medium) == (16, None, None, "GPU")
            assert (decoded.group_idx, decoded.kv_cache_spec_kind, decoded.kv_cache_spec_sliding_window) == \
                (0, "full_attention", None)
            assert len(decoded.token_ids) == 16 * len(decoded.block_hashes)
        firsts = [e for e in stored if e["parent_block_hash"] is None]
        assert [e["extra_keys"] for e in firsts] == [None, [["tenant-a"], None]]  # 40 tokens: 2 blocks each
        assert all(e["extra_keys"] is None for e in stored if e["parent_block_hash"] is not None)
    finally:
        raw.close(linger=0)
        engine.close()


def test_the_older_array_form_stays_an_option(tiny_model_dir):
    engine = Engine(str(tiny_model_dir("llama")), num_kv_blocks=24, kv_offload_memory=1 << 20,
                    kv_events_endpoint="tcp://127.0.0.1:*", kv_events_replay_endpoint="tcp://127.0.0.1:*",
                    kv_events_format="array")
    sub = Subscriber(engine, OLD_DECODER)
    try:
        for round_ in range(3):
            engine.generate(_prompts(round_, 4), GREEDY)
            sub.catch_up(engine)
            assert _known(sub) == engine_view(engine), f"round {round_}"
        assert sub.cleared == 1 and engine.cache.num_tier_blocks
    finally:
        sub.close()
        engine.close()
    with pytest.raises(ValueError, match="kv_events_format"):
        Engine(str(tiny_model_dir("llama")), kv_events_endpoint="tcp://127.0.0.1:*", kv_events_format="json")


def test_gemma3_publishes_its_window_group_apart_and_window_blocks_leave_as_they_slide():
    """Gemma 3 270M (window layers of 512 tokens): group 0 is every cached block, group 1
    ("sliding_window", its window) only those that keep a window page; long prompts slide
    their windows past their first blocks, and those leave group 1 while staying in group 0."""
    engine = Engine("gemma3-270m", max_model_len=4096, num_kv_blocks=256, chunked_prefill_size=256,
                    kv_events_endpoint="tcp://127.0.0.1:*", kv_events_replay_endpoint="tcp://127.0.0.1:*")
    full, windows = Subscriber(engine), Subscriber(engine, group=1)
    raw = zmq.Context().socket(zmq.SUB)
    try:
        raw.setsockopt(zmq.SUBSCRIBE, b"")
        raw.connect(engine.kv_events.endpoint)
        time.sleep(0.2)
        for round_ in range(2):
            engine.generate([[1000 + (round_ * 37 + i * 11) % 5000 for i in range(800)]],  # 288 tokens past a window
                            SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
            full.catch_up(engine)
            windows.catch_up(engine)
            assert _known(full) == engine_view(engine), f"round {round_}"
            assert windows.blocks.get("GPU", set()) == _window_view(engine), f"round {round_}"
        assert 0 < len(windows.blocks["GPU"]) < len(full.blocks["GPU"]), "windows slid past the prompts' starts"
        kinds, removed_windows = set(), 0
        while raw.poll(300):
            for event in msgspec.msgpack.decode(raw.recv_multipart()[2])[1]:
                if event["type"] == "BlockStored":
                    kinds.add((event["group_idx"], event["kv_cache_spec_kind"], event["kv_cache_spec_sliding_window"]))
                elif event["type"] == "BlockRemoved" and event["group_idx"] == 1:
                    removed_windows += len(event["block_hashes"])
        assert kinds == {(0, "full_attention", None), (1, "sliding_window", 512)}
        assert removed_windows > 0, "window blocks were removed as the windows slid"
        engine.check_integrity()
    finally:
        raw.close(linger=0)
        full.close()
        windows.close()
        engine.close()

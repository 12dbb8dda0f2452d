"""A KV cache that survives restarts (--kv-persist-dir), on a tiny random model: a restarted
engine serves a prefix it saw before from disk with the same greedy tokens; a torn index,
a corrupted slot or another model's cache is logged and ignored; an unwritable directory
or a full disk degrades to one tier with a clear log line."""

from __future__ import annotations

import logging

from radixserve import Engine, SamplingParams
from radixserve.kv_tier.persist import INDEX_FILE
from radixserve.kv_tier.store import TIER_FILE
from tiny_models import build_tiny_model

GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
PROMPT = [(7 * i) % 90 + 3 for i in range(150)]  # 9 full blocks of 16


def engine(model_dir, persist_dir, **kw):
    return Engine(str(model_dir), num_kv_blocks=32, kv_persist_dir=str(persist_dir),
                  kv_offload_memory=8 << 20, **kw)


def first_run(model_dir, persist_dir):
    e = engine(model_dir, persist_dir)
    out = e.generate(PROMPT, GREEDY)[0]
    assert e.flush_tier()
    e.check_integrity()
    e.close()
    return out


def test_a_restarted_engine_serves_a_prefix_it_saw_before_from_disk(tiny_model_dir, tmp_path):
    model = tiny_model_dir("llama")
    cold = first_run(model, tmp_path)
    assert cold.cached_tokens == 0
    for name in (INDEX_FILE, TIER_FILE):  # every tenant's salts and tokens: the owner's alone
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o600
    again = engine(model, tmp_path)
    assert again.tiering.loaded_blocks >= 9
    again.check_integrity()
    warm = again.generate(PROMPT, GREEDY)[0]
    assert warm.cached_tokens == 144 and warm.restored_tokens == 144
    assert warm.token_ids == cold.token_ids
    again.check_integrity()
    again.close()
    # and the index written by the second run is good for a third
    third = engine(model, tmp_path)
    assert third.generate(PROMPT, GREEDY)[0].restored_tokens == 144
    third.close()


def test_a_torn_index_is_ignored(tiny_model_dir, tmp_path, caplog):
    model = tiny_model_dir("llama")
    cold = first_run(model, tmp_path)
    index = tmp_path / INDEX_FILE
    index.write_bytes(index.read_bytes()[:-40])
    with caplog.at_level(logging.WARNING, logger="radixserve.kv_persist"):
        e = engine(model, tmp_path)
    assert "torn or corrupt" in caplog.text
    out = e.generate(PROMPT, GREEDY)[0]
    assert out.cached_tokens == 0 and out.token_ids == cold.token_ids
    e.check_integrity()
    e.close()


def test_a_corrupted_block_is_ignored_and_never_used(tiny_model_dir, tmp_path, caplog):
    model = tiny_model_dir("llama")
    cold = first_run(model, tmp_path)
    data = tmp_path / TIER_FILE
    raw = bytearray(data.read_bytes())
    raw[100] ^= 0xFF  # in slot 0: the prompt's first block
    data.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING, logger="radixserve.kv_persist"):
        e = engine(model, tmp_path)
    assert "failed their checksum" in caplog.text
    out = e.generate(PROMPT, GREEDY)[0]
    # the blocks below the corrupted one are unreachable: nothing is restored
    assert out.cached_tokens == 0 and out.token_ids == cold.token_ids
    e.check_integrity()
    e.close()


def test_another_models_cache_is_ignored(tiny_model_dir, tmp_path, caplog):
    model = tiny_model_dir("llama")
    first_run(model, tmp_path)
    other = build_tiny_model("llama", tmp_path / "other-model", seed=1)
    with caplog.at_level(logging.WARNING, logger="radixserve.kv_persist"):
        e = engine(other, tmp_path)
    assert "another model or layout" in caplog.text and "fingerprint" in caplog.text
    assert e.tiering.loaded_blocks == 0
    assert e.generate(PROMPT, GREEDY)[0].cached_tokens == 0
    e.check_integrity()
    e.close()


def test_an_index_of_the_first_format_starts_cold(tiny_model_dir, tmp_path, caplog):
    """Format 1 named blocks by blake2b digests; an index a version-1 engine wrote (header
    version 1, its checksum line intact) is logged and ignored, never read as KV."""
    import hashlib
    import json

    model = tiny_model_dir("llama")
    cold = first_run(model, tmp_path)
    index = tmp_path / INDEX_FILE
    body = json.loads(index.read_bytes().partition(b"\n")[2])
    assert body["header"]["version"] == 2 and len(body["entries"]) >= 9
    body["header"]["version"] = 1
    for entry in body["entries"]:  # the old digests: 16 bytes of blake2b, as 32 hex digits
        entry[2] = hashlib.blake2b(entry[2].encode(), digest_size=16).hexdigest()
        entry[3] = hashlib.blake2b(entry[3].encode(), digest_size=16).hexdigest()
    raw = json.dumps(body, separators=(",", ":")).encode()
    index.write_bytes(hashlib.sha256(raw).hexdigest().encode() + b"\n" + raw)
    with caplog.at_level(logging.WARNING, logger="radixserve.kv_persist"):
        e = engine(model, tmp_path)
    assert "another model or layout (version differ)" in caplog.text
    assert e.tiering.loaded_blocks == 0
    out = e.generate(PROMPT, GREEDY)[0]
    assert out.cached_tokens == 0 and out.token_ids == cold.token_ids
    e.check_integrity()
    e.close()


def test_another_block_size_is_ignored(tiny_model_dir, tmp_path, caplog):
    model = tiny_model_dir("llama")
    first_run(model, tmp_path)
    with caplog.at_level(logging.WARNING, logger="radixserve.kv_persist"):
        e = engine(model, tmp_path, block_size=8)
    assert "another model or layout" in caplog.text
    assert e.generate(PROMPT, GREEDY)[0].cached_tokens == 0
    e.close()


def test_an_unwritable_directory_degrades_to_one_tier(tiny_model_dir, tmp_path, caplog):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with caplog.at_level(logging.WARNING, logger="radixserve.tiering"):
        e = engine(tiny_model_dir("llama"), blocker / "cache")
    assert "KV tier disabled, running with one tier" in caplog.text and "cannot create" in caplog.text
    assert e.tiering.store is None and e.cache.tier is None
    out = e.generate(PROMPT, GREEDY)[0]
    assert e.generate(PROMPT, GREEDY)[0].token_ids == out.token_ids
    e.check_integrity()


def test_a_full_disk_degrades_to_one_tier(tiny_model_dir, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="radixserve.tiering"):
        e = Engine(str(tiny_model_dir("llama")), num_kv_blocks=32, kv_persist_dir=str(tmp_path),
                   kv_offload_memory=1 << 55)  # far more than any disk holds
    assert "KV tier disabled, running with one tier" in caplog.text
    assert e.tiering.store is None
    e.generate(PROMPT, GREEDY)
    e.check_integrity()


def test_an_index_that_cannot_be_written_is_logged_once_and_serving_goes_on(tiny_model_dir, tmp_path, caplog):
    e = engine(tiny_model_dir("llama"), tmp_path)
    e.tiering.persister.index_path = str(tmp_path / "missing-dir" / INDEX_FILE)
    with caplog.at_level(logging.ERROR, logger="radixserve.kv_persist"):
        e.generate(PROMPT, GREEDY)
        e.flush_tier(timeout_s=10)
    assert "cannot write" in caplog.text
    assert e.stats()["tier_persist_failed"] == 1
    e.generate(PROMPT, GREEDY)
    e.check_integrity()
    e.close()

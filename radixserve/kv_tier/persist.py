"""TierPersister: keeps the second tier's index on disk so a restarted engine finds its cache.

Files in the persist directory: kv_tier.bin (the tier's slots, a shared file mapping) and
kv_index.json (which block each slot holds). The index's first line is the SHA-256 of the
rest; the rest is JSON: a header (format version, fingerprint of model weights, dtype and
KV layout, block size, slot size) and one entry per slot: [slot, salt, parent hash,
hash (core/hashing.py), token ids, CRC-32 of the slot's bytes]. An index of another format
version is ignored with a log line: the engine starts with a cold tier.

Writes never stall a step: the engine thread only enqueues what changed in a step (and the
slot sequence numbers after its copies); a background thread checksums the slots, writes
the slots set since its last index back to disk (msync of their range, through ctypes so
that the GIL is free while it waits) and replaces the index (write to a temporary file,
fsync, rename), each entry's JSON encoded once when it is set. On load,
anything that does not check out (index checksum, header, a slot's CRC, a digest chain) is
logged and ignored, so a torn write or another model's cache is never used as KV.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import threading
import time
import zlib
from typing import Any

from radixserve.kv_tier.index import TierEntry
from radixserve.kv_tier.store import TierStore

log = logging.getLogger("radixserve.kv_persist")

INDEX_FILE = "kv_index.json"
FORMAT_VERSION = 2  # 2: block hashes from core/hashing.py (xxh3-128); a version-1 index starts cold
_WRITE_INTERVAL_S = 0.5


class TierPersister:
    def __init__(self, directory: str, store: TierStore, header: dict[str, Any]):
        self.directory = directory
        self.store = store
        self.header = {"version": FORMAT_VERSION, **header, "slot_bytes": store.slot_bytes}
        self.index_path = os.path.join(directory, INDEX_FILE)
        self.failed: str | None = None
        self.index_writes = 0
        self._entries: dict[int, tuple[TierEntry, int, bytes]] = {}  # slot -> (entry, crc, its JSON)
        self._unsynced: set[int] = set()  # slots set since the last index write
        self._queue: queue.Queue[Any] = queue.Queue()
        self._idle = threading.Event()
        self._idle.set()
        self._thread = threading.Thread(target=self._run, name="radixserve-kv-persist", daemon=True)
        self._thread.start()

    # ---- engine thread ----------------------------------------------------------------

    def load(self) -> list[TierEntry]:
        """The entries of a previous run whose bytes check out; [] (logged) if the index is
        missing, torn or made for another model or layout."""
        try:
            with open(self.index_path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            return []
        except OSError as exc:
            log.warning("KV persist: cannot read %s (%s); starting with an empty tier", self.index_path, exc)
            return []
        body = _checked_body(raw)
        if body is None:
            log.warning("KV persist: %s is torn or corrupt (checksum mismatch); ignored", self.index_path)
            return []
        header = body.get("header", {})
        if header != self.header:
            diff = sorted(k for k in set(header) | set(self.header) if header.get(k) != self.header.get(k))
            log.warning("KV persist: %s was written for another model or layout (%s differ); ignored",
                        self.index_path, ", ".join(diff))
            return []
        entries, bad = [], 0
        for slot, salt, parent, digest, tokens, crc in body.get("entries", []):
            if not (0 <= slot < self.store.num_slots) or zlib.crc32(self.store.slot_view(slot)) != crc:
                bad += 1
                continue
            entry = TierEntry(slot, salt, int(parent, 16), int(digest, 16), tuple(tokens))
            entries.append(entry)
            self._entries[slot] = (entry, crc, _encode(entry, crc))
        if bad:
            log.warning("KV persist: %d block(s) in %s failed their checksum; ignored", bad, self.index_path)
        return entries

    def adopt(self, kept: list[TierEntry]) -> None:
        """Only these loaded entries are in the tree: forget the rest."""
        keep = {e.slot for e in kept}
        self._entries = {s: v for s, v in self._entries.items() if s in keep}

    def submit(self, events: list[tuple[str, Any]]) -> None:
        """What a step changed, after its copies ran: ("set", TierEntry) / ("free", slot)."""
        if not events or self.failed:
            return
        seqs = {e.slot: self.store.seq[e.slot] for kind, e in events if kind == "set"}
        self._idle.clear()
        self._queue.put((events, seqs))

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until everything submitted is on disk (index included); False on timeout."""
        self._idle.clear()
        self._queue.put("flush")
        return self._idle.wait(timeout_s)

    def close(self, timeout_s: float = 30.0) -> None:
        self.flush(timeout_s)
        self._queue.put(None)
        self._thread.join(timeout_s)

    # ---- writer thread ----------------------------------------------------------------

    def _run(self) -> None:
        dirty = False
        last_write = 0.0
        while True:
            try:
                item = self._queue.get(timeout=_WRITE_INTERVAL_S)
            except queue.Empty:
                item = "tick"
            if item is None:
                return
            if isinstance(item, tuple):
                self._apply(*item)
                dirty = True
            due = item == "flush" or time.monotonic() - last_write >= _WRITE_INTERVAL_S
            if dirty and due and self._queue.empty() and not self.failed:
                self._write_index()
                dirty = False
                last_write = time.monotonic()
            if self._queue.empty() and (not dirty or self.failed):
                self._idle.set()

    def _apply(self, events: list[tuple[str, Any]], seqs: dict[int, int]) -> None:
        final: dict[int, TierEntry | None] = {}
        for kind, value in events:
            if kind == "set":
                final[value.slot] = value
            else:
                final[value] = None
        for slot, entry in final.items():
            self._entries.pop(slot, None)
            if entry is None:
                continue
            seq = seqs[slot]
            crc = zlib.crc32(self.store.slot_view(slot))
            if self.store.seq[slot] == seq and seq % 2 == 0:  # not rewritten while summed
                self._entries[slot] = (entry, crc, _encode(entry, crc))
                self._unsynced.add(slot)

    def _write_index(self) -> None:
        try:
            self.store.sync(self._unsynced)
            self._unsynced = set()
            body = b"".join([
                b'{"header":', json.dumps(self.header, separators=(",", ":")).encode(), b',"entries":[',
                b",".join(encoded for _, _, encoded in self._entries.values()), b"]}",
            ])
            tmp = self.index_path + ".tmp"
            with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:  # its salts and tokens
                f.write(hashlib.sha256(body).hexdigest().encode() + b"\n" + body)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.index_path)
            self.index_writes += 1
        except OSError as exc:
            self.failed = f"{type(exc).__name__}: {exc}"
            log.error("KV persist: cannot write %s (%s); the cache will not survive a restart",
                      self.index_path, self.failed)


def _encode(e: TierEntry, crc: int) -> bytes:
    """One index entry: [slot, salt, parent hash, hash (32 hex digits), token ids, CRC-32]."""
    return json.dumps([e.slot, e.salt, f"{e.parent:032x}", f"{e.digest:032x}", list(e.tokens), crc],
                      separators=(",", ":")).encode()


def _checked_body(raw: bytes) -> dict[str, Any] | None:
    head, sep, body = raw.partition(b"\n")
    if not sep or hashlib.sha256(body).hexdigest().encode() != head:
        return None
    try:
        value = json.loads(body)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None

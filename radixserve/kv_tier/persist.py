"""TierPersister: keeps the second tier's index on disk so a restarted engine finds its cache.

Files in the persist directory: kv_tier.bin (the tier's slots, a shared file mapping) and
kv_index.json (which block each slot holds). The index's first line is the SHA-256 of the
rest; the rest is JSON: a header (format version, fingerprint of model weights, dtype and
KV layout, block size, slot size) and one entry per slot: [slot, salt, parent hash,
hash (core/hashing.py), token ids, CRC-32 of the slot's bytes]. An index of another format
version is ignored with a log line: the engine starts with a cold tier.

Hybrid KV (a tier with window slots): the header says so (`hybrid_kv`: the window layers,
the window slots' count, size and offset in the file), and each entry goes on with
[window slot (-1: none), CRC-32 of its bytes]. A slot then holds a block's full layers
only, so an index whose header differs in `hybrid_kv` (written with hybrid KV and read
without, or the other way round) is ignored like another layout's; a window slot that fails
its checksum leaves its block a tombstone for the window layers (its full layers are kept).

Recurrent layers (a tier with state slots): the header says so (`recurrent_states`), and
a "states" list beside the entries holds [state slot, salt, hash of the block its node ends
with, the token position, CRC-32] per snapshot kept in the tier; on load each goes back to
the node rebuilt for that block (core/recurrent_snapshots.py's load_tier).

Writes never stall a step: the engine thread only enqueues what changed in a step (and the
slot sequence numbers after its copies); a background thread checksums the slots, writes
the slots set since its last index back to disk (msync of their range, through ctypes so
that the GIL is free while it waits) and replaces the index (write to a temporary file,
fsync, rename), each entry's JSON encoded once when it is set. On load,
anything that does not check out (index checksum, header, a slot's CRC, a digest chain) is
logged and ignored, so a torn write or another model's cache is never used as KV.
"""

from __future__ import annotations

import dataclasses
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
        self.hybrid = store.num_window_slots > 0
        if self.hybrid:
            self.header["hybrid_kv"] = {**header.get("hybrid_kv", {}), "window_slots": store.num_window_slots,
                                        "window_slot_bytes": store.window_slot_bytes,
                                        "window_offset": store.window_offset}
        self.states = store.num_state_slots > 0
        self.index_path = os.path.join(directory, INDEX_FILE)
        self.failed: str | None = None
        self.index_writes = 0
        # slot -> (entry, crc, window crc, its JSON)
        self._entries: dict[int, tuple[TierEntry, int, int, bytes]] = {}
        self._unsynced: set[int] = set()  # slots set since the last index write
        self._unsynced_windows: set[int] = set()  # window slots likewise
        # recurrent layers: state slot -> ((slot, salt, digest, position), crc, its JSON)
        self._states: dict[int, tuple[tuple, int, bytes]] = {}
        self._unsynced_states: set[int] = set()
        self.loaded_states: list[tuple] = []  # (slot, salt, digest, position) of a loaded index, checked
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
        entries, bad, bad_windows = [], 0, 0
        for item in body.get("entries", []):
            slot, salt, parent, digest, tokens, crc = item[:6]
            window, window_crc = item[6:8] if self.hybrid and len(item) == 8 else (-1, 0)
            if not (0 <= slot < self.store.num_slots) or zlib.crc32(self.store.slot_view(slot)) != crc:
                bad += 1
                continue
            if window >= 0 and not (window < self.store.num_window_slots
                                    and zlib.crc32(self.store.window_view(window)) == window_crc):
                bad_windows += 1  # its full layers stand; the window layers' KV does not
                window, window_crc = -1, 0
            entry = TierEntry(slot, salt, int(parent, 16), int(digest, 16), tuple(tokens), window)
            entries.append(entry)
            self._entries[slot] = (entry, crc, window_crc, self._encode(entry, crc, window_crc))
        if bad:
            log.warning("KV persist: %d block(s) in %s failed their checksum; ignored", bad, self.index_path)
        if bad_windows:
            log.warning("KV persist: %d window page(s) in %s failed their checksum; their blocks are tombstones "
                        "for the window layers", bad_windows, self.index_path)
        self._load_states(body.get("states", []))
        return entries

    def _load_states(self, items: list) -> None:
        """Recurrent-state entries whose bytes check out, into loaded_states (adopt_states keeps
        those the tree took)."""
        bad = 0
        for slot, salt, digest, position, crc in items if self.states else []:
            if not (0 <= slot < self.store.num_state_slots) or zlib.crc32(self.store.state_view(slot)) != crc:
                bad += 1
                continue
            state = (slot, salt, int(digest, 16), position)
            self.loaded_states.append(state)
            self._states[slot] = (state, crc, self._encode_state(state, crc))
        if bad:
            log.warning("KV persist: %d recurrent state(s) in %s failed their checksum; ignored", bad, self.index_path)

    def adopt_states(self, kept: list[tuple]) -> None:
        """Only these loaded states are in the tree: forget the rest."""
        slots = {state[0] for state in kept}
        self._states = {slot: v for slot, v in self._states.items() if slot in slots}

    def adopt(self, kept: list[TierEntry]) -> None:
        """Only these loaded entries are in the tree, as the tree took them (a window slot
        it refused is gone from its entry): forget the rest."""
        entries = {}
        for e in kept:
            loaded, crc, window_crc, encoded = self._entries[e.slot]
            if e.window_slot != loaded.window_slot:
                window_crc, encoded = 0, self._encode(e, crc, 0)
            entries[e.slot] = (e, crc, window_crc, encoded)
        self._entries = entries

    def submit(self, events: list[tuple[str, Any]]) -> None:
        """What a step changed, after its copies ran: ("set", TierEntry) / ("free", slot)."""
        if not events or self.failed:
            return
        seqs = {e.slot: self.store.seq[e.slot] for kind, e in events if kind == "set"}
        seqs.update({("state", e[0]): self.store.state_seq[e[0]] for kind, e in events if kind == "state"})
        window_seqs = {e.window_slot: self.store.window_seq[e.window_slot]
                       for kind, e in events if kind == "set" and e.window_slot >= 0}
        self._idle.clear()
        self._queue.put((events, seqs, window_seqs))

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

    def _apply(self, events: list[tuple[str, Any]], seqs: dict[Any, int], window_seqs: dict[int, int]) -> None:
        final: dict[int, TierEntry | None] = {}
        states: dict[int, tuple | None] = {}
        for kind, value in events:
            if kind == "set":
                final[value.slot] = value
            elif kind == "free":
                final[value] = None
            elif kind == "state":
                states[value[0]] = value
            else:  # "state_free"
                states[value] = None
        for slot, state in states.items():
            self._states.pop(slot, None)
            if state is None:
                continue
            seq = seqs[("state", slot)]
            crc = zlib.crc32(self.store.state_view(slot))
            if self.store.state_seq[slot] != seq or seq % 2:
                continue
            self._states[slot] = (state, crc, self._encode_state(state, crc))
            self._unsynced_states.add(slot)
        for slot, entry in final.items():
            self._entries.pop(slot, None)
            if entry is None:
                continue
            seq = seqs[slot]
            crc = zlib.crc32(self.store.slot_view(slot))
            if self.store.seq[slot] != seq or seq % 2:  # rewritten while summed: a later event says what it holds
                continue
            window_crc = 0
            if entry.window_slot >= 0:
                wseq = window_seqs[entry.window_slot]
                window_crc = zlib.crc32(self.store.window_view(entry.window_slot))
                if self.store.window_seq[entry.window_slot] != wseq or wseq % 2:
                    entry, window_crc = dataclasses.replace(entry, window_slot=-1), 0  # kept as a tombstone
                else:
                    self._unsynced_windows.add(entry.window_slot)
            self._entries[slot] = (entry, crc, window_crc, self._encode(entry, crc, window_crc))
            self._unsynced.add(slot)

    def _write_index(self) -> None:
        try:
            self.store.sync(self._unsynced, self._unsynced_windows, self._unsynced_states)
            self._unsynced, self._unsynced_windows, self._unsynced_states = set(), set(), set()
            body = b"".join([
                b'{"header":', json.dumps(self.header, separators=(",", ":")).encode(), b',"entries":[',
                b",".join(encoded for *_, encoded in self._entries.values()), b"]",
                b',"states":[' + b",".join(encoded for *_, encoded in self._states.values()) + b"]"
                if self.states else b"", b"}",
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

    def _encode(self, e: TierEntry, crc: int, window_crc: int) -> bytes:
        """One index entry: [slot, salt, parent hash, hash (32 hex digits), token ids, CRC-32],
        and with hybrid KV [window slot, its CRC-32] after them."""
        item = [e.slot, e.salt, f"{e.parent:032x}", f"{e.digest:032x}", list(e.tokens), crc]
        if self.hybrid:
            item += [e.window_slot, window_crc]
        return json.dumps(item, separators=(",", ":")).encode()


    @staticmethod
    def _encode_state(state: tuple, crc: int) -> bytes:
        """One recurrent-state entry: [state slot, salt, hash of its node's last block, the
        token position it stands at, CRC-32]."""
        slot, salt, digest, position = state
        return json.dumps([slot, salt, f"{digest:032x}", position, crc], separators=(",", ":")).encode()


def _checked_body(raw: bytes) -> dict[str, Any] | None:
    head, sep, body = raw.partition(b"\n")
    if not sep or hashlib.sha256(body).hexdigest().encode() != head:
        return None
    try:
        value = json.loads(body)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None

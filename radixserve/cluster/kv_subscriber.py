"""KVEventSubscriber: one replica's KV event stream (vLLM's published format, as the replica's
KVEventPublisher sends it) read into a KVBlockIndex: a ZMQ SUB socket for the live stream,
a DEALER on the replica's replay socket for what the stream skipped.

`poll()` applies whatever has arrived (call it from one thread: a loop of its own, or a test);
a gap is filled from the replay socket before the batch after it is applied, and a restarted
replica's stream is rebuilt from its replay buffer (its first batch clears everything). A
restart is told by a batch older in sequence but newer in time than the last applied, or,
when the SUB socket reconnects (the publisher went away and came back), by the replay of the
last applied batch no longer being that batch. A
batch neither the stream nor the replay can give (the buffer moved past it) leaves the
replica untracked: routing falls back to the shadow tree for it (affinity.py).
"""

from __future__ import annotations

import threading
from typing import Any

import zmq
from zmq.utils.monitor import recv_monitor_message

from radixserve.cluster.kv_index import KVBlockIndex
from radixserve.engine.kv_events import END_OF_REPLAY, WireFormat

class KVEventSubscriber:
    def __init__(self, index: KVBlockIndex, replica: str, endpoint: str, replay_endpoint: str | None = None,
                 replay_timeout_s: float = 5.0, wire_format: str = "map"):
        self.index, self.replica = index, replica
        self._decoder = WireFormat(wire_format).decoder  # the publisher's own structs
        self.replay_timeout_ms = int(replay_timeout_s * 1000)
        self._context = zmq.Context()
        self._sub = self._context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.setsockopt(zmq.LINGER, 0)
        self._monitor = self._sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self._sub.connect(endpoint)
        self._dropped = False  # the connection went away since the last check
        self._poller = zmq.Poller()
        self._poller.register(self._sub, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self._replay = None
        if replay_endpoint:
            self._replay = self._context.socket(zmq.DEALER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.connect(replay_endpoint)
        self.batches = 0
        self.replays = 0
        self.drop_next = 0  # tests: ignore this many live batches (a lossy network)
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def poll(self, timeout_ms: int = 0) -> int:
        """Apply the batches that arrived (waiting up to timeout_ms for the first); returns how many."""
        applied = 0
        while True:
            ready = dict(self._poller.poll(timeout_ms))
            timeout_ms = 0
            if not ready:
                return applied
            if self._monitor in ready:
                applied += self._check_connection()
            if self._sub in ready:
                _, seq, payload = self._sub.recv_multipart()
                if self.drop_next:
                    self.drop_next -= 1
                    continue
                applied += self._take(int.from_bytes(seq, "big"), self._decoder.decode(payload))

    def catch_up(self) -> int:
        """Replay whatever the replica published after the last batch applied (e.g. a late
        join, or a tail the live stream dropped); returns how many batches it applied."""
        return self._replay_from(self.index.position(self.replica) or 0)

    def start(self, interval_ms: int = 50) -> None:
        """Poll on a thread of its own until close()."""
        self._thread = threading.Thread(target=self._run, args=(interval_ms,), name="radixserve-kv-subscriber",
                                        daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._context.destroy(linger=0)

    # ---- helpers ------------------------------------------------------------------------

    def _run(self, interval_ms: int) -> None:
        while not self._stop.is_set():
            try:
                self.poll(interval_ms)
            except zmq.ZMQError:
                return

    def _take(self, seq: int, batch: Any) -> int:
        verdict = self.index.accepts(self.replica, seq, batch.ts)
        if verdict == "skip":
            return 0
        if verdict == "restart":
            self.index.reset(self.replica)
            return self._replay_from(0)
        if verdict == "gap":
            applied = self._replay_from(self.index.position(self.replica) or 0)
            position = self.index.position(self.replica)
            if position is None or position < seq:  # the buffer moved past the gap: untracked
                self.index.reset(self.replica)
                return applied
            return applied + self._take(seq, batch)
        self.index.apply(self.replica, seq, batch.events, batch.ts)
        self.batches += 1
        return 1

    def _check_connection(self) -> int:
        """After a reconnect, make sure the stream is the one applied so far (else rebuild)."""
        reconnected = False
        while self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)["event"]
            if event == zmq.EVENT_DISCONNECTED:
                self._dropped = True
            elif event == zmq.EVENT_CONNECTED and self._dropped:
                self._dropped, reconnected = False, True
        return self._verify_stream() if reconnected else 0

    def _verify_stream(self) -> int:
        expected = self.index.position(self.replica)
        if not expected or self._replay is None:
            return 0
        batches = self._fetch_replay(expected - 1)
        last_ts = self.index.replicas[self.replica].last_ts
        if batches and batches[0][0] == expected - 1 and batches[0][1].ts == last_ts:
            return self._apply_following(batches[1:])
        self.index.reset(self.replica)
        return self._replay_from(0)

    def _replay_from(self, start: int) -> int:
        """Apply the replay buffer's batches from `start` on, in order, while they follow on."""
        return self._apply_following(self._fetch_replay(start))

    def _apply_following(self, batches: list[tuple[int, Any]]) -> int:
        applied = 0
        for seq, batch in batches:
            if self.index.accepts(self.replica, seq, batch.ts) == "apply":
                self.index.apply(self.replica, seq, batch.events, batch.ts)
                self.batches += 1
                applied += 1
        return applied

    def _fetch_replay(self, start: int) -> list[tuple[int, Any]]:
        if self._replay is None:
            return []
        self.replays += 1
        self._replay.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while self._replay.poll(self.replay_timeout_ms):
            _, seq, payload = self._replay.recv_multipart()
            if seq == END_OF_REPLAY:
                break
            out.append((int.from_bytes(seq, "big"), self._decoder.decode(payload)))
        return out

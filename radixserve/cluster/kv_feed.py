"""KVEventFeed: the ingress's subscriptions to every replica's KV event stream, feeding one
KVBlockIndex that the affinity router routes on (registry.py hands it over; affinity.py).

Each replica publishes on endpoints it binds on its own node (`replica_engine_kwargs`: the
cluster gives every replica "tcp://<node ip>:*" for the stream and for replays, whatever
--kv-events-endpoint said) and reports them (RadixReplica.kv_events). The ingress passes the
live set to `sync`: new replicas are subscribed (a late join replays the buffer), gone ones
closed and forgotten. One thread polls every subscription.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from radixserve.cluster.kv_index import KVBlockIndex
from radixserve.cluster.kv_subscriber import KVEventSubscriber

log = logging.getLogger(__name__)


def replica_engine_kwargs(engine_kwargs: dict[str, Any], host: str) -> dict[str, Any]:
    """A replica's engine options: with KV events on, its own endpoints on `host` (ports chosen at bind)."""
    if not engine_kwargs.get("kv_events_endpoint"):
        return engine_kwargs
    return {**engine_kwargs, "kv_events_endpoint": f"tcp://{host}:*", "kv_events_replay_endpoint": f"tcp://{host}:*"}


class KVEventFeed:
    def __init__(self, index: KVBlockIndex, poll_ms: int = 20, wire_format: str = "map"):
        self.index, self.wire_format = index, wire_format
        self.poll_ms = poll_ms
        self._subs: dict[str, tuple[tuple[str, str | None], KVEventSubscriber]] = {}
        self._lock = threading.Lock()
        self._closing: list[KVEventSubscriber] = []  # closed by the polling thread (sockets stay on one thread)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="radixserve-kv-feed", daemon=True)
        self._thread.start()

    @property
    def replicas(self) -> list[str]:
        with self._lock:
            return list(self._subs)

    def sync(self, endpoints: dict[str, tuple[str, str | None]]) -> None:
        """The live replicas and their (stream, replay) endpoints."""
        with self._lock:
            for replica in [r for r, (ends, _) in self._subs.items() if endpoints.get(r) != ends]:
                self._closing.append(self._subs.pop(replica)[1])
                self.index.forget(replica)
            for replica, ends in endpoints.items():
                if replica not in self._subs:
                    self._subs[replica] = (ends, KVEventSubscriber(self.index, replica, ends[0], ends[1],
                                                                            wire_format=self.wire_format))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        with self._lock:
            for sub in [sub for _, sub in self._subs.values()] + self._closing:
                sub.close()
            self._subs.clear()
            self._closing.clear()

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                subs = [sub for _, sub in self._subs.values()]
                closing, self._closing = self._closing, []
            for sub in closing:
                sub.close()
            if not subs:
                self._stop.wait(self.poll_ms / 1000)
            for sub in subs:
                try:
                    if not self.index.tracks(sub.replica):
                        sub.catch_up()
                    sub.poll(self.poll_ms // max(1, len(subs)))
                except Exception:  # a replica gone mid-read: the next sync closes it
                    log.debug("kv event subscription of %s failed", sub.replica, exc_info=True)

"""PrefillPicker: the ingress's choice of a prefill replica for each request (disaggregated).

Prefix affinity over the ingress's own approximate trees for the prefill role (AffinityPolicy,
keyed by the request's RoutingKey, like the decode replicas' choice, but without sessions: a
prompt goes where its prefix was computed), balanced by the prompts the ingress has sent to
each and not yet seen answered. The live prefill replicas come from the prefill deployment's
router in the ingress process (routers.py feeds them in); until they have, no choice is made
and the decode replica's handle router picks. The choice travels in the ForwardedRequest to the
decode replica, whose PrefillJob names it (pd_jobs.py). Plain Python, no Ray; thread-safe (Ray
runs routers on a loop of their own).

With KV events on, the picker matches the request's block names (RoutingKey.blocks) against
what each prefill replica's event stream says it holds (the ingress's KVBlockIndex, reason
"kv_prefix"), as the decode choice does; the trees stay the fallback (a replica whose stream
is not tracked yet, a request not named).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable

from radixserve.cluster.affinity import AffinityConfig, AffinityPolicy
from radixserve.cluster.kv_index import KVBlockIndex
from radixserve.cluster.routing_key import RoutingKey


class PrefillPicker:
    def __init__(self, config: AffinityConfig | None = None, kv_index: KVBlockIndex | None = None):
        self.policy = AffinityPolicy(config, kv_index=kv_index)
        self.reasons: dict[str, int] = {}  # choices by reason (metrics)
        self._lock = threading.Lock()

    def set_replicas(self, replicas: Iterable[str]) -> None:
        with self._lock:
            self.policy.set_replicas(replicas)

    def remove_replica(self, replica: str) -> None:
        with self._lock:
            self.policy.remove_replica(replica)

    def pick(self, routing: RoutingKey | None) -> str | None:
        """The prefill replica for a request with this key (counted in flight until `done`), or
        None: no key, or no live prefill replica known yet."""
        if routing is None:
            return None
        with self._lock:
            live = list(self.policy.trees)
            if not live:
                return None
            now = time.monotonic()
            choice = self.policy.choose(live, routing.key, None, now, routing.blocks)
            chosen = choice.ranking[0]
            self.policy.routed(chosen, routing.key, None, chosen, now)
            self.reasons[choice.reason] = self.reasons.get(choice.reason, 0) + 1
            return chosen

    def done(self, replica: str) -> None:
        """The request `pick` chose `replica` for is answered (or failed)."""
        with self._lock:
            self.policy.finished(replica)

    def forget_prefixes(self) -> None:
        with self._lock:
            for tree in self.policy.trees.values():
                tree.clear()

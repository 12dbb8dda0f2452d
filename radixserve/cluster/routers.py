"""Request routers on Ray Serve's RequestRouter API, for the replica deployment.

PrefixAffinityRouter runs AffinityPolicy: Ray calls choose_replicas with the live replicas
and the pending request (whose first argument is a ForwardedRequest), and tells the router
where each request went, when it completed and when a replica died. RoundRobinRouter is
the plain baseline. Ray's own PowerOfTwoChoicesRequestRouter is the third option.

Routers live in the process that holds the deployment handle (the ingress); registry.py
finds the one of an application there (the ingress binds /v1/responses ids through it).
Ray pickles this module by value: it holds no state of its own.
"""

from __future__ import annotations

import time
from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from radixserve.cluster import registry
from radixserve.cluster.affinity import AffinityConfig, AffinityPolicy
from radixserve.cluster.forwarding import ForwardedRequest
from radixserve.cluster.options import PREFILL_DEPLOYMENT

ROUTER_CLASSES = {  # by options.ROUTERS name
    "affinity": "radixserve.cluster.routers.PrefixAffinityRouter",
    "round_robin": "radixserve.cluster.routers.RoundRobinRouter",
    "pow2": "ray.serve._private.request_router.pow_2_router.PowerOfTwoChoicesRequestRouter",
    # Ray Serve LLM's router, by its module path: `ray.serve.llm` itself needs pyarrow (ray[llm]).
    "ray_prefix": "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router.PrefixCacheAffinityRouter",
}


class PrefixAffinityRouter(FIFOMixin, RequestRouter):
    """Session, then longest approximate cached prefix, then load (AffinityPolicy)."""

    def initialize_state(self, **kwargs: Any) -> None:
        kv_index = registry.kv_index_for(self.app_name) if self._deployment_id.name != PREFILL_DEPLOYMENT else None
        self.policy = AffinityPolicy(AffinityConfig(**kwargs), kv_index=kv_index)
        self._chosen: dict[str, str] = {}  # internal request id -> replica choose_replicas picked
        self.reasons: dict[str, int] = {}  # routing decisions by reason (metrics)
        if self._deployment_id.name != PREFILL_DEPLOYMENT:  # the ingress's router is the front one's
            registry.register(self.app_name, self)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self.policy.set_replicas(r.replica_id.unique_id for r in replicas)
        picker = self._picker()
        if picker is not None:
            picker.set_replicas(r.replica_id.unique_id for r in replicas)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.policy.remove_replica(replica_id.unique_id)
        picker = self._picker()
        if picker is not None:
            picker.remove_replica(replica_id.unique_id)

    def _picker(self) -> Any:
        """The ingress's PrefillPicker when this is the prefill deployment's router in the
        ingress process: it learns the live prefill replicas from here."""
        if self._deployment_id.name != PREFILL_DEPLOYMENT:
            return None
        return registry.picker_for(self.app_name)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        by_id = {r.replica_id.unique_id: r for r in candidate_replicas}
        self.policy.set_replicas(r.replica_id.unique_id for r in self._replicas.values())
        request = _forwarded(pending_request)
        target = getattr(request, "target_replica", None)
        if target in by_id:  # an ack, or a job the ingress placed (pd_jobs): there, else as below
            return [[by_id[target]]] + [[r] for i, r in by_id.items() if i != target]
        live = [r for r in by_id if r in self.policy.trees]
        if request is None or request.routing is None or not live:  # (never raise here: Ray's routing loop would die)
            ranking = sorted(by_id, key=lambda r: (self.policy.in_flight.get(r, 0), r))
            return [[by_id[r]] for r in ranking]
        routing = request.routing
        choice = self.policy.choose(live, routing.key, routing.session_id, time.monotonic(), routing.blocks)
        self.reasons[choice.reason] = self.reasons.get(choice.reason, 0) + 1
        assert pending_request is not None
        self._chosen[pending_request.metadata.internal_request_id] = choice.ranking[0]
        return [[by_id[r]] for r in choice.ranking]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        request = _forwarded(pending_request)
        chosen = self._chosen.pop(pending_request.metadata.internal_request_id, None)
        routing = request.routing if request is not None else None
        if routing is None:
            self.policy.routed(replica_id.unique_id, (), None, replica_id.unique_id, time.monotonic())
        else:
            self.policy.routed(replica_id.unique_id, routing.key, routing.session_id, chosen, time.monotonic())

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        self._chosen.pop(internal_request_id, None)
        self.policy.finished(replica_id.unique_id)

    def forget_prefixes(self) -> None:
        """After /flush_cache: the replicas' caches are empty, so are the trees."""
        for tree in self.policy.trees.values():
            tree.clear()

    def bind_session(self, session_id: str, replica: str) -> None:
        """Keep `session_id` on `replica` (e.g. a response id on the replica that stored it)."""
        self.policy.record(replica, (), session_id, time.monotonic())


class RoundRobinRouter(FIFOMixin, RequestRouter):
    """Each request to the next replica in turn (a baseline: blind to prefixes and load)."""

    def initialize_state(self, **kwargs: Any) -> None:
        self._next = 0

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        ordered = sorted(candidate_replicas, key=lambda r: r.replica_id.unique_id)
        if not ordered:
            return []
        first = self._next % len(ordered)
        self._next += 1
        return [[r] for r in ordered[first:] + ordered[:first]]


def _forwarded(pending_request: PendingRequest | None) -> ForwardedRequest | Any | None:
    """The request's first argument when it carries a `routing` key (a ForwardedRequest, or a
    prefill replica's PrefillJob / ReleaseJob)."""
    if pending_request is None or not pending_request.args:
        return None
    arg = pending_request.args[0]
    return arg if isinstance(arg, ForwardedRequest) or hasattr(arg, "routing") else None

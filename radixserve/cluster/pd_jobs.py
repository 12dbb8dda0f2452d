"""What the decode role sends the prefill role: a prompt to compute (PrefillJob) and an ack
(ReleaseJob). Plain dataclasses that Ray carries; routers read `target_replica` (there when it
is live) and `routing` (prefix affinity otherwise).

PREFILL_TARGET is the prefill replica the ingress chose for the request a decode replica is
serving (forwarding.py sets it around the request's app call; pd_client.py reads it)."""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass

from radixserve.cluster.routing_key import RoutingKey
from radixserve.sampling_params import SamplingParams

PREFILL_TARGET: ContextVar[str | None] = ContextVar("radixserve_prefill_target", default=None)


@dataclass(frozen=True)
class PrefillJob:
    token_ids: list[int]  # the prompt, tokenized and templated by the decode replica
    params: SamplingParams  # the request's own (the prefill samples its first token with them)
    cache_salt: str | None
    skip_blocks: int  # leading full blocks the decode replica's tree holds: not sent back
    routing: RoutingKey  # prefix affinity among the prefill replicas (token ids, namespaced)
    target_replica: str | None = None  # the ingress's choice (prefix affinity there); None: routing decides

    @classmethod
    def of(cls, token_ids: list[int], params: SamplingParams, cache_salt: str | None, skip_blocks: int,
           target_replica: str | None = None) -> "PrefillJob":
        key = tuple(token_ids)
        if cache_salt:
            key = (f"ns:{cache_salt}",) + key
        return cls(list(token_ids), params, cache_salt, skip_blocks, RoutingKey(key), target_replica)


@dataclass(frozen=True)
class ReleaseJob:
    """The decode replica has a handoff's blocks: its prefill replica may drop its hold."""

    target_replica: str  # the routers send it to this replica when it is live
    handoff_id: str
    routing: None = None

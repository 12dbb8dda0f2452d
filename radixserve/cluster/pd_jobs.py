"""What the decode role sends the prefill role: a prompt to compute (PrefillJob) and an ack
(ReleaseJob). Plain dataclasses that Ray carries; routers read `routing` / `target_replica`."""

from __future__ import annotations

from dataclasses import dataclass

from radixserve.cluster.routing_key import RoutingKey
from radixserve.sampling_params import SamplingParams


@dataclass(frozen=True)
class PrefillJob:
    token_ids: list[int]  # the prompt, tokenized and templated by the decode replica
    params: SamplingParams  # the request's own (the prefill samples its first token with them)
    cache_salt: str | None
    skip_blocks: int  # leading full blocks the decode replica's tree holds: not sent back
    routing: RoutingKey  # prefix affinity among the prefill replicas (token ids, namespaced)

    @classmethod
    def of(cls, token_ids: list[int], params: SamplingParams, cache_salt: str | None, skip_blocks: int) -> "PrefillJob":
        key = tuple(token_ids)
        if cache_salt:
            key = (f"ns:{cache_salt}",) + key
        return cls(list(token_ids), params, cache_salt, skip_blocks, RoutingKey(key))


@dataclass(frozen=True)
class ReleaseJob:
    """The decode replica has a handoff's blocks: its prefill replica may drop its hold."""

    target_replica: str  # the routers send it to this replica when it is live
    handoff_id: str
    routing: None = None

"""ClusterOptions: how many replicas, which router, what each replica reserves. No Ray."""

from __future__ import annotations

from dataclasses import dataclass, field

from radixserve.cluster.affinity import AffinityConfig

ROUTERS = ("affinity", "round_robin", "pow2", "ray_prefix")  # routers.ROUTER_CLASSES names their classes
DEFAULT_APP_NAME = "radixserve"
PREFILL_DEPLOYMENT, DECODE_DEPLOYMENT = "PrefillReplica", "DecodeReplica"  # the disaggregated roles' deployments


@dataclass(frozen=True)
class PDOptions:
    transfer_timeout_s: float = 30.0  # from sending the job to having the bytes; then recompute here
    local_prefill_tokens: int = 32  # prompts with at most this many tokens beyond the cached blocks stay here
    # Conditional disaggregation: once this decode replica's prompts waiting at its prefill
    # replica add up to this many tokens, and its own pending prompt work is less, the next
    # prompt is computed here (its streams stall for it, as colocated; the burst does not
    # queue behind the prefill role). 0: every prompt goes to the prefill role.
    prefill_backlog_tokens: int = 0
    max_attempts: int = 3  # prefill replicas tried when one dies
    hold_s: float = 60.0  # how long a prefill replica holds an export without its ack

    def __post_init__(self) -> None:
        if self.transfer_timeout_s <= 0 or self.hold_s <= 0:
            raise ValueError("transfer_timeout_s and hold_s must be > 0")
        if self.local_prefill_tokens < 0 or self.prefill_backlog_tokens < 0 or self.max_attempts < 1:
            raise ValueError("local_prefill_tokens and prefill_backlog_tokens must be >= 0, max_attempts >= 1")


@dataclass(frozen=True)
class ClusterOptions:
    replicas: int = 2
    router: str = "affinity"  # affinity, round_robin, pow2 (Ray's default) or ray_prefix (Ray Serve LLM's)
    affinity: AffinityConfig = field(default_factory=AffinityConfig)
    replica_cpus: float = 1.0  # Ray CPUs each replica reserves (its engine's threads are --num-threads)
    max_ongoing_requests: int = 256  # per replica; the engine queues them (its own cap answers 503)
    app_name: str = DEFAULT_APP_NAME
    health_check_period_s: float = 2.0
    prefill_replicas: int = 0  # > 0 (with decode_replicas): disaggregated roles instead of `replicas`
    decode_replicas: int = 0
    pd: PDOptions = field(default_factory=PDOptions)
    # Disaggregated: a Ray custom resource each role's replicas need (a tiny amount of it), so
    # they land on the nodes started with it (`ray start --resources '{"prefill": 8}'`).
    prefill_resource: str | None = None
    decode_resource: str | None = None

    @property
    def disaggregated(self) -> bool:
        return self.prefill_replicas > 0

    @property
    def total_replicas(self) -> int:
        return self.prefill_replicas + self.decode_replicas if self.disaggregated else self.replicas

    def __post_init__(self) -> None:
        if (self.prefill_replicas > 0) != (self.decode_replicas > 0) or min(self.prefill_replicas, self.decode_replicas) < 0:
            raise ValueError("prefill_replicas and decode_replicas go together, both >= 1 "
                             f"(got {self.prefill_replicas} and {self.decode_replicas})")
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        if self.router not in ROUTERS:
            raise ValueError(f"router must be one of {', '.join(ROUTERS)}, got {self.router!r}")
        if self.replica_cpus < 0:
            raise ValueError(f"replica_cpus must be >= 0, got {self.replica_cpus}")
        if self.max_ongoing_requests < 1:
            raise ValueError(f"max_ongoing_requests must be >= 1, got {self.max_ongoing_requests}")

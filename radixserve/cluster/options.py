"""ClusterOptions: how many replicas, which router, what each replica reserves. No Ray."""

from __future__ import annotations

from dataclasses import dataclass, field

from radixserve.cluster.affinity import AffinityConfig

ROUTERS = ("affinity", "round_robin", "pow2", "ray_prefix")  # routers.ROUTER_CLASSES names their classes
DEFAULT_APP_NAME = "radixserve"


@dataclass(frozen=True)
class ClusterOptions:
    replicas: int = 2
    router: str = "affinity"  # affinity, round_robin, pow2 (Ray's default) or ray_prefix (Ray Serve LLM's)
    affinity: AffinityConfig = field(default_factory=AffinityConfig)
    replica_cpus: float = 1.0  # Ray CPUs each replica reserves (its engine's threads are --num-threads)
    max_ongoing_requests: int = 256  # per replica; the engine queues them (its own cap answers 503)
    app_name: str = DEFAULT_APP_NAME
    health_check_period_s: float = 2.0

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        if self.router not in ROUTERS:
            raise ValueError(f"router must be one of {', '.join(ROUTERS)}, got {self.router!r}")
        if self.replica_cpus < 0:
            raise ValueError(f"replica_cpus must be >= 0, got {self.replica_cpus}")
        if self.max_ongoing_requests < 1:
            raise ValueError(f"max_ongoing_requests must be >= 1, got {self.max_ongoing_requests}")

"""build_app: the Ray Serve application (ingress -> replicas with a request router); deploy/shutdown."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from radixserve.cluster.affinity import AffinityConfig
from radixserve.cluster.ingress import ClusterIngress, IngressOptions
from radixserve.cluster.replica import RadixReplica
from radixserve.cluster.routers import ROUTER_CLASSES
from radixserve.server.options import ServerOptions

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
        if self.router not in ROUTER_CLASSES:
            raise ValueError(f"router must be one of {', '.join(ROUTER_CLASSES)}, got {self.router!r}")
        if self.replica_cpus < 0:
            raise ValueError(f"replica_cpus must be >= 0, got {self.replica_cpus}")


def build_app(engine_kwargs: dict[str, Any], server: ServerOptions, cluster: ClusterOptions) -> Any:
    """The application: an ingress (no CPU reserved) in front of `cluster.replicas` replicas,
    each running one engine with `engine_kwargs`."""
    router_kwargs = dataclasses.asdict(cluster.affinity) if cluster.router == "affinity" else {}
    replica = serve.deployment(
        RadixReplica,
        name="RadixReplica",
        num_replicas=cluster.replicas,
        max_ongoing_requests=cluster.max_ongoing_requests,
        ray_actor_options={"num_cpus": cluster.replica_cpus},
        health_check_period_s=cluster.health_check_period_s,
        graceful_shutdown_timeout_s=server.shutdown_grace_s + 5,
        request_router_config=RequestRouterConfig(
            request_router_class=ROUTER_CLASSES[cluster.router], request_router_kwargs=router_kwargs
        ),
    )
    ingress = serve.deployment(
        ClusterIngress, name="Ingress", num_replicas=1, max_ongoing_requests=4096, ray_actor_options={"num_cpus": 0}
    )
    options = IngressOptions(cluster.app_name, cluster.replicas, server.shared_cache_across_keys)
    return ingress.bind(replica.bind(engine_kwargs, server), options)


def deploy(engine_kwargs: dict[str, Any], server: ServerOptions, cluster: ClusterOptions, host: str, port: int) -> None:
    """Start Serve's HTTP proxy on host:port (Ray must be initialized) and run the app; returns
    once every replica is up."""
    serve.start(http_options={"host": host, "port": port})
    serve.run(build_app(engine_kwargs, server, cluster), name=cluster.app_name, route_prefix="/", blocking=False)

"""build_app: the Ray Serve application (ingress -> replicas with a request router); deploy/shutdown."""

from __future__ import annotations

import dataclasses
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from radixserve.cluster.ingress import ClusterIngress, IngressOptions
from radixserve.cluster.options import ClusterOptions
from radixserve.cluster.replica import RadixReplica
from radixserve.cluster.routers import ROUTER_CLASSES
from radixserve.server.options import ServerOptions

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

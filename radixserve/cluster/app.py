"""build_app: the Ray Serve application (ingress -> replicas with a request router); deploy/shutdown."""

from __future__ import annotations

import dataclasses
from typing import Any

from ray import serve
from ray.serve.config import RequestRouterConfig

from radixserve.cluster.ingress import ClusterIngress, IngressOptions, KVEventRouting
from radixserve.cluster.options import DECODE_DEPLOYMENT, PREFILL_DEPLOYMENT, ClusterOptions
from radixserve.cluster.replica import RadixReplica
from radixserve.cluster.routers import ROUTER_CLASSES
from radixserve.server.options import ServerOptions

ROLE_RESOURCE_UNITS = 0.001  # of a role's custom resource per replica: placement, not a count


def build_app(engine_kwargs: dict[str, Any], server: ServerOptions, cluster: ClusterOptions) -> Any:
    """The application: an ingress (no CPU reserved) in front of `cluster.replicas` replicas,
    each running one engine with `engine_kwargs`; disaggregated (cluster.prefill_replicas > 0),
    in front of decode replicas that send prompts to prefill replicas."""
    ingress = serve.deployment(
        ClusterIngress, name="Ingress", num_replicas=1, max_ongoing_requests=4096, ray_actor_options={"num_cpus": 0}
    )
    options = IngressOptions(cluster.app_name, cluster.total_replicas, server.shared_cache_across_keys,
                             api_keys=server.all_api_keys)
    if engine_kwargs.get("kv_events_endpoint") and cluster.router == "affinity":  # route on the replicas' events
        options = dataclasses.replace(options, kv_events=KVEventRouting.of(engine_kwargs, server))
    if not cluster.disaggregated:
        replica = _deployment(RadixReplica, "RadixReplica", cluster.replicas, server, cluster)
        return ingress.bind(replica.bind(engine_kwargs, server), options)
    from radixserve.cluster.pd_replica import DecodeReplica, PrefillReplica

    prefill = _deployment(PrefillReplica, PREFILL_DEPLOYMENT, cluster.prefill_replicas, server, cluster,
                          cluster.prefill_resource)
    decode = _deployment(DecodeReplica, DECODE_DEPLOYMENT, cluster.decode_replicas, server, cluster,
                         cluster.decode_resource)
    prefill_app = prefill.bind(engine_kwargs, server, cluster.pd)
    if cluster.router == "affinity":  # the ingress picks the prefill replica too (prefill_picker.py)
        options = dataclasses.replace(options, prefill_affinity=cluster.affinity)
    return ingress.bind(decode.bind(engine_kwargs, server, prefill_app, cluster.pd), options, prefill_app)


def _deployment(
    cls: type, name: str, replicas: int, server: ServerOptions, cluster: ClusterOptions, resource: str | None = None,
) -> Any:
    router_kwargs = dataclasses.asdict(cluster.affinity) if cluster.router == "affinity" else {}
    actor_options: dict[str, Any] = {"num_cpus": cluster.replica_cpus}
    if resource:
        actor_options["resources"] = {resource: ROLE_RESOURCE_UNITS}
    return serve.deployment(
        cls,
        name=name,
        num_replicas=replicas,
        max_ongoing_requests=cluster.max_ongoing_requests,
        ray_actor_options=actor_options,
        health_check_period_s=cluster.health_check_period_s,
        graceful_shutdown_timeout_s=server.shutdown_grace_s + 5,
        request_router_config=RequestRouterConfig(
            request_router_class=ROUTER_CLASSES[cluster.router], request_router_kwargs=router_kwargs
        ),
    )


def deploy(engine_kwargs: dict[str, Any], server: ServerOptions, cluster: ClusterOptions, host: str, port: int) -> None:
    """Start Serve's HTTP proxy on host:port (Ray must be initialized) and run the app; returns
    once every replica is up."""
    serve.start(http_options={"host": host, "port": port})
    serve.run(build_app(engine_kwargs, server, cluster), name=cluster.app_name, route_prefix="/", blocking=False)

"""`radixserve serve --replicas N` / `--ray-address ADDR`: the cluster app on Ray Serve."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from typing import Any

INSTALL_HINT = "the cluster needs Ray Serve: pip install -c constraints.txt -e '.[cluster]'"


def add_cluster_args(parser: argparse.ArgumentParser) -> None:
    """Flags of the cluster mode (used when --replicas or --ray-address is given)."""
    from radixserve.cluster.affinity import AffinityConfig
    from radixserve.cluster.options import ROUTERS

    group = parser.add_argument_group("cluster options (Ray Serve)")
    defaults = AffinityConfig()
    group.add_argument("--replicas", type=int, default=None,
                       help="run N replicas (one engine each) on Ray Serve behind a prefix-affinity router")
    group.add_argument("--ray-address", default=None,
                       help="join this Ray cluster (e.g. 'auto' or HEAD:6379) instead of starting Ray locally")
    group.add_argument("--router", default="affinity", choices=list(ROUTERS),
                       help="how requests pick a replica (default: prefix affinity with sessions and balance)")
    group.add_argument("--balance-threshold", type=int, default=defaults.balance_threshold,
                       help="requests the preferred replica may run beyond the least loaded one before "
                            "affinity yields to load")
    group.add_argument("--replica-cpus", type=float, default=1.0, help="Ray CPUs each replica reserves")


def cluster_requested(args: argparse.Namespace) -> bool:
    return getattr(args, "replicas", None) is not None or getattr(args, "ray_address", None) is not None


def cluster_only_flags(args: argparse.Namespace) -> list[str]:
    """The cluster flags given a value other than their default (they do nothing without
    --replicas or --ray-address)."""
    from radixserve.cluster.affinity import AffinityConfig

    defaults = {"router": "affinity", "balance_threshold": AffinityConfig().balance_threshold, "replica_cpus": 1.0}
    return ["--" + name.replace("_", "-") for name, value in defaults.items() if getattr(args, name, value) != value]


def refuse_cluster_flags_alone(args: argparse.Namespace) -> None:
    """ValueError for cluster flags given to a single server (they would do nothing)."""
    flags = cluster_only_flags(args)
    if flags and not cluster_requested(args):
        raise ValueError(f"{', '.join(flags)} configure replicas: give --replicas N (or --ray-address) too")


def cluster_options(args: argparse.Namespace) -> Any:
    """The ClusterOptions of the flags (ValueError for bad ones, before Ray is touched)."""
    from radixserve.cluster.affinity import AffinityConfig
    from radixserve.cluster.options import ClusterOptions

    return ClusterOptions(
        replicas=args.replicas if args.replicas is not None else 1, router=args.router,
        affinity=AffinityConfig(balance_threshold=args.balance_threshold), replica_cpus=args.replica_cpus,
    )


def serve_cluster(args: argparse.Namespace, engine_kwargs: dict[str, Any], server_options: Any) -> int:
    """Start (or join) Ray, deploy the app, serve until SIGINT/SIGTERM, then shut Serve down."""
    cluster = cluster_options(args)
    try:
        import ray
        from ray import serve
    except ImportError:
        raise ValueError(INSTALL_HINT) from None
    from radixserve.cluster.app import deploy

    replicas = cluster.replicas
    if args.ray_address:
        ray.init(address=args.ray_address, logging_level="warning")
    else:
        cpus = max(os.cpu_count() or 1, int(replicas * cluster.replica_cpus + 0.999))
        cpus += cluster.router == "ray_prefix"  # its prefix-tree actor needs a CPU slot of its own
        ray.init(num_cpus=cpus, include_dashboard=False, logging_level="warning")
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        deploy(engine_kwargs, server_options, cluster, args.host, args.port)
        print(f"radixserve: serving {replicas} replicas on http://{args.host}:{args.port} "
              f"(router: {cluster.router})", file=sys.stderr, flush=True)
        while not stop.wait(1.0):
            pass
    finally:
        if args.ray_address:
            serve.delete(cluster.app_name)  # leave the cluster's Serve (and other apps) running
        else:
            serve.shutdown()
        ray.shutdown()
    return 0

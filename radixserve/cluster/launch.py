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
    from radixserve.cluster.options import ROUTERS, PDOptions

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
    group.add_argument("--prefill-replicas", type=int, default=None,
                       help="disaggregated: P replicas that compute prompts (with --decode-replicas)")
    group.add_argument("--decode-replicas", type=int, default=None,
                       help="disaggregated: D replicas that decode, receiving the prompt's KV blocks they lack")
    group.add_argument("--prefill-resource", default=None,
                       help="disaggregated: a Ray custom resource the prefill replicas need (their nodes' resource)")
    group.add_argument("--decode-resource", default=None,
                       help="disaggregated: a Ray custom resource the decode replicas need")
    group.add_argument("--transfer-timeout", type=float, default=PDOptions().transfer_timeout_s,
                       help="seconds a decode replica waits for a prompt's KV before computing it itself")
    group.add_argument("--local-prefill-tokens", type=int, default=PDOptions().local_prefill_tokens,
                       help="a prompt with at most this many tokens beyond a decode replica's cached blocks "
                            "is computed there")
    group.add_argument("--prefill-backlog-tokens", type=int, default=PDOptions().prefill_backlog_tokens,
                       help="conditional disaggregation: once a decode replica's prompts waiting at the prefill "
                            "replica add up to this many tokens, it computes the next one itself (0: never)")


def cluster_requested(args: argparse.Namespace) -> bool:
    names = ("replicas", "ray_address", "prefill_replicas", "decode_replicas")
    return any(getattr(args, name, None) is not None for name in names)


def cluster_only_flags(args: argparse.Namespace) -> list[str]:
    """The cluster flags given a value other than their default (they do nothing without
    --replicas or --ray-address)."""
    from radixserve.cluster.affinity import AffinityConfig

    from radixserve.cluster.options import PDOptions

    pd = PDOptions()
    defaults = {"router": "affinity", "balance_threshold": AffinityConfig().balance_threshold, "replica_cpus": 1.0,
                "transfer_timeout": pd.transfer_timeout_s, "local_prefill_tokens": pd.local_prefill_tokens,
                "prefill_backlog_tokens": pd.prefill_backlog_tokens, "prefill_resource": None, "decode_resource": None}
    return ["--" + name.replace("_", "-") for name, value in defaults.items() if getattr(args, name, value) != value]


def refuse_cluster_flags_alone(args: argparse.Namespace) -> None:
    """ValueError for cluster flags given to a single server (they would do nothing)."""
    flags = cluster_only_flags(args)
    if flags and not cluster_requested(args):
        raise ValueError(f"{', '.join(flags)} configure replicas: give --replicas N (or --ray-address) too")


def cluster_options(args: argparse.Namespace) -> Any:
    """The ClusterOptions of the flags (ValueError for bad ones, before Ray is touched)."""
    from radixserve.cluster.affinity import AffinityConfig
    from radixserve.cluster.options import ClusterOptions, PDOptions

    prefill, decode = getattr(args, "prefill_replicas", None), getattr(args, "decode_replicas", None)
    if (prefill is None) != (decode is None):
        raise ValueError("--prefill-replicas and --decode-replicas go together")
    if prefill is not None and args.replicas is not None:
        raise ValueError("--replicas (colocated) and --prefill-replicas/--decode-replicas exclude each other")
    pd_only = ("--transfer-timeout", "--local-prefill-tokens", "--prefill-backlog-tokens", "--prefill-resource",
               "--decode-resource")
    pd_flags = [f for f in cluster_only_flags(args) if f in pd_only]
    if pd_flags and prefill is None:
        raise ValueError(f"{', '.join(pd_flags)} configure disaggregation: give --prefill-replicas and --decode-replicas")
    return ClusterOptions(
        replicas=args.replicas if args.replicas is not None else 1, router=args.router,
        affinity=AffinityConfig(balance_threshold=args.balance_threshold), replica_cpus=args.replica_cpus,
        prefill_replicas=prefill or 0, decode_replicas=decode or 0,
        prefill_resource=args.prefill_resource, decode_resource=args.decode_resource,
        pd=PDOptions(transfer_timeout_s=args.transfer_timeout, local_prefill_tokens=args.local_prefill_tokens,
                     prefill_backlog_tokens=args.prefill_backlog_tokens),
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

    replicas = cluster.total_replicas
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
        roles = (f" ({cluster.prefill_replicas} prefill + {cluster.decode_replicas} decode)"
                 if cluster.disaggregated else "")
        print(f"radixserve: serving {replicas} replicas{roles} on http://{args.host}:{args.port} "
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

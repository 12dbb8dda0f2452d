"""Several replicas: radixserve engines as Ray Serve replicas behind a prefix-affinity router.

Ray-free parts (importable without the `cluster` extra): prefix_tree (ApproxPrefixTree),
affinity (AffinityPolicy), routing_key, forwarding, metrics_merge. Ray parts: routers,
replica, ingress, app (build_app, deploy), launch (`radixserve serve --replicas N`).
"""

"""The cluster ingress's routing decisions as its /metrics counts them, for tests on a live cluster."""

from __future__ import annotations

import httpx

DECODE_DECISIONS = "radixserve_cluster_routing_decisions_total"
PREFILL_DECISIONS = "radixserve_cluster_prefill_routing_decisions_total"


def routing_reasons(url: str, family: str = DECODE_DECISIONS) -> dict[str, float]:
    """reason label -> count of the decisions metric `family` at `url`."""
    out = {}
    for line in httpx.get(url + "/metrics", timeout=60).text.splitlines():
        if line.startswith(family + "{"):
            reason = line.split('reason="')[1].split('"')[0]
            out[reason] = float(line.rsplit(" ", 1)[1])
    return out

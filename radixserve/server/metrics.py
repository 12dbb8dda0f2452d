"""ServerMetrics: Prometheus metrics of one app, in a registry of its own."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from radixserve.server.request_group import MemberTiming

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300)
_TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1, 2.5, 5)

# engine.stats() key -> (metric name, help); counters are cumulative in the engine
_ENGINE_COUNTERS = {
    "prompt_tokens": ("radixserve_prompt_tokens", "Prompt tokens admitted by the engine"),
    "cached_prompt_tokens": ("radixserve_cached_prompt_tokens", "Prompt tokens served from the prefix cache"),
    "generated_tokens": ("radixserve_generated_tokens", "Tokens generated"),
    "computed_tokens": ("radixserve_computed_tokens", "Tokens run through the model"),
    "preemptions": ("radixserve_preemptions", "Requests preempted to free KV blocks"),
    "evicted_blocks": ("radixserve_evicted_blocks", "KV blocks evicted from the prefix cache"),
    "restored_prompt_tokens": ("radixserve_restored_prompt_tokens", "Cached prompt tokens restored from the second KV tier"),
    "tier_hits": ("radixserve_kv_tier_hits", "Prefix matches that restored blocks from the second KV tier"),
    "restored_blocks": ("radixserve_kv_restored_blocks", "KV blocks restored from the second tier into the pool"),
    "tier_prefetched_blocks": ("radixserve_kv_tier_prefetched_blocks",
                               "Second-tier blocks read from disk by the prefetch thread before a restore"),
    "tier_prefetch_holds": ("radixserve_kv_tier_prefetch_holds",
                            "Requests held back while their second-tier pages were read from disk"),
    "steps": ("radixserve_engine_steps", "Engine steps that ran the model"),
    "spec_drafts": ("radixserve_spec_drafts", "Speculative drafts verified (one per request and step)"),
    "spec_draft_tokens": ("radixserve_spec_draft_tokens", "Speculative tokens proposed"),
    "spec_accepted_tokens": ("radixserve_spec_accepted_tokens", "Speculative tokens accepted by verification"),
    # prefill/decode disaggregation (engine/kv_transfer.py): a prefill replica's exports ...
    "kv_sent_blocks": ("radixserve_kv_sent_blocks", "KV blocks exported to decode replicas"),
    "kv_sent_tokens": ("radixserve_kv_sent_tokens", "Prompt tokens whose KV was exported to decode replicas"),
    "kv_sent_bytes": ("radixserve_kv_sent_bytes", "Bytes of KV exported to decode replicas"),
    "kv_export_ms": ("radixserve_kv_export_ms", "Milliseconds spent copying exported KV out of the pool"),
    "kv_holds_expired": ("radixserve_kv_holds_expired", "Exports released by timeout (their ack never came)"),
    # ... and a decode replica's imports
    "kv_received_blocks": ("radixserve_kv_received_blocks", "KV blocks received and inserted into the tree"),
    "kv_received_tokens": ("radixserve_kv_received_tokens", "Prompt tokens whose KV was received"),
    "kv_received_bytes": ("radixserve_kv_received_bytes", "Bytes of KV received"),
    "kv_fetch_ms": ("radixserve_kv_transfer_ms", "Milliseconds waiting for KV bytes to arrive"),
    "kv_import_ms": ("radixserve_kv_import_ms", "Milliseconds spent copying received KV into the pool"),
    "kv_skipped_blocks": ("radixserve_kv_blocks_already_cached", "Prompt blocks a decode replica held before asking"),
    "kv_blocks_already_held": ("radixserve_kv_blocks_received_meanwhile",
                               "Received blocks the decode tree had gained meanwhile (not copied)"),
    "kv_fallback_recomputes": ("radixserve_kv_fallback_recomputes",
                               "Prompts computed on the decode replica because their KV did not arrive"),
    "kv_fallback_tokens": ("radixserve_kv_fallback_tokens", "Prompt tokens of those fallbacks"),
    "kv_remote_prefills": ("radixserve_kv_remote_prefills", "Prompts sent to prefill replicas (retries included)"),
    "kv_prefill_retries": ("radixserve_kv_prefill_retries", "Prompts resent after their prefill replica died"),
}
_ENGINE_GAUGES = {
    "running": ("radixserve_requests_running", "Requests running in the engine"),
    "waiting": ("radixserve_requests_waiting", "Requests waiting in the engine"),
    "blocks_total": ("radixserve_kv_blocks_total", "KV blocks in the pool"),
    "blocks_free": ("radixserve_kv_blocks_free", "KV blocks free"),
    "blocks_cached": ("radixserve_kv_blocks_cached", "KV blocks held by the prefix cache"),
    "blocks_evictable": ("radixserve_kv_blocks_evictable", "Cached KV blocks no request uses"),
    "cache_nodes": ("radixserve_cache_nodes", "Nodes of the radix prefix cache"),
    "tier_blocks_total": ("radixserve_kv_tier_blocks_total", "Block slots of the second KV tier"),
    "tier_blocks_used": ("radixserve_kv_tier_blocks_used", "Second-tier slots holding cached blocks"),
    "sessions_open": ("radixserve_sessions_open", "Agent sessions holding their latest context in the cache"),
    "pins": ("radixserve_pinned_prefixes", "Prefixes pinned with a TTL"),
    "tier_persist_failed": ("radixserve_kv_persist_failed", "1 when the persisted tier could not be written"),
    "spec_acceptance_rate": ("radixserve_spec_acceptance_rate", "Accepted / proposed speculative tokens so far"),
    "kv_export_holds": ("radixserve_kv_export_holds", "Exports holding their blocks until the decode side acks"),
}


class ServerMetrics:
    """HTTP and latency metrics observed by the server, plus the engine's own counters and
    gauges read from `stats()` (the engine thread's latest snapshot) at scrape time."""

    def __init__(self, stats: Callable[[], dict[str, Any]], server_gauges: Callable[[], dict[str, float]]):
        self.registry = CollectorRegistry()
        self.http_requests = Counter(
            "radixserve_http_requests", "HTTP requests answered, by endpoint and status",
            ["endpoint", "status"], registry=self.registry,
        )
        self.finished_requests = Counter(
            "radixserve_requests_finished", "Engine requests finished, by reason", ["reason"], registry=self.registry
        )
        self.ttft = Histogram(
            "radixserve_time_to_first_token_seconds", "From arrival to the first output token",
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.tpot = Histogram(
            "radixserve_time_per_output_token_seconds", "Mean time between output tokens of a request",
            buckets=_TPOT_BUCKETS, registry=self.registry,
        )
        self.e2e = Histogram(
            "radixserve_e2e_request_latency_seconds", "From arrival to the last token",
            buckets=_LATENCY_BUCKETS, registry=self.registry,
        )
        self.registry.register(_EngineCollector(stats, server_gauges))

    def observe_http(self, endpoint: str, status: int) -> None:
        self.http_requests.labels(endpoint=endpoint, status=str(status)).inc()

    def observe_finished(self, timing: MemberTiming) -> None:
        self.finished_requests.labels(reason=timing.finish_reason or "unknown").inc()
        self.ttft.observe(timing.ttft_s)
        self.e2e.observe(timing.e2e_s)
        if timing.tpot_s is not None:
            self.tpot.observe(timing.tpot_s)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], dict[str, Any]], server_gauges: Callable[[], dict[str, float]]):
        self.stats = stats
        self.server_gauges = server_gauges

    def collect(self) -> Iterator[Any]:
        stats = self.stats()
        for key, (name, doc) in _ENGINE_COUNTERS.items():
            if key in stats:
                yield CounterMetricFamily(name, doc, value=stats[key])
        for key, (name, doc) in _ENGINE_GAUGES.items():
            if key in stats:
                yield GaugeMetricFamily(name, doc, value=stats[key])
        yield from _tier_families(stats)
        if "blocks_total" in stats and "blocks_free" in stats:
            used = stats["blocks_total"] - stats["blocks_free"]
            yield GaugeMetricFamily("radixserve_kv_blocks_used", "KV blocks in use (requests or cache)", value=used)
        for name, value in self.server_gauges().items():
            yield GaugeMetricFamily(name, "server-side request gauge", value=value)


def _tier_families(stats: dict[str, Any]) -> Iterator[Any]:
    """Evictions by reason and cached bytes by tier, from the engine's stats."""
    reasons = {k[len("evicted_blocks_"):]: v for k, v in stats.items() if k.startswith("evicted_blocks_")}
    if reasons:
        family = CounterMetricFamily(
            "radixserve_kv_evicted_blocks_by_reason",
            "KV blocks evicted, by reason (demoted: moved to the second tier; dropped: gone from the pool; "
            "tier_dropped: gone from the second tier; flushed)", labels=["reason"],
        )
        for reason, value in sorted(reasons.items()):
            family.add_metric([reason], value)
        yield family
    if "pool_cached_bytes" in stats:
        family = GaugeMetricFamily("radixserve_kv_cached_bytes", "Bytes of cached KV, by tier", labels=["tier"])
        family.add_metric(["pool"], stats["pool_cached_bytes"])
        family.add_metric(["offload"], stats.get("tier_bytes", 0))
        yield family

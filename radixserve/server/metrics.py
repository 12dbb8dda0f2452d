"""ServerMetrics: Prometheus metrics of one app, in a registry of its own."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from radixserve.engine.stats import CacheStats, EngineStats, HintStats
from radixserve.server.request_group import MemberTiming

if TYPE_CHECKING:  # both import torch; the cluster's ingress reads this module's CONTENT_TYPE without it
    from radixserve.engine.kv_transfer import TransferStats
    from radixserve.kv_tier.tiering import TierStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 60, 120, 300)
_TPOT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1, 2.5, 5)

Read = Callable[[EngineStats], "int | float | None"]


def _cache(read: Callable[[CacheStats], int]) -> Read:
    return lambda s: read(s.cache) if s.cache is not None else None


def _tier(read: Callable[[TierStats], int]) -> Read:
    return lambda s: read(s.tier) if s.tier is not None else None


def _hints(read: Callable[[HintStats], int]) -> Read:
    return lambda s: read(s.hints) if s.hints is not None else None


def _cpu(read: Callable[[Any], "int | float"]) -> Read:
    return lambda s: read(s.cpu) if s.cpu is not None else None


def _transfer(read: Callable[[TransferStats], "int | float"]) -> Read:
    return lambda s: read(s.transfer) if s.transfer is not None else None


# metric name -> (help, how to read it from EngineStats; None: not exported); counters are cumulative
_ENGINE_COUNTERS: dict[str, tuple[str, Read]] = {
    "radixserve_prompt_tokens": ("Prompt tokens admitted by the engine", lambda s: s.prompt_tokens),
    "radixserve_cached_prompt_tokens": ("Prompt tokens served from the prefix cache", lambda s: s.cached_prompt_tokens),
    "radixserve_generated_tokens": ("Tokens generated", lambda s: s.generated_tokens),
    "radixserve_computed_tokens": ("Tokens run through the model", lambda s: s.computed_tokens),
    "radixserve_preemptions": ("Requests preempted to free KV blocks", lambda s: s.preemptions),
    "radixserve_cpu_team_reductions": ("Times the steps' thread team shrank because other processes took cores",
                                       _cpu(lambda c: c.reductions)),
    "radixserve_evicted_blocks": ("KV blocks evicted from the prefix cache", lambda s: s.evicted_blocks),
    "radixserve_kv_window_pages_trimmed": ("Window-layer KV pages dropped from blocks no window reads any more",
                                           lambda s: s.window_pages_trimmed),
    "radixserve_restored_prompt_tokens": ("Cached prompt tokens restored from the second KV tier",
                                          _cache(lambda c: c.restored_prompt_tokens)),
    "radixserve_kv_tier_hits": ("Prefix matches that restored blocks from the second KV tier",
                                _cache(lambda c: c.tier_hits)),
    "radixserve_kv_restored_blocks": ("KV blocks restored from the second tier into the pool",
                                      _cache(lambda c: c.restored_blocks)),
    "radixserve_kv_tier_prefetched_blocks": ("Second-tier blocks read from disk by the prefetch thread before a restore",
                                             _tier(lambda t: t.tier_prefetched_blocks)),
    "radixserve_kv_tier_prefetch_holds": ("Requests held back while their second-tier pages were read from disk",
                                          _tier(lambda t: t.tier_prefetch_holds)),
    "radixserve_speculative_prefills": ("Speculative prefills (agent hints) run after a reply to warm the next turn",
                                        _hints(lambda h: h.speculative_prefills)),
    "radixserve_speculative_prefill_tokens": ("Prompt tokens those speculative prefills computed",
                                              _hints(lambda h: h.speculative_prefill_tokens)),
    "radixserve_engine_steps": ("Engine steps that ran the model", lambda s: s.steps),
    "radixserve_spec_drafts": ("Speculative drafts verified (one per request and step)", lambda s: s.spec_drafts),
    "radixserve_spec_draft_tokens": ("Speculative tokens proposed", lambda s: s.spec_draft_tokens),
    "radixserve_spec_accepted_tokens": ("Speculative tokens accepted by verification", lambda s: s.spec_accepted_tokens),
    "radixserve_spec_tree_drafts": ("Drafts that the prefix cache's stored sequences (the request's namespace) "
                                    "contributed to", lambda s: s.spec_tree_drafts),
    "radixserve_spec_branched_drafts": ("Drafts verified as a tree of candidates (speculative_tree_width > 1)",
                                        lambda s: s.spec_branched_drafts),
    "radixserve_spec_branch_hits": ("Tree verifications that accepted a candidate off the main chain",
                                    lambda s: s.spec_branch_hits),
    "radixserve_spec_forced_drafts": ("Jump-forward verifications (a grammar's forced text checked in one step)",
                                      lambda s: s.spec_forced_drafts),
    "radixserve_spec_forced_tokens": ("Forced tokens drafted by jump-forward", lambda s: s.spec_forced_tokens),
    "radixserve_spec_forced_accepted": ("Forced tokens accepted by verification", lambda s: s.spec_forced_accepted),
    # prefill/decode disaggregation (engine/kv_transfer.py): a prefill replica's exports ...
    "radixserve_kv_sent_blocks": ("KV blocks exported to decode replicas", _transfer(lambda t: t.sent_blocks)),
    "radixserve_kv_sent_tokens": ("Prompt tokens whose KV was exported to decode replicas",
                                  _transfer(lambda t: t.sent_tokens)),
    "radixserve_kv_sent_bytes": ("Bytes of KV exported to decode replicas", _transfer(lambda t: t.sent_bytes)),
    "radixserve_kv_export_ms": ("Milliseconds spent copying exported KV out of the pool",
                                _transfer(lambda t: t.export_ms)),
    "radixserve_kv_holds_expired": ("Exports released by timeout (their ack never came)",
                                    _transfer(lambda t: t.holds_expired)),
    # ... and a decode replica's imports
    "radixserve_kv_received_blocks": ("KV blocks received and inserted into the tree",
                                      _transfer(lambda t: t.received_blocks)),
    "radixserve_kv_received_tokens": ("Prompt tokens whose KV was received", _transfer(lambda t: t.received_tokens)),
    "radixserve_kv_received_bytes": ("Bytes of KV received", _transfer(lambda t: t.received_bytes)),
    "radixserve_kv_transfer_ms": ("Milliseconds waiting for KV bytes to arrive", _transfer(lambda t: t.fetch_ms)),
    "radixserve_kv_import_ms": ("Milliseconds spent copying received KV into the pool",
                                _transfer(lambda t: t.import_ms)),
    "radixserve_kv_import_engine_ms": ("Milliseconds of imports spent on the engine thread (reserve, commit)",
                                       _transfer(lambda t: t.import_engine_ms)),
    "radixserve_kv_blocks_already_cached": ("Prompt blocks a decode replica held before asking",
                                            _transfer(lambda t: t.skipped_blocks)),
    "radixserve_kv_blocks_received_meanwhile": ("Received blocks the decode tree had gained meanwhile (not copied)",
                                                _transfer(lambda t: t.blocks_already_held)),
    "radixserve_kv_fallback_recomputes": ("Prompts computed on the decode replica because their KV did not arrive",
                                          _transfer(lambda t: t.fallback_recomputes)),
    "radixserve_kv_fallback_tokens": ("Prompt tokens of those fallbacks", _transfer(lambda t: t.fallback_tokens)),
    "radixserve_kv_remote_prefills": ("Prompts sent to prefill replicas (retries included)",
                                      _transfer(lambda t: t.remote_prefills)),
    "radixserve_kv_prefill_retries": ("Prompts resent after their prefill replica died",
                                      _transfer(lambda t: t.prefill_retries)),
    "radixserve_kv_backlog_local_prefills": (
        "Prompts a decode replica computed itself because the prefill role was backed up",
        _transfer(lambda t: t.backlog_local_prefills)),
}
_ENGINE_GAUGES: dict[str, tuple[str, Read]] = {
    "radixserve_requests_running": ("Requests running in the engine", lambda s: s.running),
    "radixserve_requests_waiting": ("Requests waiting in the engine", lambda s: s.waiting),
    "radixserve_kv_blocks_total": ("KV blocks in the pool", lambda s: s.blocks_total),
    "radixserve_kv_blocks_free": ("KV blocks free", lambda s: s.blocks_free),
    "radixserve_kv_blocks_cached": ("KV blocks held by the prefix cache", lambda s: s.blocks_cached),
    "radixserve_kv_blocks_evictable": ("Cached KV blocks no request uses", lambda s: s.blocks_evictable),
    "radixserve_cache_nodes": ("Nodes of the radix prefix cache", lambda s: s.cache_nodes),
    "radixserve_weight_bytes": ("Bytes the model's weights take in memory (codes and scales when quantized)",
                                lambda s: s.weight_bytes),
    "radixserve_kv_bytes_per_token": (
        "Bytes one cached token takes in the KV pool, all layers (codes and scales for int8)",
        lambda s: s.kv_bytes_per_token),
    "radixserve_cpu_usable_cores": ("Cores this process may run on (affinity mask, cgroup quota)",
                                    _cpu(lambda c: c.usable_cores)),
    "radixserve_cpu_threads": ("Threads a step's parallel work uses now: the usable cores less those other "
                               "processes took lately (or --num-threads)", _cpu(lambda c: c.threads)),
    "radixserve_cpu_others_cores": ("Cores other processes used on the usable CPUs in the last sample",
                                    _cpu(lambda c: c.others_cores)),
    "radixserve_kv_window_pages_total": ("Window-layer KV pages (hybrid KV, sliding-window models; 0 without)",
                                         lambda s: s.window_pages_total),
    "radixserve_kv_window_pages_attached": ("Window-layer KV pages holding a block's KV",
                                            lambda s: s.window_pages_attached),
    "radixserve_kv_tier_blocks_total": ("Block slots of the second KV tier", _tier(lambda t: t.tier_blocks_total)),
    "radixserve_kv_tier_blocks_used": ("Second-tier slots holding cached blocks", _tier(lambda t: t.tier_blocks_used)),
    "radixserve_sessions_open": ("Agent sessions holding their latest context in the cache",
                                 _cache(lambda c: c.sessions_open)),
    "radixserve_pinned_prefixes": ("Prefixes pinned with a TTL", _cache(lambda c: c.pins)),
    "radixserve_hint_ttl_holds": ("Prefixes held by agent hints (ttl_s, priority), refreshed on a hit",
                                  _hints(lambda h: h.ttl_holds)),
    "radixserve_hint_ttl_held_blocks": ("Pool blocks on prefixes held by agent hints",
                                        _hints(lambda h: h.ttl_held_blocks)),
    "radixserve_kv_persist_failed": ("1 when the persisted tier could not be written",
                                     _tier(lambda t: t.tier_persist_failed)),
    "radixserve_spec_acceptance_rate": ("Accepted / proposed speculative tokens so far",
                                        lambda s: s.spec_acceptance_rate),
    "radixserve_spec_accepted_length": ("Tokens a speculative verification appends on average (accepted + 1)",
                                        lambda s: s.spec_accepted_length),
    "radixserve_kv_blocks_used": ("KV blocks in use (requests or cache)", lambda s: s.blocks_used),
    "radixserve_kv_export_holds": ("Exports holding their blocks until the decode side acks",
                                   _transfer(lambda t: t.holds)),
    "radixserve_kv_imports_pending": ("Received KV reserved in the pool, its copy not yet committed",
                                      _transfer(lambda t: t.imports_pending)),
    "radixserve_kv_prefill_backlog_tokens": ("Prompt tokens a decode replica has waiting at prefill replicas",
                                             _transfer(lambda t: t.prefill_backlog_tokens)),
}


class ServerMetrics:
    """HTTP and latency metrics observed by the server, plus the engine's own counters and
    gauges read from `stats()` (the engine thread's latest snapshot) at scrape time."""

    def __init__(self, stats: Callable[[], EngineStats], server_gauges: Callable[[], dict[str, float]]):
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


_SERVER_GAUGES = {
    "radixserve_server_requests_queued": "Requests submitted whose first output has not come yet",
    "radixserve_server_requests_in_flight": "Requests accepted and not yet finished",
    "radixserve_grammar_cache_bytes": "Bytes held by compiled grammars (tool calls, JSON schemas, regexes) in the cache",
}


class _EngineCollector(Collector):
    def __init__(self, stats: Callable[[], EngineStats], server_gauges: Callable[[], dict[str, float]]):
        self.stats = stats
        self.server_gauges = server_gauges

    def collect(self) -> Iterator[Any]:
        stats = self.stats()
        for name, (doc, read) in _ENGINE_COUNTERS.items():
            value = read(stats)
            if value is not None:
                yield CounterMetricFamily(name, doc, value=value)
        for name, (doc, read) in _ENGINE_GAUGES.items():
            value = read(stats)
            if value is not None:
                yield GaugeMetricFamily(name, doc, value=value)
        yield from _tier_families(stats)
        if stats.hints is not None:
            family = CounterMetricFamily("radixserve_hint_requests", "Requests that gave an agent hint, by kind",
                                         labels=["kind"])
            for kind, value in stats.hints.requests.items():
                family.add_metric([kind], value)
            yield family
        family = GaugeMetricFamily("radixserve_kv_cache_dtype", "1, labelled with the KV pool's element type",
                                   labels=["dtype"])
        family.add_metric([stats.kv_cache_dtype], 1)
        yield family
        family = GaugeMetricFamily("radixserve_weight_dtype", "1, labelled with how the weights are held",
                                   labels=["dtype"])
        family.add_metric([stats.weight_dtype], 1)
        yield family
        for name, value in self.server_gauges().items():
            yield GaugeMetricFamily(name, _SERVER_GAUGES.get(name, "server-side gauge"), value=value)


def _tier_families(stats: EngineStats) -> Iterator[Any]:
    """Evictions by reason and cached bytes by tier, from the engine's stats."""
    if stats.cache is None:
        return
    if stats.cache.evictions:
        family = CounterMetricFamily(
            "radixserve_kv_evicted_blocks_by_reason",
            "KV blocks evicted, by reason (demoted: moved to the second tier; dropped: gone from the pool; "
            "tier_dropped: gone from the second tier; flushed)", labels=["reason"],
        )
        for reason, value in sorted(stats.cache.evictions.items()):
            family.add_metric([reason], value)
        yield family
    family = GaugeMetricFamily("radixserve_kv_cached_bytes", "Bytes of cached KV, by tier", labels=["tier"])
    family.add_metric(["pool"], stats.cache.pool_cached_bytes)
    family.add_metric(["offload"], stats.tier.tier_bytes if stats.tier is not None else 0)
    yield family

"""ClusterIngress: the HTTP entry of the cluster app (a Ray Serve deployment).

Every request goes to one replica through the deployment handle, whose request router picks
the replica from the request's RoutingKey; the replica's own app answers it (see
forwarding.py). Disaggregated, that is a decode replica (session, then prefix affinity), and the
ingress also picks the prefill replica for the request's prompt (prefix affinity for that role,
prefill_picker.py), which the request carries to the decode replica. Cluster-wide endpoints are broadcast to every replica and merged: /health
(each replica's health), /metrics (every replica's series, labelled by replica),
/flush_cache, /abort_request (a rid lives on one replica), /v1/sessions/{id}/close and the
debug endpoints.

With KV events on (--kv-events-endpoint and the affinity router), the ingress subscribes to
every replica's event stream (kv_feed.py; disaggregated, those of both roles) and names each
request's prompt blocks as the replicas do (request_blocks.py), so the router (and the
prefill picker) match what the replicas really hold; the shadow trees stay the fallback
(replicas not tracked yet, requests not named).

A replica that dies while serving a request fails that request with a 503
(code "replica_failed"; not retried: generation may already have streamed to the client);
requests not yet sent go to the live replicas, and Ray starts a replacement.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from ray import exceptions as ray_exceptions
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from radixserve.cluster.affinity import AffinityConfig
from radixserve.cluster.forwarding import REPLICA_HEADER, ForwardedRequest, ResponseHead
from radixserve.cluster.kv_feed import KVEventFeed
from radixserve.cluster.kv_index import KVBlockIndex
from radixserve.cluster.metrics_merge import merge_metrics
from radixserve.cluster.prefill_picker import PrefillPicker
from radixserve.cluster.registry import register_kv_index, register_picker, router_for
from radixserve.cluster.request_blocks import MAX_NAMED_BYTES, RequestBlocks
from radixserve.cluster.routing_key import BROADCAST_PATHS, response_session, routing_key
from radixserve.server.errors import APIError, error_response
from radixserve.server.metrics import CONTENT_TYPE
from radixserve.server.middleware import KeyRing
from radixserve.server.options import ServerOptions
from radixserve.server.protocol.body import MAX_BODY_BYTES, read_body

_SUMMED = {"/flush_cache": "freed_blocks", "/abort_request": "aborted", "/v1/sessions/release": "released"}  # answers added up over replicas
_RESPONSE_ID = re.compile(rb'"id":\s*"(resp_[0-9A-Za-z]+)"')
_REPLICA_GONE = (ray_exceptions.RayActorError, ray_exceptions.ActorUnavailableError)
_KV_SYNC_S = 5.0  # how often the ingress asks the replicas for their KV event endpoints
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KVEventRouting:
    """What the ingress needs to route on the replicas' KV events."""

    block_size: int
    hash_scheme: str = "chained"
    model: str | None = None  # the replicas' model: its tokenizer names the requests' blocks
    model_cache_dir: str | None = None
    server: ServerOptions | None = None  # the replicas' (chat template, tool-call and reasoning parsers)
    wire_format: str = "map"  # the replicas' kv_events_format

    @classmethod
    def of(cls, engine_kwargs: dict[str, Any], server: ServerOptions | None = None) -> "KVEventRouting":
        return cls(engine_kwargs.get("block_size", 16), engine_kwargs.get("kv_events_hash", "chained"),
                   engine_kwargs.get("model"), engine_kwargs.get("model_cache_dir"), server,
                   engine_kwargs.get("kv_events_format", "map"))


@dataclass(frozen=True)
class IngressOptions:
    app_name: str
    replicas: int  # the target count (/health says "degraded" below it)
    shared_cache_across_keys: bool = False
    api_keys: tuple[str, ...] = ()  # every accepted key (admin keys included): checked here, before routing
    broadcast_timeout_s: float = 10.0
    prefill_affinity: AffinityConfig | None = None  # disaggregated: the ingress picks prefill replicas by it
    kv_events: KVEventRouting | None = None  # route on the replicas' KV events


class ClusterIngress:
    def __init__(self, replicas: Any, options: IngressOptions, prefill: Any = None):
        self.replicas = replicas  # the RadixReplica (or, disaggregated, DecodeReplica) deployment's handle
        self.prefill = prefill  # disaggregated: the PrefillReplica deployment's handle (broadcasts only)
        self.options = options
        self.keyring = KeyRing(options.api_keys)
        self.prefill_picker: PrefillPicker | None = None
        self.kv_feed: KVEventFeed | None = None
        self.request_blocks: RequestBlocks | None = None
        self._kv_synced = 0.0
        self.kv_index: KVBlockIndex | None = None
        if options.kv_events is not None:
            self._start_kv_events(options.kv_events)
        if prefill is not None and options.prefill_affinity is not None:
            self.prefill_picker = PrefillPicker(options.prefill_affinity, self.kv_index)
            register_picker(options.app_name, self.prefill_picker)  # before the handle's router starts
            _start_router(prefill)  # it tells the picker the live prefill replicas

    async def __call__(self, request: Request) -> Response:
        """Every call but /health is authenticated here first (the replicas check again): a
        refused call reaches no replica and changes no routing state."""
        path = request.url.path
        try:
            if path == "/health" and request.method == "GET":
                return await self._health()
            tenant = self._tenant(request)
            if path == "/metrics" and request.method == "GET":
                return await self._metrics(request)
            if path in BROADCAST_PATHS:
                return await self._broadcast_endpoint(request)
            if path.startswith("/v1/sessions/") and path.endswith("/close"):
                return await self._close_session(request)
            return await self._forward(request, tenant)
        except APIError as exc:
            return error_response(path, exc)

    def _start_kv_events(self, routing: KVEventRouting) -> None:
        self.kv_index = KVBlockIndex(routing.block_size, routing.hash_scheme)
        register_kv_index(self.options.app_name, self.kv_index)  # before the handle's router starts
        self.kv_feed = KVEventFeed(self.kv_index, wire_format=routing.wire_format)
        try:
            tokenizer = _tokenizer(routing.model, routing.model_cache_dir)
        except Exception:  # token-id prompts are still named
            log.warning("the ingress could not load the model's tokenizer: only token-id prompts route on KV events",
                        exc_info=True)
            tokenizer = None
        self.request_blocks = RequestBlocks(tokenizer, routing.block_size, routing.hash_scheme,
                                            self.options.shared_cache_across_keys, routing.server)
        _start_router(self.replicas)

    async def _sync_kv_events(self) -> None:
        """Every few seconds: the replicas' event endpoints (of both roles, disaggregated), to
        subscribe to new ones and drop gone ones."""
        if self.kv_feed is None or time.monotonic() - self._kv_synced < _KV_SYNC_S:
            return
        self._kv_synced = time.monotonic()
        answers: list[Any] = []
        for handle in [self.replicas] + ([self.prefill] if self.prefill is not None else []):
            try:
                answers += await handle.broadcast("kv_events").results_async(
                    timeout_s=self.options.broadcast_timeout_s, return_exceptions=True)
            except Exception:
                return  # a partial answer would drop the other role's subscriptions
        self.kv_feed.sync({a[0]: (a[1], a[2]) for a in answers if isinstance(a, tuple) and a[1]})

    def _tenant(self, request: Request) -> str | None:
        """The caller's key digest (None without keys); an APIError 401 for no accepted key."""
        if not self.keyring:
            return None
        digest, _ = self.keyring.check(request.scope["headers"])
        return digest

    # ---- one replica ------------------------------------------------------------------------

    async def _forward(self, request: Request, tenant: str | None) -> Response:
        await self._sync_kv_events()
        forwarded = await self._read(request, tenant)
        picker = self.prefill_picker
        forwarded.prefill_replica = picker.pick(forwarded.routing) if picker is not None else None
        stream = self.replicas.options(stream=True).forward.remote(forwarded)
        try:
            head = await stream.__anext__()  # a stream's head comes once its prompt is computed
            assert isinstance(head, ResponseHead)
            headers = _headers(head)
            if head.is_stream:
                return StreamingResponse(self._relay(stream, head, forwarded), status_code=head.status, headers=headers)
            body = b"".join([chunk async for chunk in stream])
        except BaseException as exc:
            stream.cancel()
            if isinstance(exc, Exception):
                raise _failure(exc) from None
            raise
        finally:
            if forwarded.prefill_replica is not None:
                picker.done(forwarded.prefill_replica)
        self._bind_response(forwarded, head, body)
        return Response(body, status_code=head.status, headers=headers)

    async def _relay(self, stream: Any, head: ResponseHead, forwarded: ForwardedRequest) -> AsyncIterator[bytes]:
        """A stream's chunks; if the replica fails mid-stream, a final error event then [DONE]."""
        bound = False
        try:
            async for chunk in stream:
                if not bound:
                    bound = self._bind_response(forwarded, head, chunk)
                yield chunk
        except Exception as exc:  # the replica died mid-stream
            error = json.dumps(_failure(exc).body()).encode()
            yield b"data: " + error + b"\n\ndata: [DONE]\n\n"
        finally:
            stream.cancel()  # no-op once finished; else (client gone) the replica aborts the request

    async def _read(self, request: Request, tenant: str | None) -> ForwardedRequest:
        body = await read_body(request, MAX_BODY_BYTES)
        parsed = None
        if body and request.method == "POST":
            try:
                parsed = json.loads(body)
            except (ValueError, RecursionError):
                parsed = None  # the replica answers with its own 400
        key = routing_key(request.url.path, parsed, tenant, self.options.shared_cache_across_keys)
        if key is not None and self.request_blocks is not None and len(body) <= MAX_NAMED_BYTES:
            key = dataclasses.replace(key, blocks=await self.request_blocks.names(request.url.path, parsed, tenant))
        return ForwardedRequest(
            request.method, request.url.path, request.scope.get("query_string", b""),
            list(request.scope["headers"]), body, key, tenant=tenant,
        )

    def _bind_response(self, forwarded: ForwardedRequest, head: ResponseHead, body: bytes) -> bool:
        """Keep a stored /v1/responses id on the replica that stores it (previous_response_id)."""
        if forwarded.path != "/v1/responses" or head.status != 200:
            return True
        found = _RESPONSE_ID.search(body)
        router = router_for(self.options.app_name)
        if found and router is not None:
            router.bind_session(response_session(forwarded.tenant, found.group(1).decode()), head.replica)
        return found is not None

    # ---- every replica ----------------------------------------------------------------------

    async def _everyone(self, request: Request, method: str, path: str) -> list[tuple[ResponseHead, bytes] | Exception]:
        body = await read_body(request, MAX_BODY_BYTES) if method == "POST" else b""
        forwarded = ForwardedRequest(method, path, request.scope.get("query_string", b""), list(request.scope["headers"]), body)
        return await self._broadcast(forwarded)

    async def _broadcast(self, forwarded: ForwardedRequest) -> list[tuple[ResponseHead, bytes] | Exception]:
        """Every replica's answer (of both roles, disaggregated), or the exception instead."""
        handles = [self.replicas] + ([self.prefill] if self.prefill is not None else [])
        results: list[tuple[ResponseHead, bytes] | Exception] = []
        for handle in handles:
            try:
                results += await handle.broadcast("call", forwarded).results_async(
                    timeout_s=self.options.broadcast_timeout_s, return_exceptions=True
                )
            except Exception as exc:  # no replica at all, or the broadcast timed out
                results.append(exc)
        return results

    async def _health(self) -> Response:
        results = await self._broadcast(ForwardedRequest("GET", "/health"))
        replicas = [_replica_health(r) for r in results]
        healthy = sum(1 for r in replicas if r["status"] == "ok")
        status = "ok" if healthy >= self.options.replicas else ("degraded" if healthy else "unhealthy")
        body = {"status": status, "replicas_healthy": healthy, "replicas_expected": self.options.replicas,
                "replicas": replicas}
        return JSONResponse(body, status_code=200 if healthy else 503)

    async def _metrics(self, request: Request) -> Response:
        results = await self._everyone(request, "GET", "/metrics")
        texts, healthy = [], 0
        for result in results:
            if isinstance(result, Exception):
                continue
            head, body = result
            if head.status != 200:
                return Response(body, status_code=head.status, headers=_headers(head))  # e.g. 401
            texts.append((head.replica, body.decode("utf-8")))
            healthy += 1
        return Response(merge_metrics(texts, self._cluster_metrics(healthy)), media_type=CONTENT_TYPE)

    def _cluster_metrics(self, reachable: int) -> list[Any]:
        gauge = GaugeMetricFamily("radixserve_cluster_replicas", "Replicas of the cluster", labels=["state"])
        gauge.add_metric(["reachable"], reachable)
        gauge.add_metric(["expected"], self.options.replicas)
        families: list[Any] = [gauge]
        router = router_for(self.options.app_name)
        if router is not None:
            decisions = CounterMetricFamily(
                "radixserve_cluster_routing_decisions", "Requests routed, by the reason of the choice", labels=["reason"]
            )
            for reason, count in sorted(router.reasons.items()):
                decisions.add_metric([reason], count)
            families.append(decisions)
        if self.prefill_picker is not None:
            picks = CounterMetricFamily(
                "radixserve_cluster_prefill_routing_decisions", "Prefill replicas chosen by the ingress, by reason",
                labels=["reason"],
            )
            for reason, count in sorted(self.prefill_picker.reasons.items()):
                picks.add_metric([reason], count)
            families.append(picks)
        return families

    async def _broadcast_endpoint(self, request: Request) -> Response:
        results = await self._everyone(request, request.method, request.url.path)
        answers: dict[str, Any] = {}
        for result in results:
            if isinstance(result, Exception):
                raise _failure(result)
            head, body = result
            if head.status != 200:
                return Response(body, status_code=head.status, headers=_headers(head))
            answers[head.replica] = json.loads(body)
        path = request.url.path
        router = router_for(self.options.app_name)
        if path == "/flush_cache" and all(a.get("flushed", "all") == "all" for a in answers.values()):
            for chooser in (router, self.prefill_picker):  # a key's own flush leaves the other keys' prefixes
                if chooser is not None:
                    chooser.forget_prefixes()
        if path in _SUMMED:
            field = _SUMMED[path]
            return JSONResponse({field: sum(a[field] for a in answers.values()), "replicas": answers})
        return JSONResponse({"replicas": answers})

    async def _close_session(self, request: Request) -> Response:
        """A session may be open on more than one replica (after a balance move): close it on
        each; 200 when some replica had it open, else the replicas' own answer (404, 400)."""
        results = await self._everyone(request, "POST", request.url.path)
        answers = [r for r in results if not isinstance(r, Exception)]
        if not answers:
            raise _failure(results[0] if results and isinstance(results[0], Exception) else RuntimeError("no replica"))
        head, body = next((a for a in answers if a[0].status == 200), answers[0])
        return Response(body, status_code=head.status, headers=_headers(head))


def _tokenizer(model: str | None, cache_dir: str | None) -> Any:
    """The replicas' tokenizer, loaded as a replica loads it (model/tokenizer.py)."""
    from radixserve.model.loader import resolve_model_path
    from radixserve.model.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model_path(model, cache_dir, float_weights=False), cache_dir=cache_dir)


def _start_router(handle: Any) -> None:
    """Start a Ray deployment handle's router now (`options()` does), not at its first call."""
    from ray.serve.handle import DeploymentHandle

    if isinstance(handle, DeploymentHandle):
        handle.options()


def _headers(head: ResponseHead) -> dict[str, str]:
    headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in head.headers if k.lower() != b"content-length"}
    headers[REPLICA_HEADER] = head.replica
    return headers


def _replica_health(result: tuple[ResponseHead, bytes] | Exception) -> dict[str, Any]:
    if isinstance(result, Exception):
        return {"replica": None, "status": "unreachable", "reason": f"{type(result).__name__}: {result}"}
    head, body = result
    try:
        answer = json.loads(body)
    except ValueError:
        answer = {"status": "unhealthy", "reason": body.decode("utf-8", "replace")}
    return {"replica": head.replica, **answer}


def _failure(exc: Exception) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, _REPLICA_GONE) or "ActorDied" in type(exc).__name__:
        return APIError(
            503, f"the replica serving this request failed ({type(exc).__name__}); the request was not completed "
            "and may be retried: Ray is replacing the replica and routes new requests to the live ones",
            type="server_error", code="replica_failed", headers={"Retry-After": "1"},
        )
    return APIError(500, f"the cluster could not serve this request: {type(exc).__name__}: {exc}",
                    type="server_error", code="internal_error")

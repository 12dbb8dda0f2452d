"""The cluster's ingress without a Ray cluster: a stand-in deployment handle runs small apps as
replicas in-process, so forwarding, streaming, replica failures and the merged cluster
endpoints are checked in a second. (Needs the `cluster` extra installed, not Ray running.)"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

pytest.importorskip("ray", reason="needs the cluster extra: .venv/bin/pip install -c constraints.txt -e '.[cluster]'")

from ray import exceptions as ray_exceptions  # noqa: E402
from starlette.applications import Starlette  # noqa: E402
from starlette.requests import Request  # noqa: E402
from starlette.responses import JSONResponse, Response, StreamingResponse  # noqa: E402
from starlette.routing import Route  # noqa: E402

from radixserve.cluster import registry  # noqa: E402
from radixserve.cluster.forwarding import ForwardedRequest, collect, serve_forwarded  # noqa: E402
from radixserve.cluster.ingress import REPLICA_HEADER, ClusterIngress, IngressOptions  # noqa: E402


def _replica_app(name: str, *, healthy: bool = True, session_open: bool = False) -> Starlette:
    async def completions(request: Request):
        body = await request.json()
        if body.get("stream"):
            async def events():
                for i in range(3):
                    yield f"data: {json.dumps({'i': i, 'replica': name})}\n\n"
                yield "data: [DONE]\n\n"

            return StreamingResponse(events(), media_type="text/event-stream")
        return JSONResponse({"replica": name, "prompt": body.get("prompt")})

    async def responses(request: Request):
        return JSONResponse({"id": f"resp_{name}1", "object": "response"})

    async def metrics(request: Request):
        if request.headers.get("authorization") != "Bearer k":
            return JSONResponse({"error": {"message": "missing key"}}, status_code=401)
        return Response(f"# TYPE radixserve_cached_prompt_tokens counter\nradixserve_cached_prompt_tokens_total {len(name)}\n")

    async def health(request: Request):
        if healthy:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unhealthy", "reason": "engine broke"}, status_code=503)

    async def abort(request: Request):
        return JSONResponse({"aborted": 1 if name == "a" else 0})

    async def flush(request: Request):
        return JSONResponse({"freed_blocks": 3})

    async def close(request: Request):
        if session_open:
            return JSONResponse({"closed": request.path_params["sid"]})
        return JSONResponse({"error": {"message": "no open session", "code": "not_found"}}, status_code=404)

    return Starlette(routes=[
        Route("/v1/completions", completions, methods=["POST"]), Route("/v1/responses", responses, methods=["POST"]),
        Route("/metrics", metrics), Route("/health", health), Route("/abort_request", abort, methods=["POST"]),
        Route("/flush_cache", flush, methods=["GET", "POST"]), Route("/v1/sessions/{sid}/close", close, methods=["POST"]),
    ])


class _Stream:
    """What handle.options(stream=True).forward.remote(...) gives: async items, cancel()."""

    def __init__(self, items: Any, fail_after: int | None):
        self.items = items
        self.fail_after = fail_after
        self.sent = 0
        self.cancelled = False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.fail_after is not None and self.sent >= self.fail_after:
            raise ray_exceptions.ActorDiedError()
        self.sent += 1
        return await self.items.__anext__()

    def cancel(self) -> None:
        self.cancelled = True


class _Handle:
    """A stand-in DeploymentHandle: `forward` goes to the first replica; `broadcast` to all.
    `dead` replicas fail broadcasts; `fail_after` makes forwarded streams die after N items."""

    def __init__(self, apps: dict[str, Starlette], dead: tuple[str, ...] = (), fail_after: int | None = None):
        self.apps = apps
        self.dead = dead
        self.fail_after = fail_after
        self.streams: list[_Stream] = []
        self.requests: list[ForwardedRequest] = []

    def options(self, stream: bool) -> "_Handle":
        return self

    @property
    def forward(self) -> "_Handle":
        return self

    def remote(self, request: ForwardedRequest) -> _Stream:
        name, app = next(iter(self.apps.items()))
        self.requests.append(request)
        stream = _Stream(serve_forwarded(app, request, name), self.fail_after)
        self.streams.append(stream)
        return stream

    def broadcast(self, method: str, request: ForwardedRequest) -> "_Broadcast":
        assert method == "call"
        return _Broadcast(self, request)


class _Broadcast:
    def __init__(self, handle: _Handle, request: ForwardedRequest):
        self.handle, self.request = handle, request

    async def results_async(self, timeout_s: float, return_exceptions: bool) -> list:
        assert return_exceptions
        results: list = []
        for name, app in self.handle.apps.items():
            if name in self.handle.dead:
                results.append(ray_exceptions.ActorDiedError())
            else:
                results.append(await collect(serve_forwarded(app, self.request, name)))
        return results


def _call(handle: _Handle, method: str, path: str, api_keys: tuple[str, ...] = (), **kwargs) -> httpx.Response:
    ingress = ClusterIngress(handle, IngressOptions("test-app", replicas=2, api_keys=api_keys))

    async def asgi(scope, receive, send):
        response = await ingress(Request(scope, receive))
        await response(scope, receive, send)

    async def go() -> httpx.Response:
        transport = httpx.ASGITransport(app=asgi)
        async with httpx.AsyncClient(transport=transport, base_url="http://cluster") as client:
            return await client.request(method, path, **kwargs)

    return asyncio.run(go())


def test_a_request_is_answered_by_one_replica_and_names_it():
    handle = _Handle({"a": _replica_app("a"), "b": _replica_app("b")})
    answer = _call(handle, "POST", "/v1/completions", json={"prompt": "hi"})
    assert answer.status_code == 200 and answer.json() == {"replica": "a", "prompt": "hi"}
    assert answer.headers[REPLICA_HEADER] == "a"
    assert int(answer.headers["content-length"]) == len(answer.content)


def test_a_stream_is_relayed_chunk_by_chunk():
    answer = _call(_Handle({"a": _replica_app("a")}), "POST", "/v1/completions", json={"prompt": "hi", "stream": True})
    assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/event-stream")
    events = [line[6:] for line in answer.text.splitlines() if line.startswith("data: ")]
    assert [json.loads(e)["i"] for e in events[:-1]] == [0, 1, 2] and events[-1] == "[DONE]"


def test_a_replica_dying_before_answering_is_a_503_replica_failed():
    handle = _Handle({"a": _replica_app("a")}, fail_after=0)
    answer = _call(handle, "POST", "/v1/completions", json={"prompt": "hi"})
    assert answer.status_code == 503 and answer.headers["retry-after"] == "1"
    assert answer.json()["error"]["code"] == "replica_failed"
    assert handle.streams[0].cancelled


def test_a_replica_dying_mid_stream_ends_the_stream_with_an_error_event():
    handle = _Handle({"a": _replica_app("a")}, fail_after=3)  # the head and two events, then death
    answer = _call(handle, "POST", "/v1/completions", json={"prompt": "hi", "stream": True})
    events = [line[6:] for line in answer.text.splitlines() if line.startswith("data: ")]
    assert [json.loads(e)["i"] for e in events[:2]] == [0, 1]
    assert json.loads(events[2])["error"]["code"] == "replica_failed" and events[3] == "[DONE]"
    assert len(events) == 4 and handle.streams[0].cancelled


def test_metrics_merge_every_replica_and_keep_the_replicas_auth():
    handle = _Handle({"a": _replica_app("a"), "bb": _replica_app("bb")})
    text = _call(handle, "GET", "/metrics", headers={"authorization": "Bearer k"}).text
    assert 'radixserve_cached_prompt_tokens_total{replica="a"} 1.0' in text
    assert 'radixserve_cached_prompt_tokens_total{replica="bb"} 2.0' in text
    assert 'radixserve_cluster_replicas{state="reachable"} 2.0' in text
    assert _call(handle, "GET", "/metrics").status_code == 401


def test_health_reports_each_replica():
    apps = {"a": _replica_app("a"), "b": _replica_app("b", healthy=False)}
    body = _call(_Handle(apps), "GET", "/health").json()
    assert body["status"] == "degraded" and body["replicas_healthy"] == 1 and body["replicas_expected"] == 2
    assert {r["replica"]: r["status"] for r in body["replicas"]} == {"a": "ok", "b": "unhealthy"}
    assert body["replicas"][1]["reason"] == "engine broke"
    dead = _call(_Handle({"a": _replica_app("a")}, dead=("a",)), "GET", "/health")
    assert dead.status_code == 503 and dead.json()["status"] == "unhealthy"
    assert dead.json()["replicas"][0]["status"] == "unreachable"
    ok = _call(_Handle({"a": _replica_app("a"), "b": _replica_app("b")}), "GET", "/health").json()
    assert ok["status"] == "ok"


def test_cluster_wide_endpoints_add_up_the_replicas_answers():
    handle = _Handle({"a": _replica_app("a"), "b": _replica_app("b")})
    aborted = _call(handle, "POST", "/abort_request", json={"rid": "r1"}).json()
    assert aborted["aborted"] == 1 and set(aborted["replicas"]) == {"a", "b"}
    assert _call(handle, "GET", "/flush_cache").json()["freed_blocks"] == 6
    assert _call(handle, "POST", "/flush_cache").json()["freed_blocks"] == 6
    with_dead = _Handle({"a": _replica_app("a"), "b": _replica_app("b")}, dead=("b",))
    assert _call(with_dead, "POST", "/flush_cache").json()["error"]["code"] == "replica_failed"


def test_broadcasts_reach_every_replica_under_the_callers_key():
    """Tenancy holds in the cluster because each replica applies it: the ingress hands
    /abort_request, /flush_cache and session closes to every replica with the caller's
    own Authorization header, never another's or none."""
    seen: list[tuple[str, str | None]] = []

    def recording(name: str) -> Starlette:
        async def record(request: Request):
            seen.append((request.url.path, request.headers.get("authorization")))
            return JSONResponse({"aborted": 0, "freed_blocks": 1, "flushed": "own"})

        return Starlette(routes=[Route(p, record, methods=["GET", "POST"]) for p in (
            "/abort_request", "/flush_cache", "/v1/sessions/{sid}/close")])

    handle = _Handle({"a": recording("a"), "b": recording("b")})
    for method, path, body in (("POST", "/abort_request", {"rid": "r"}), ("POST", "/flush_cache", None),
                               ("POST", "/v1/sessions/s1/close", None)):
        _call(handle, method, path, json=body, headers={"authorization": "Bearer key-b"})
    assert seen == [(p, "Bearer key-b") for p in ("/abort_request",) * 2 + ("/flush_cache",) * 2
                    + ("/v1/sessions/s1/close",) * 2]


def test_closing_a_session_closes_it_wherever_it_is_open():
    nowhere = _Handle({"a": _replica_app("a"), "b": _replica_app("b")})
    assert _call(nowhere, "POST", "/v1/sessions/s1/close").status_code == 404
    on_b = _Handle({"a": _replica_app("a"), "b": _replica_app("b", session_open=True)})
    answer = _call(on_b, "POST", "/v1/sessions/s1/close")
    assert answer.status_code == 200 and answer.json() == {"closed": "s1"} and answer.headers[REPLICA_HEADER] == "b"


class _RecordingRouter:
    def __init__(self):
        self.bound: list[tuple[str, str]] = []

    def bind_session(self, session: str, replica: str) -> None:
        self.bound.append((session, replica))


def test_a_stored_response_id_is_bound_to_the_replica_that_stored_it():
    router = _RecordingRouter()
    registry.register("test-app", router)
    answer = _call(_Handle({"a": _replica_app("a")}), "POST", "/v1/responses", json={"model": "m", "input": "x"})
    assert answer.status_code == 200 and router.bound == [("response:resp_a1", "a")]


def test_a_body_over_the_cap_is_refused_before_any_replica_sees_it():
    handle = _Handle({"a": _replica_app("a")})
    answer = _call(handle, "POST", "/v1/completions", content=b"x", headers={"content-length": str(64 << 20)})
    assert answer.status_code == 413 and answer.json()["error"]["code"] == "body_too_large"
    assert handle.streams == []


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "hi", "session_id": "s-A"}),
    ("/v1/responses", {"model": "m", "input": "x"}),
    ("/metrics", None), ("/flush_cache", {}), ("/abort_request", {"rid": "r"}), ("/v1/sessions/s-A/close", {}),
])
@pytest.mark.parametrize("headers", [{}, {"authorization": "Bearer wrong"}, {"x-api-key": "wrong"}])
def test_with_keys_a_call_without_an_accepted_key_reaches_no_replica(path, body, headers):
    router = _RecordingRouter()
    registry.register("test-app", router)
    handle = _Handle({"a": _replica_app("a")})
    method = "GET" if body is None else "POST"
    answer = _call(handle, method, path, api_keys=("key-a", "key-b"), json=body, headers=headers)
    assert answer.status_code == 401 and answer.json()["error"]["code"] == "invalid_api_key"
    assert REPLICA_HEADER not in answer.headers and answer.headers["www-authenticate"] == "Bearer"
    assert handle.streams == [] and router.bound == []


def test_a_refused_anthropic_call_is_answered_in_anthropics_shape():
    answer = _call(_Handle({"a": _replica_app("a")}), "POST", "/v1/messages", api_keys=("key-a",),
                   json={"model": "m", "max_tokens": 4, "messages": []}, headers={"x-api-key": "wrong"})
    assert answer.status_code == 401
    assert answer.json() == {"type": "error", "error": {"type": "authentication_error", "message": "invalid API key"}}


def test_sessions_and_stored_responses_are_routed_per_key():
    from radixserve.server.middleware import key_digest

    router = _RecordingRouter()
    registry.register("test-app", router)
    handle = _Handle({"a": _replica_app("a")})
    keys = ("key-a", "key-b")
    for headers in ({"authorization": "Bearer key-a"}, {"x-api-key": "key-b"}):
        for path, body in (("/v1/completions", {"model": "m", "prompt": "same", "session_id": "s1"}),
                           ("/v1/responses", {"model": "m", "input": "x", "previous_response_id": "resp_z"})):
            assert _call(handle, "POST", path, api_keys=keys, json=body, headers=headers).status_code == 200
    a, b = key_digest("key-a"), key_digest("key-b")
    assert [r.tenant for r in handle.requests] == [a, a, b, b]
    assert [r.routing.session_id for r in handle.requests] == [
        f"{a}:s1", f"{a}:response:resp_z", f"{b}:s1", f"{b}:response:resp_z"]
    assert router.bound == [(f"{a}:response:resp_a1", "a"), (f"{b}:response:resp_a1", "a")]
    assert len({r.routing.key for r in handle.requests if r.path == "/v1/completions"}) == 2  # prefixes per key


def test_disaggregated_broadcasts_reach_both_roles_and_forwarding_only_decode():
    decode, prefill = _Handle({"d": _replica_app("d")}), _Handle({"p": _replica_app("p")})
    ingress = ClusterIngress(decode, IngressOptions("test-app", replicas=2), prefill)

    async def asgi(scope, receive, send):
        response = await ingress(Request(scope, receive))
        await response(scope, receive, send)

    async def go(method: str, path: str, **kwargs) -> httpx.Response:
        transport = httpx.ASGITransport(app=asgi)
        async with httpx.AsyncClient(transport=transport, base_url="http://cluster") as client:
            return await client.request(method, path, **kwargs)

    health = asyncio.run(go("GET", "/health")).json()
    assert health["status"] == "ok" and health["replicas_expected"] == 2
    assert {r["replica"] for r in health["replicas"]} == {"d", "p"}
    assert asyncio.run(go("POST", "/v1/completions", json={"prompt": "hi"})).json()["replica"] == "d"
    assert set(asyncio.run(go("POST", "/abort_request", json={"rid": "x"})).json()["replicas"]) == {"d", "p"}
    metrics = asyncio.run(go("GET", "/metrics", headers={"authorization": "Bearer k"})).text
    assert 'replica="p"' in metrics and 'replica="d"' in metrics


def test_the_ingress_and_the_app_import_no_torch():
    """The ingress (no CPU reserved) and the driver that builds the app read the request models,
    the metrics and the routers without the engine: importing torch would cost each ingress
    start ~2.5 s of CPU and a few hundred MiB beside the replicas (the loader, under KV-event
    routing, imports it when it reads the tokenizer)."""
    import subprocess
    import sys

    code = ("import sys, radixserve.cluster.ingress, radixserve.cluster.app, radixserve.cluster.routers; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"

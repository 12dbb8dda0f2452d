"""The cluster's router on KV events (no Ray): a subscriber (pyzmq SUB + msgspec, the replica's
published format) rebuilds a replica's cached blocks from the stream alone, equal to the
replica's own view, through eviction, tier traffic, a flush and a restart; the replay socket
fills a gap and a late join; routing follows what replicas really hold after an eviction."""

from __future__ import annotations

import json
import socket
import time
from typing import Any

import pytest

from radixserve import Engine, SamplingParams
from radixserve.cluster.affinity import AffinityPolicy
from radixserve.cluster.kv_index import KVBlockIndex, wire_hashes
from radixserve.cluster.kv_subscriber import KVEventSubscriber

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
BS = 16


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _engine(path: str, pub: str, replay: str, **options) -> Engine:
    return Engine(path, kv_events_endpoint=pub, kv_events_replay_endpoint=replay, **options)


def engine_view(engine: Engine) -> dict[str, set]:
    """The replica's own view: its radix cache's block names, pool and tier apart."""
    view: dict[str, set] = {"GPU": set(), "CPU": set()}  # the pool, the tier (in memory)
    for node in engine.cache.nodes():
        names = [d.to_bytes(16, "big") for d in node.digests]
        if node.blocks:
            view["GPU"].update(names)
        if node.slots:
            view["CPU"].update(names)
    return {m: held for m, held in view.items() if held}


def known(index: KVBlockIndex, replica: str) -> dict[str, set]:
    return {m: set(held) for m, held in index.replicas[replica].media.items() if held}


def settle(engine: Engine, sub: KVEventSubscriber, timeout_s: float = 30.0) -> None:
    """Poll until the subscriber has applied everything the replica published."""
    engine.kv_events.flush()
    deadline = time.monotonic() + timeout_s
    while sub.index.position(sub.replica) != engine.kv_events.sequence + 1:
        assert time.monotonic() < deadline, "the subscriber did not catch up"
        sub.poll(100)
    sub.poll(0)


def _prompts(seed: int, count: int) -> list[list[int]]:
    shared = [5 + i % 80 for i in range(40)]
    return [shared + [(seed * 31 + i * 7 + j) % 90 + 3 for j in range(24 + 8 * i)] for i in range(count)]


def test_a_subscriber_rebuilds_a_replicas_blocks_through_eviction_tier_flush_restart_and_gaps(tiny_model_dir):
    path = str(tiny_model_dir("llama"))
    pub, replay = f"tcp://127.0.0.1:{_port()}", f"tcp://127.0.0.1:{_port()}"
    options = dict(num_kv_blocks=24, kv_offload_memory=1 << 20)
    engine = _engine(path, pub, replay, **options)
    index = KVBlockIndex(BS)
    sub = KVEventSubscriber(index, "r0", pub, replay)
    try:
        for round_ in range(4):  # more than the pool holds: blocks move to the tier and back
            if round_ == 2:
                sub.drop_next = 1  # a batch lost on the way: the next one finds the gap
            engine.generate(_prompts(round_, 4), GREEDY)
            settle(engine, sub)
            assert known(index, "r0") == engine_view(engine), f"round {round_}"
        assert engine.cache.evicted_blocks and engine.cache.num_tier_blocks, "the workload moved blocks to the tier"
        assert sub.replays >= 1, "the gap was filled from the replay socket"
        engine.flush_cache()
        settle(engine, sub)
        assert known(index, "r0") == engine_view(engine) == {}
        engine.generate(_prompts(7, 2), GREEDY)
        settle(engine, sub)
        before = index.replicas["r0"].restarts
        engine.close()  # the replica restarts on the same endpoints: a new stream from 0
        engine = _engine(path, pub, replay, **options)
        engine.generate(_prompts(8, 3), GREEDY)
        settle(engine, sub)
        assert index.replicas["r0"].restarts == before + 1
        assert known(index, "r0") == engine_view(engine) != {}
        engine.check_integrity()
    finally:
        sub.close()
        engine.close()


def test_a_late_subscriber_catches_up_from_the_replay_buffer(tiny_model_dir):
    engine = Engine(str(tiny_model_dir("llama")), num_kv_blocks=24, kv_events_endpoint="tcp://127.0.0.1:*",
                    kv_events_replay_endpoint="tcp://127.0.0.1:*")
    try:
        engine.generate(_prompts(1, 3), GREEDY)
        engine.kv_events.flush()
        index = KVBlockIndex(BS)
        sub = KVEventSubscriber(index, "late", engine.kv_events.endpoint, engine.kv_events.replay_endpoint)
        assert not index.tracks("late")
        assert sub.catch_up() == engine.kv_events.sequence + 1
        assert index.tracks("late") and known(index, "late") == engine_view(engine)
        sub.close()
    finally:
        engine.close()


def test_routing_follows_the_events_after_an_eviction(tiny_model_dir):
    """Two replicas: a prompt's blocks on A route it to A; once A evicts them and B computes
    them, to B; the shadow tree (which saw only the first routing) would still say A."""
    path = str(tiny_model_dir("llama"))
    engines = {name: Engine(path, num_kv_blocks=16, kv_events_endpoint="tcp://127.0.0.1:*",
                            kv_events_replay_endpoint="tcp://127.0.0.1:*") for name in ("a", "b")}
    index = KVBlockIndex(BS)
    subs = {n: KVEventSubscriber(index, n, e.kv_events.endpoint, e.kv_events.replay_endpoint)
            for n, e in engines.items()}
    policy = AffinityPolicy(kv_index=index)
    policy.set_replicas(["a", "b"])
    prompt = [(7 * i) % 90 + 3 for i in range(96)]  # 6 blocks
    blocks = wire_hashes(prompt + [1, 2, 3], BS)

    def sync():
        for n, e in engines.items():
            e.kv_events.flush()
            subs[n].catch_up()
            subs[n].poll(100)

    try:
        sync()
        first = policy.choose(["a", "b"], tuple(prompt), None, 0.0, blocks)
        assert first.reason == "new" and first.ranking[0] == "a"  # nothing cached anywhere; a ties first
        engines["a"].generate([prompt], GREEDY)
        sync()
        hit = policy.choose(["a", "b"], tuple(prompt), None, 1.0, blocks)
        assert (hit.ranking, hit.reason, hit.match_length) == (["a", "b"], "kv_prefix", 6)
        for i in range(3):  # other traffic on A evicts the prompt there
            engines["a"].generate([[(11 * i + j) % 90 + 3 for j in range(100)]], GREEDY)
        engines["b"].generate([prompt], GREEDY)
        sync()
        assert index.match("a", blocks) == 0 and index.match("b", blocks) == 6
        moved = policy.choose(["a", "b"], tuple(prompt), None, 2.0, blocks)
        assert (moved.ranking, moved.reason, moved.match_length) == (["b", "a"], "kv_prefix", 6)
        assert policy.trees["a"].match_length(tuple(prompt)) == 96  # what the shadow tree still believes
        engines["b"].flush_cache()
        sync()
        after = policy.choose(["a", "b"], tuple(prompt), None, 3.0, blocks)
        assert after.reason == "new" and after.match_length == 0
    finally:
        for sub in subs.values():
            sub.close()
        for engine in engines.values():
            engine.close()


def test_without_events_the_shadow_tree_routes():
    policy = AffinityPolicy(kv_index=KVBlockIndex(BS))
    policy.set_replicas(["a", "b"])
    policy.record("b", "system prompt and more", None, 0.0)
    choice = policy.choose(["a", "b"], "system prompt and more!", None, 1.0, blocks=[b"x" * 16])
    assert (choice.ranking[0], choice.reason) == ("b", "prefix")  # no replica tracked: the tree


@pytest.mark.parametrize("scheme", ["chained", "chained64"])
def test_wire_hashes_name_blocks_as_the_replica_does(tiny_model_dir, scheme):
    engine = Engine(str(tiny_model_dir("llama")), num_kv_blocks=24, kv_events_endpoint="tcp://127.0.0.1:*",
                    kv_events_hash=scheme)
    try:
        prompt = _prompts(3, 1)[0]
        engine.generate([prompt], GREEDY)
        names = {d for node in engine.cache.nodes() for d in node.digests}
        want = {d & (2**64 - 1) for d in names} if scheme == "chained64" else {d.to_bytes(16, "big") for d in names}
        assert set(wire_hashes(prompt, BS, scheme=scheme)) <= want
    finally:
        engine.close()


TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
SYSTEM = "You are a routing assistant. Answer in one short sentence, and call a tool when it helps. " * 3
TEXT = "The radix tree keeps every shared prefix once, and the router sends each prompt to its prefix. " * 3


def _route_requests(model: str) -> list[tuple[str, dict, Any]]:
    """(path, body, the prompt's token count from the answer) for every route the cluster routes
    by prompt: chat with and without tools (a call and its result in the history), Anthropic's
    messages with tools, a Responses conversation with instructions and tools, a completion in a
    cache_salt, /generate as text and as ids, and a pin of the completion's text."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    chat_tools = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Weather in Paris?"},
                  {"role": "assistant", "content": None, "tool_calls": [call]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}]
    anthropic_tools = [{"name": "get_weather", "description": "Current weather in a city",
                        "input_schema": TOOLS[0]["function"]["parameters"]}]
    usage = lambda a: a["usage"]["prompt_tokens"]  # noqa: E731
    return [
        ("/v1/chat/completions", {"model": model, "max_tokens": 2, "messages": [
            {"role": "system", "content": SYSTEM}, {"role": "user", "content": "Where does this go?"}]}, usage),
        ("/v1/chat/completions", {"model": model, "max_tokens": 2, "tools": TOOLS, "messages": chat_tools}, usage),
        ("/v1/messages", {"model": model, "max_tokens": 2, "system": SYSTEM, "tools": anthropic_tools, "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                               "input": {"city": "Paris"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "18 C"}]}]},
         lambda a: sum(a["usage"][k] for k in ("input_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"))),
        ("/v1/responses", {"model": model, "max_output_tokens": 2, "instructions": SYSTEM, "tools": [
            {"type": "function", **TOOLS[0]["function"]}], "input": [
            {"type": "message", "role": "user", "content": "Weather in Paris?"},
            {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
            {"type": "function_call_output", "call_id": "call_1", "output": "18 C"}]},
         lambda a: a["usage"]["input_tokens"]),
        ("/v1/completions", {"model": model, "max_tokens": 2, "prompt": TEXT, "cache_salt": "team-a"}, usage),
        ("/generate", {"text": TEXT + "Again.", "sampling_params": {"max_new_tokens": 2}},
         lambda a: a["meta_info"]["prompt_tokens"]),
        ("/generate", {"input_ids": list(range(200, 250)), "sampling_params": {"max_new_tokens": 2}},
         lambda a: a["meta_info"]["prompt_tokens"]),
        ("/v1/sessions/pin", {"text": TEXT, "ttl_s": 60, "cache_salt": "team-a"}, None),  # the completion's prompt
    ]


@pytest.mark.real_model
@pytest.mark.parametrize("template", [None, "hermes"])
def test_every_routed_route_is_named_as_the_replica_publishes_its_blocks(real_model_dir, template):
    """A replica (the server's own app, an API key, KV events on) serves one request of every
    route the cluster routes by prompt; the ingress's names for each body (RequestBlocks: the
    server's rendering without an engine) are exactly the whole blocks of the prompt the replica
    computed (as many as its prompt tokens make) and every one of them is in the replica's
    published stream, in order; the router then sends the request to that replica on events
    (kv_prefix). Under the model's own template (tools rendered as text) and a template that
    takes tools (hermes: `tools=`)."""
    import asyncio
    from pathlib import Path

    import httpx
    from radixserve.cluster.request_blocks import RequestBlocks
    from radixserve.cluster.routing_key import ROUTED_PATHS, routing_key
    from radixserve.server import ServerOptions, create_app
    from radixserve.server.middleware import key_digest
    from radixserve.model.tokenizer import load_tokenizer
    from radixserve.server.testing import BackgroundServer

    chat_template = None
    if template is not None:
        chat_template = (Path(__file__).parents[1] / "templates" / f"{template}.jinja").read_text()
    options = ServerOptions(api_keys=("key-a",), chat_template=chat_template)
    engine = Engine(str(real_model_dir), num_kv_blocks=512, kv_events_endpoint="tcp://127.0.0.1:*",
                    kv_events_replay_endpoint="tcp://127.0.0.1:*")
    namer = RequestBlocks(load_tokenizer(real_model_dir), BS, server=options)  # as the ingress loads it
    tenant = key_digest("key-a")
    index = KVBlockIndex(BS)
    index.apply("idle", 0, [])  # a second replica, tracked, holding nothing
    sub = KVEventSubscriber(index, "r", engine.kv_events.endpoint, engine.kv_events.replay_endpoint)
    policy = AffinityPolicy(kv_index=index)
    policy.set_replicas(["idle", "r"])
    requests = _route_requests(engine.model_name)
    assert {path for path, _, _ in requests} == set(ROUTED_PATHS)  # a new routed route must be named here too
    headers = {"Authorization": "Bearer key-a"}
    try:
        with BackgroundServer(create_app(engine, options)) as server:
            named = {}
            for path, body, prompt_tokens in requests:
                answer = httpx.post(server.url + path, json=body, headers=headers, timeout=300)
                assert answer.status_code == 200, (path, answer.text)
                names = asyncio.run(namer.names(path, body, tenant))
                assert names, path
                if prompt_tokens is not None:
                    assert len(names) == prompt_tokens(answer.json()) // BS, path
                deadline = time.monotonic() + 30
                while index.match("r", names) < len(names):
                    assert time.monotonic() < deadline, f"{path}: the replica did not publish the blocks named"
                    sub.catch_up() if not index.tracks("r") else sub.poll(100)
                key = routing_key(path, body, tenant)
                choice = policy.choose(["idle", "r"], key.key, key.session_id, time.monotonic(), list(names))
                assert (choice.ranking[0], choice.reason, choice.match_length) == ("r", "kv_prefix", len(names)), path
                named[path, json.dumps(body, sort_keys=True)] = names
            assert named["/v1/sessions/pin", json.dumps(requests[-1][1], sort_keys=True)] == named[
                "/v1/completions", json.dumps(requests[4][1], sort_keys=True)]
            later = {"model": engine.model_name, "input": "And tomorrow?", "previous_response_id": "resp_x"}
            assert asyncio.run(namer.names("/v1/responses", later, tenant)) is None  # only its replica has the turns
            assert asyncio.run(namer.names("/v1/chat/completions", {"messages": []}, tenant)) is None  # refused
    finally:
        sub.close()
        engine.close()


def test_the_feed_subscribes_to_the_live_replicas_and_forgets_gone_ones(tiny_model_dir):
    from radixserve.cluster.kv_feed import KVEventFeed, replica_engine_kwargs

    path = str(tiny_model_dir("llama"))
    kwargs = replica_engine_kwargs({"num_kv_blocks": 16, "kv_events_endpoint": "tcp://x:1"}, "127.0.0.1")
    assert kwargs["kv_events_endpoint"] == kwargs["kv_events_replay_endpoint"] == "tcp://127.0.0.1:*"
    engines = {n: Engine(path, **kwargs) for n in ("a", "b")}
    index = KVBlockIndex(BS)
    feed = KVEventFeed(index)
    try:
        for e in engines.values():
            e.generate(_prompts(2, 1), GREEDY)
            e.kv_events.flush()
        feed.sync({n: (e.kv_events.endpoint, e.kv_events.replay_endpoint) for n, e in engines.items()})
        deadline = time.monotonic() + 30
        while not all(index.tracks(n) and known(index, n) == engine_view(e) for n, e in engines.items()):
            assert time.monotonic() < deadline, "the feed did not catch up"
            time.sleep(0.05)
        feed.sync({"a": (engines["a"].kv_events.endpoint, engines["a"].kv_events.replay_endpoint)})
        assert feed.replicas == ["a"] and not index.tracks("b")
    finally:
        feed.close()
        for e in engines.values():
            e.close()


def test_the_ingress_subscribes_to_the_replicas_and_names_each_request(tiny_model_dir):
    """A stand-in deployment handle: the ingress asks the replicas for their event endpoints,
    its feed tracks both, and a forwarded request carries its block names to the router."""
    import asyncio

    import httpx
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    from radixserve.cluster import registry
    from radixserve.cluster.forwarding import serve_forwarded
    from radixserve.cluster.ingress import ClusterIngress, IngressOptions, KVEventRouting

    path = str(tiny_model_dir("llama"))
    engines = {n: Engine(path, num_kv_blocks=16, kv_events_endpoint="tcp://127.0.0.1:*",
                         kv_events_replay_endpoint="tcp://127.0.0.1:*") for n in ("a", "b")}

    async def generate(request: Request):
        return JSONResponse({"ok": True})

    app = Starlette(routes=[Route("/generate", generate, methods=["POST"])])

    class Handle:
        requests: list = []

        def options(self, **kwargs):
            return self

        @property
        def forward(self):
            return self

        def remote(self, request):
            self.requests.append(request)
            return _Stream(serve_forwarded(app, request, "a"))

        def broadcast(self, method):
            assert method == "kv_events"

            class Answers:
                async def results_async(self, timeout_s, return_exceptions):
                    return [(n, e.kv_events.endpoint, e.kv_events.replay_endpoint) for n, e in engines.items()]

            return Answers()

    handle = Handle()
    ingress = ClusterIngress(handle, IngressOptions("kv-app", 2, kv_events=KVEventRouting(BS, model=path)))
    prompt = [(3 * i) % 90 + 3 for i in range(40)]

    async def asgi(scope, receive, send):
        response = await ingress(Request(scope, receive))
        await response(scope, receive, send)

    async def post() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=asgi), base_url="http://cluster") as client:
            return await client.post("/generate", json={"input_ids": prompt})

    try:
        assert asyncio.run(post()).status_code == 200
        assert registry.kv_index_for("kv-app") is ingress.kv_index
        assert handle.requests[0].routing.blocks == tuple(wire_hashes(prompt, BS))
        deadline = time.monotonic() + 30
        while not all(ingress.kv_index.tracks(n) for n in engines):
            assert time.monotonic() < deadline, "the ingress did not subscribe"
            time.sleep(0.05)
        engines["b"].generate([prompt], GREEDY)
        while ingress.kv_index.match("b", wire_hashes(prompt, BS)) != 2:
            assert time.monotonic() < deadline, "the ingress did not see b's blocks"
            time.sleep(0.05)
    finally:
        ingress.kv_feed.close()
        for e in engines.values():
            e.close()


def test_a_hinted_body_is_keyed_as_the_same_body_without_hints():
    from radixserve.cluster.routing_key import routing_key

    body = {"model": "m", "prompt": "the same prompt", "session_id": "s1"}
    hinted = {**body, "agent_hints": {"priority": 3}, "nvext": {"agent_hints": {"osl": 8}}}
    assert routing_key("/v1/completions", hinted) == routing_key("/v1/completions", body) is not None


def test_the_prefill_picker_routes_on_the_prefill_replicas_events(tiny_model_dir):
    """Disaggregated: the ingress's prefill choice follows what each prefill replica's stream
    says it holds: a prompt computed on p2 goes to p2, though the picker's own tree puts it on
    p1 (where it routed it unnamed); once p2 flushed, nothing matches anywhere (the tree would
    still say p1)."""
    from radixserve.cluster.affinity import AffinityConfig
    from radixserve.cluster.prefill_picker import PrefillPicker
    from radixserve.cluster.routing_key import RoutingKey

    path = str(tiny_model_dir("llama"))
    engines = {n: Engine(path, num_kv_blocks=16, kv_events_endpoint="tcp://127.0.0.1:*",
                         kv_events_replay_endpoint="tcp://127.0.0.1:*") for n in ("p1", "p2")}
    index = KVBlockIndex(BS)
    subs = {n: KVEventSubscriber(index, n, e.kv_events.endpoint, e.kv_events.replay_endpoint)
            for n, e in engines.items()}
    picker = PrefillPicker(AffinityConfig(), index)
    picker.set_replicas(["p1", "p2"])
    prompt = [(5 * i) % 90 + 3 for i in range(80)]  # 5 blocks
    key = RoutingKey(tuple(prompt), blocks=tuple(wire_hashes(prompt, BS)))

    def sync():
        for n, e in engines.items():
            e.kv_events.flush()
            subs[n].catch_up()
            subs[n].poll(100)

    try:
        engines["p2"].generate([prompt], GREEDY)
        sync()
        assert picker.pick(RoutingKey(tuple(prompt))) == "p1"  # unnamed: the trees, empty yet
        picker.done("p1")
        assert picker.policy.trees["p1"].match_length(tuple(prompt)) == len(prompt)
        assert picker.pick(key) == "p2"
        picker.done("p2")
        assert picker.reasons == {"new": 1, "kv_prefix": 1}
        engines["p2"].flush_cache()
        sync()
        picker.pick(key)
        assert picker.reasons == {"new": 2, "kv_prefix": 1}
    finally:
        for sub in subs.values():
            sub.close()
        for engine in engines.values():
            engine.close()


class _EngineHandle:
    """A stand-in deployment handle over engines: `broadcast("kv_events")` reports each one's
    endpoints (as RadixReplica.kv_events does); `forward` answers through a stub app."""

    def __init__(self, engines: dict[str, Engine]):
        self.engines = engines
        self.requests: list = []

    def options(self, **kwargs):
        return self

    @property
    def forward(self):
        return self

    def remote(self, request):
        from radixserve.cluster.forwarding import serve_forwarded

        self.requests.append(request)
        return _Stream(serve_forwarded(_stub_app(), request, next(iter(self.engines))))

    def broadcast(self, method):
        assert method == "kv_events"
        engines = self.engines

        class Answers:
            async def results_async(self, timeout_s, return_exceptions):
                return [(n, e.kv_events.endpoint, e.kv_events.replay_endpoint) for n, e in engines.items()]

        return Answers()


class _Stream:
    def __init__(self, items):
        self.items = items

    def __aiter__(self):
        return self

    async def __anext__(self):
        return await self.items.__anext__()

    def cancel(self):
        pass


def _stub_app():
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def answer(request):
        return JSONResponse({"ok": True})

    return Starlette(routes=[Route(p, answer, methods=["POST"]) for p in ("/generate", "/v1/completions")])


def _post(ingress, path: str, body: dict):
    import asyncio

    import httpx
    from starlette.requests import Request

    async def asgi(scope, receive, send):
        response = await ingress(Request(scope, receive))
        await response(scope, receive, send)

    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=asgi), base_url="http://cluster") as client:
            return await client.post(path, json=body)

    return asyncio.run(go())


def test_a_disaggregated_ingress_follows_both_roles_events_and_picks_prefill_on_them(tiny_model_dir):
    """Prefill and decode replicas: the ingress subscribes to both deployments' streams, and its
    prefill picker routes a request to the prefill replica that holds its prompt (kv_prefix)."""
    from radixserve.cluster.affinity import AffinityConfig
    from radixserve.cluster.ingress import ClusterIngress, IngressOptions, KVEventRouting

    path = str(tiny_model_dir("llama"))
    kwargs = dict(num_kv_blocks=16, kv_events_endpoint="tcp://127.0.0.1:*", kv_events_replay_endpoint="tcp://127.0.0.1:*")
    engines = {n: Engine(path, **kwargs) for n in ("d", "p1", "p2")}
    decode, prefill = _EngineHandle({"d": engines["d"]}), _EngineHandle({n: engines[n] for n in ("p1", "p2")})
    options = IngressOptions("kv-pd-app", 3, prefill_affinity=AffinityConfig(), kv_events=KVEventRouting(BS, model=path))
    ingress = ClusterIngress(decode, options, prefill)
    ingress.prefill_picker.set_replicas(["p1", "p2"])  # what the prefill router in the ingress tells it
    prompt = [(3 * i) % 90 + 3 for i in range(48)]
    try:
        assert ingress.prefill_picker.policy.kv_index is ingress.kv_index
        engines["p2"].generate([prompt], GREEDY)
        engines["p2"].kv_events.flush()
        assert _post(ingress, "/generate", {"input_ids": prompt}).status_code == 200  # subscribes to all three
        deadline = time.monotonic() + 30
        while not all(ingress.kv_index.tracks(n) for n in engines) or ingress.kv_index.match("p2", wire_hashes(prompt, BS)) != 3:
            assert time.monotonic() < deadline, "the ingress did not follow both roles' streams"
            time.sleep(0.05)
        before = dict(ingress.prefill_picker.reasons)
        assert _post(ingress, "/generate", {"input_ids": prompt + [5]}).status_code == 200
        forwarded = decode.requests[-1]
        assert forwarded.routing.blocks == tuple(wire_hashes(prompt + [5], BS))
        assert forwarded.prefill_replica == "p2"
        assert ingress.prefill_picker.reasons.get("kv_prefix", 0) == before.get("kv_prefix", 0) + 1
    finally:
        ingress.kv_feed.close()
        for e in engines.values():
            e.close()


def test_every_path_the_cluster_routes_by_prompt_is_named():
    from radixserve.cluster.routing_key import ROUTED_PATHS
    from radixserve.server.prompt_ids import PATHS

    assert set(PATHS) == set(ROUTED_PATHS)

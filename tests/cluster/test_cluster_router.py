"""The cluster's Ray-free parts: the approximate prefix tree, the affinity policy, routing keys,
forwarding into an ASGI app, and merging metrics. Fast; no Ray, no model."""

from __future__ import annotations

import asyncio
import random

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from radixserve.cluster.affinity import AffinityConfig, AffinityPolicy
from radixserve.cluster.forwarding import ForwardedRequest, ResponseHead, collect, serve_forwarded
from radixserve.cluster.metrics_merge import merge_metrics, sample_total
from radixserve.cluster.prefix_tree import ApproxPrefixTree
from radixserve.cluster.routing_key import (
    BROADCAST_PATHS, ROUTED_PATHS, SESSION_CLOSE_PATH, UNKEYED_PATHS, RoutingKey, routing_key,
)
from radixserve.server.app import app_routes
from radixserve.server.options import ServerOptions

# ---- ApproxPrefixTree ------------------------------------------------------------------------


def test_match_lengths_are_exact():
    tree = ApproxPrefixTree()
    tree.insert("system: be brief\nuser: hi", now=1)
    tree.insert("system: be brief\nuser: bye", now=2)
    tree.insert("other", now=3)
    assert tree.match_length("system: be brief\nuser: hi") == 25
    assert tree.match_length("system: be brief\nuser: hello") == 24  # "...user: h", then "e" != "i"
    assert tree.match_length("system: be brief\nuser: b") == 24
    assert tree.match_length("system: be loud") == 11
    assert tree.match_length("oth") == 3
    assert tree.match_length("x") == 0
    assert tree.match_length("") == 0
    assert tree.size == len("system: be brief\nuser: hi") + len("bye") + len("other")
    tree.check()


def test_token_id_keys_and_text_keys_share_a_tree_without_matching_each_other():
    tree = ApproxPrefixTree()
    tree.insert((1, 2, 3, 4), now=1)
    tree.insert("abc", now=1)
    assert tree.match_length((1, 2, 3, 9)) == 3
    assert tree.match_length((1, 2, 3, 4, 5)) == 4
    assert tree.match_length("abd") == 2
    assert tree.match_length((97,)) == 0  # ord('a') is not 'a'
    tree.check()


def test_matches_agree_with_a_brute_force_reference():
    rng = random.Random(7)
    tree = ApproxPrefixTree()
    keys = []
    for i in range(300):
        key = "".join(rng.choice("ab") for _ in range(rng.randint(0, 12)))
        tree.insert(key, now=i)
        keys.append(key)
        tree.check()
    for _ in range(300):
        probe = "".join(rng.choice("ab") for _ in range(rng.randint(0, 14)))
        expected = max(_common(probe, k) for k in keys)
        assert tree.match_length(probe) == expected, probe


def test_size_eviction_trims_least_recently_used_tails_first():
    tree = ApproxPrefixTree(max_size=20)
    tree.insert("aaaaaaaaaa", now=1)  # 10
    tree.insert("bbbbbbbbbb", now=2)  # 10 -> size 20, at the bound
    assert tree.size == 20
    tree.insert("cccc", now=3)  # 4 over: the oldest leaf ("a...") loses its last 4
    assert tree.size == 20
    assert tree.match_length("aaaaaaaaaa") == 6
    assert tree.match_length("bbbbbbbbbb") == 10
    assert tree.match_length("cccc") == 4
    tree.insert("dddddddddd", now=4)  # 10 over: the rest of "a" (6), then 4 of "b"
    assert tree.match_length("aaaaaaaaaa") == 0
    assert tree.match_length("bbbbbbbbbb") == 6
    assert tree.match_length("dddddddddd") == 10
    assert tree.size == 20
    tree.check()


def test_size_eviction_keeps_a_shared_prefix_while_a_branch_uses_it():
    tree = ApproxPrefixTree(max_size=12)
    tree.insert("SYSTEM" + "old", now=1)
    tree.insert("SYSTEM" + "new", now=5)  # shared "SYSTEM" was used at 5
    tree.insert("xyz", now=6)  # 3 over: the old branch goes, the shared prefix stays
    assert tree.match_length("SYSTEMold") == 6
    assert tree.match_length("SYSTEMnew") == 9
    assert tree.size == 12
    tree.check()


def test_age_eviction_drops_paths_unused_for_max_age():
    tree = ApproxPrefixTree(max_age_s=10)
    tree.insert("shared-old", now=0)
    tree.insert("shared-new", now=8)
    tree.insert("zzz", now=1)
    assert tree.evict(now=15) == len("old") + len("zzz")  # used at 0 and 1: older than 15 - 10
    assert tree.match_length("shared-old") == 7
    assert tree.match_length("shared-new") == 10
    assert tree.match_length("zzz") == 0
    assert tree.evict(now=100) == len("shared-new")
    assert tree.size == 0
    tree.check()


def test_tree_refuses_bad_bounds():
    with pytest.raises(ValueError, match="max_size"):
        ApproxPrefixTree(max_size=0)
    with pytest.raises(ValueError, match="max_age_s"):
        ApproxPrefixTree(max_age_s=0)


# ---- AffinityPolicy --------------------------------------------------------------------------

SYS_A = "You are a careful assistant for the billing team. " * 4
SYS_B = "You are a terse code reviewer who answers in bullet points. " * 4


def _policy(**kwargs) -> AffinityPolicy:
    policy = AffinityPolicy(AffinityConfig(**kwargs))
    policy.set_replicas(["r0", "r1"])
    return policy


def test_new_prefixes_spread_and_shared_prefixes_follow_their_replica():
    policy = _policy()
    first = policy.choose(["r0", "r1"], SYS_A + "q1", None, now=1)
    second = policy.choose(["r0", "r1"], SYS_B + "q1", None, now=2)
    assert first.reason == second.reason == "new"
    assert {first.ranking[0], second.ranking[0]} == {"r0", "r1"}  # the second went to the emptier tree
    for i in range(5):
        again = policy.choose(["r0", "r1"], SYS_A + f"question {i}", None, now=3 + i)
        assert again.ranking[0] == first.ranking[0] and again.reason == "prefix"
        assert again.match_length >= len(SYS_A)
    assert policy.choose(["r0", "r1"], SYS_B + "q2", None, now=9).ranking[0] == second.ranking[0]


def test_session_stays_on_its_replica_even_when_another_matches_longer():
    policy = _policy()
    a = policy.choose(["r0", "r1"], SYS_A, None, now=1).ranking[0]
    b = "r1" if a == "r0" else "r0"
    policy.record(b, "unrelated", "s1", now=2)  # session s1 lives on b
    choice = policy.choose(["r0", "r1"], SYS_A + "more", "s1", now=3)
    assert choice.ranking[0] == b and choice.reason == "session"


def test_busy_preferred_replica_yields_to_the_least_loaded_beyond_the_threshold():
    policy = _policy(balance_threshold=2)
    home = policy.choose(["r0", "r1"], SYS_A, None, now=1).ranking[0]
    other = "r1" if home == "r0" else "r0"
    for _ in range(2):
        policy.routed(home, SYS_A, None, home, now=1)
    assert policy.choose(["r0", "r1"], SYS_A + "x", None, now=2).ranking[0] == home  # 2 - 0 <= threshold
    policy.routed(home, SYS_A, None, home, now=2)
    choice = policy.choose(["r0", "r1"], SYS_A + "y", None, now=3)  # 3 - 0 > 2
    assert choice.ranking == [other, home] and choice.reason == "balance"
    for _ in range(3):
        policy.finished(home)
    assert policy.in_flight[home] == 0
    policy.finished(home)  # never below zero
    assert policy.in_flight[home] == 0


def test_routed_elsewhere_records_the_key_where_it_went():
    policy = _policy()
    choice = policy.choose(["r0", "r1"], SYS_A, "s", now=1)
    other = choice.ranking[1]
    policy.routed(other, SYS_A, "s", choice.ranking[0], now=2)  # Ray sent it to the second rank
    assert policy.trees[other].match_length(SYS_A) == len(SYS_A)
    assert policy.sessions["s"] == other
    assert policy.in_flight[other] == 1


def test_dead_replica_is_forgotten_at_once():
    policy = _policy()
    home = policy.choose(["r0", "r1"], SYS_A, "s", now=1).ranking[0]
    policy.remove_replica(home)
    other = "r1" if home == "r0" else "r0"
    choice = policy.choose(["r0", "r1"], SYS_A, "s", now=2)  # the dead one is still a candidate by mistake
    assert choice.ranking == [other]
    assert policy.sessions["s"] == other
    policy.set_replicas([other, "r2"])  # Ray's replacement
    assert set(policy.trees) == {other, "r2"}
    with pytest.raises(ValueError, match="no live replica"):
        policy.choose(["gone"], SYS_A, None, now=3)


def test_sessions_are_bounded_lru():
    policy = _policy(max_sessions=2)
    for i, session in enumerate(["a", "b", "a", "c"]):
        policy.choose(["r0", "r1"], f"k{i}", session, now=i)
    assert list(policy.sessions) == ["a", "c"]


def test_policy_evicts_trees_by_age_while_choosing():
    policy = _policy(max_tree_age_s=5, evict_every=1)
    home = policy.choose(["r0", "r1"], SYS_A, None, now=0).ranking[0]
    assert policy.trees[home].size == len(SYS_A)
    choice = policy.choose(["r0", "r1"], "zzz", None, now=100)  # evicts first, then records "zzz"
    assert policy.trees[home].match_length(SYS_A) == 0 and choice.reason == "new"
    assert policy.trees["r0"].size + policy.trees["r1"].size == 3


def test_agent_workload_routes_every_turn_to_its_system_prompts_replica():
    """8 sessions x 4 turns over 2 system prompts: after the first turn of each prompt, every
    request goes where its system prompt already is, and both replicas get one prompt."""
    policy = _policy()
    homes: dict[str, set[str]] = {SYS_A: set(), SYS_B: set()}
    history = {s: (SYS_A if s % 2 == 0 else SYS_B) for s in range(8)}
    now = 0
    for turn in range(4):
        for s in range(8):
            history[s] += f"\nuser turn {turn} of session {s}"
            now += 1
            choice = policy.choose(["r0", "r1"], history[s], f"session-{s}", now)
            replica = choice.ranking[0]
            policy.routed(replica, history[s], f"session-{s}", replica, now)
            policy.finished(replica)
            homes[SYS_A if s % 2 == 0 else SYS_B].add(replica)
    assert len(homes[SYS_A]) == 1 and len(homes[SYS_B]) == 1 and homes[SYS_A] != homes[SYS_B]


def test_affinity_config_refuses_bad_values():
    with pytest.raises(ValueError, match="balance_threshold"):
        AffinityConfig(balance_threshold=-1)
    with pytest.raises(ValueError, match="max_sessions"):
        AffinityConfig(max_sessions=0)


# ---- routing keys ----------------------------------------------------------------------------


def test_routing_keys_share_prefixes_where_prompts_do():
    chat = {"model": "m", "messages": [{"role": "system", "content": SYS_A}, {"role": "user", "content": "hi"}],
            "session_id": "s9"}
    longer = {"model": "m", "messages": chat["messages"] + [
        {"role": "assistant", "content": "hello"}, {"role": "user", "content": [{"type": "text", "text": "more"}]}]}
    k1 = routing_key("/v1/chat/completions", chat)
    k2 = routing_key("/v1/chat/completions", longer)
    assert k1 is not None and k2 is not None and k1.session_id == "s9" and k2.session_id is None
    assert k2.key.startswith(k1.key) and SYS_A in k1.key
    assert routing_key("/v1/completions", {"model": "m", "prompt": "abc"}) == RoutingKey("abc")
    assert routing_key("/v1/completions", {"model": "m", "prompt": ["first", "second"]}).key == "first"
    assert routing_key("/v1/completions", {"model": "m", "prompt": [5, 6, 7]}).key == (5, 6, 7)
    assert routing_key("/generate", {"input_ids": [[1, 2], [3]]}).key == (1, 2)
    assert routing_key("/generate", {"text": "t"}).key == "t"
    assert routing_key("/generate", {"text": "t", "session_id": "s"}) == RoutingKey("t", "s")
    assert routing_key("/v1/sessions/pin", {"text": SYS_A, "ttl_s": 60}).key == SYS_A
    responses = routing_key("/v1/responses", {"model": "m", "instructions": "I", "input": "x",
                                              "previous_response_id": "resp_1"})
    assert responses.key == "system\x1eI\x1fuser\x1ex\x1f" and responses.session_id == "response:resp_1"


TOOL = {"name": "get_weather", "description": "the weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def test_one_conversation_has_one_key_whichever_api_sends_it():
    """Chat, Responses and Anthropic's messages render one conversation alike, so they are keyed
    alike: a client moving between APIs keeps its replica's cache."""
    chat = routing_key("/v1/chat/completions", {"model": "m", "tools": [{"type": "function", "function": TOOL}],
        "messages": [{"role": "system", "content": SYS_A}, {"role": "user", "content": "Paris?"},
                     {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                      "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
                     {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]})
    messages = routing_key("/v1/messages", {"model": "m", "max_tokens": 8, "system": SYS_A, "session_id": "s1",
        "tools": [{"name": "get_weather", "description": "the weather", "input_schema": TOOL["parameters"]}],
        "messages": [{"role": "user", "content": "Paris?"},
                     {"role": "assistant", "content": [{"type": "tool_use", "id": "c1", "name": "get_weather",
                                                        "input": {"city": "Paris"}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "c1", "content": "sunny"}]}]})
    responses = routing_key("/v1/responses", {"model": "m", "instructions": SYS_A,
        "tools": [{"type": "function", **TOOL}],
        "input": [{"role": "user", "content": "Paris?"},
                  {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
                  {"type": "function_call_output", "call_id": "c1", "output": "sunny"}]})
    assert chat.key == messages.key == responses.key and SYS_A in chat.key and "sunny" in chat.key
    assert messages.session_id == "s1" and chat.session_id is None
    assert routing_key("/v1/messages", {"model": "m", "max_tokens": 8, "session_id": "s1",
                                         "messages": [{"role": "user", "content": "hi"}]}, tenant="a11ce").session_id \
        == "a11ce:s1"


def test_every_generating_route_of_the_server_is_routed():
    """Every POST route the server registers is keyed by prompt and session, broadcast, or named
    as needing no key: a new generating route that the cluster does not route fails here."""
    routes = app_routes(ServerOptions(enable_debug_endpoints=True))
    posts = {r.path for r in routes if "POST" in (r.methods or ())}
    assert set(ROUTED_PATHS) <= posts
    unrouted = posts - set(ROUTED_PATHS) - set(BROADCAST_PATHS) - set(UNKEYED_PATHS) - {SESSION_CLOSE_PATH}
    assert not unrouted, f"routes the cluster does not route: {sorted(unrouted)}"
    assert "/v1/messages" in ROUTED_PATHS


def test_routing_keys_are_namespaced_like_the_cache():
    body = {"model": "m", "prompt": "same"}
    plain = routing_key("/v1/completions", body)
    alice = routing_key("/v1/completions", body, tenant="a11ce")
    bob = routing_key("/v1/completions", body, tenant="b0b")
    shared = routing_key("/v1/completions", body, tenant="a11ce", shared_cache=True)
    salted = routing_key("/v1/completions", {"model": "m", "prompt": "same", "cache_salt": "s"})
    assert len({plain.key, alice.key, bob.key, salted.key}) == 4
    assert shared.key == plain.key
    ids = routing_key("/v1/completions", {"model": "m", "prompt": [1, 2]}, tenant="a11ce")
    assert ids.key[1:] == (1, 2) and isinstance(ids.key[0], str)


def test_sessions_are_routed_per_tenant_even_with_a_shared_cache():
    body = {"text": "t", "session_id": "s"}
    assert routing_key("/generate", body, tenant="a11ce").session_id == "a11ce:s"
    assert routing_key("/generate", body, tenant="b0b", shared_cache=True).session_id == "b0b:s"
    follow_up = {"model": "m", "instructions": "I", "input": "x", "previous_response_id": "resp_1"}
    assert routing_key("/v1/responses", follow_up, tenant="a11ce").session_id == "a11ce:response:resp_1"


def test_bodies_the_router_does_not_understand_get_no_key():
    assert routing_key("/v1/completions", None) is None
    assert routing_key("/v1/completions", ["prompt"]) is None
    assert routing_key("/v1/completions", {"model": "m", "prompt": 5}) is None
    assert routing_key("/v1/chat/completions", {"model": "m", "messages": "hi"}) is None
    assert routing_key("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "x"}],
                                                "temprature": 0}) is None  # the replica refuses it: no key
    assert routing_key("/v1/messages", {"model": "m", "max_tokens": 8, "messages": [
        {"role": "user", "content": [{"type": "image", "source": {}}]}]}) is None
    assert routing_key("/v1/models", {"prompt": "x"}) is None


# ---- forwarding into an app ------------------------------------------------------------------


def _app(aborted: list[str]) -> Starlette:
    async def echo(request: Request):
        body = await request.json()
        return JSONResponse({"got": body, "path": request.url.path, "auth": request.headers.get("authorization")},
                            status_code=201)

    async def stream(request: Request):
        async def events():
            try:
                for i in range(1000):
                    yield f"data: {i}\n\n"
                    await asyncio.sleep(0.001)
            finally:
                aborted.append("closed")

        return StreamingResponse(events(), media_type="text/event-stream")

    async def broken(request: Request):
        raise RuntimeError("boom")

    return Starlette(routes=[Route("/echo", echo, methods=["POST"]), Route("/stream", stream),
                             Route("/broken", broken)])


def test_forwarded_request_gets_the_apps_whole_answer():
    app = _app([])
    request = ForwardedRequest("POST", "/echo", headers=[(b"authorization", b"Bearer k")], body=b'{"a": 1}')
    head, body = asyncio.run(collect(serve_forwarded(app, request, "r7")))
    assert head.status == 201 and head.replica == "r7" and not head.is_stream
    assert body == b'{"got":{"a":1},"path":"/echo","auth":"Bearer k"}'
    head, _ = asyncio.run(collect(serve_forwarded(app, ForwardedRequest("GET", "/nowhere"), "r7")))
    assert head.status == 404


def test_forwarded_stream_arrives_in_chunks_and_stopping_early_disconnects_the_app():
    aborted: list[str] = []
    app = _app(aborted)

    async def first_three() -> list:
        items = []
        stream = serve_forwarded(app, ForwardedRequest("GET", "/stream"), "r1")
        async for item in stream:
            items.append(item)
            if len(items) == 4:
                break
        await stream.aclose()
        return items

    items = asyncio.run(first_three())
    assert isinstance(items[0], ResponseHead) and items[0].is_stream
    assert items[1:] == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n"]
    assert aborted == ["closed"]  # the app saw the disconnect and closed its stream


def test_an_app_that_raises_answers_500_or_fails_the_forwarded_call():
    head, body = asyncio.run(collect(serve_forwarded(_app([]), ForwardedRequest("GET", "/broken"), "r1")))
    assert head.status == 500 and body == b"Internal Server Error"  # Starlette's answer, as under uvicorn

    async def raw_app(scope, receive, send):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        asyncio.run(collect(serve_forwarded(raw_app, ForwardedRequest("GET", "/"), "r1")))


def test_forwarded_request_exposes_its_prompt_for_rays_prefix_router():
    request = ForwardedRequest("POST", "/v1/completions", routing=RoutingKey((1, 2)))
    assert request.prompt == "1 2"
    assert ForwardedRequest("GET", "/v1/models").prompt == "GET /v1/models"  # never empty
    assert ForwardedRequest("POST", "/v1/completions", routing=RoutingKey("")).prompt == "POST /v1/completions"


# ---- metrics ---------------------------------------------------------------------------------

_TEXT = """# HELP radixserve_cached_prompt_tokens_total Prompt tokens served from the prefix cache
# TYPE radixserve_cached_prompt_tokens_total counter
radixserve_cached_prompt_tokens_total {value}
# HELP radixserve_requests_running Requests running in the engine
# TYPE radixserve_requests_running gauge
radixserve_requests_running {running}
"""


def test_metrics_of_replicas_merge_with_a_replica_label():
    merged = merge_metrics([("r0", _TEXT.format(value=30.0, running=1)), ("r1", _TEXT.format(value=12.0, running=0))])
    text = merged.decode()
    assert 'radixserve_cached_prompt_tokens_total{replica="r0"} 30.0' in text
    assert 'radixserve_cached_prompt_tokens_total{replica="r1"} 12.0' in text
    assert 'radixserve_requests_running{replica="r0"} 1.0' in text
    assert text.count("# TYPE radixserve_cached_prompt_tokens_total counter") == 1
    assert sample_total(text, "radixserve_cached_prompt_tokens_total") == 42.0


def _common(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def test_a_short_incidental_match_counts_as_no_match():
    policy = _policy(min_match_fraction=0.3)
    home = policy.choose(["r0", "r1"], "You are a pirate. " * 10, None, now=1).ranking[0]
    choice = policy.choose(["r0", "r1"], "You are a robot. " * 10, None, now=2)  # shares "You are a " only
    assert choice.reason == "new" and choice.ranking[0] != home
    with pytest.raises(ValueError, match="min_match_fraction"):
        AffinityConfig(min_match_fraction=1.5)


# ---- command line ----------------------------------------------------------------------------


def test_serve_flags_pick_the_cluster_mode_and_check_it_before_starting_ray(capsys):
    import argparse

    from radixserve.__main__ import main
    from radixserve.cluster.launch import add_cluster_args, cluster_options, cluster_requested
    from radixserve.server.launch import add_server_args

    parser = argparse.ArgumentParser()
    add_server_args(parser)
    add_cluster_args(parser)
    assert not cluster_requested(parser.parse_args([]))
    args = parser.parse_args(["--replicas", "3", "--router", "round_robin", "--balance-threshold", "7"])
    options = cluster_options(args)
    assert cluster_requested(args) and options.replicas == 3 and options.router == "round_robin"
    assert options.affinity.balance_threshold == 7
    joined = parser.parse_args(["--ray-address", "auto"])
    assert cluster_requested(joined) and cluster_options(joined).replicas == 1
    assert main(["serve", "--replicas", "0"]) == 2
    assert "replicas must be >= 1" in capsys.readouterr().err
    assert main(["serve", "--replicas", "2", "--replica-cpus", "-1"]) == 2
    assert "replica_cpus must be >= 0" in capsys.readouterr().err


def test_common_prefix_length_at_every_split_point():
    from radixserve.cluster.prefix_tree import common_prefix_length

    base = "abcdefghij" * 7
    for i in range(len(base) + 1):
        other = base[:i] + "#" + base[i + 1:]
        assert common_prefix_length(base, other) == (i if i < len(base) else len(base))
        assert common_prefix_length(base, base[:i]) == i
        assert common_prefix_length(tuple(base), tuple(other)) == min(i, len(base))


def test_disaggregation_flags_make_roles_and_refuse_half_a_pair(capsys):
    import argparse

    from radixserve.__main__ import main
    from radixserve.cluster.launch import add_cluster_args, cluster_options, cluster_requested
    from radixserve.server.launch import add_server_args

    parser = argparse.ArgumentParser()
    add_server_args(parser)
    add_cluster_args(parser)
    args = parser.parse_args(["--prefill-replicas", "2", "--decode-replicas", "3", "--transfer-timeout", "5",
                              "--local-prefill-tokens", "0", "--prefill-backlog-tokens", "4096",
                              "--prefill-resource", "gpu_a"])
    options = cluster_options(args)
    assert cluster_requested(args) and options.disaggregated and options.total_replicas == 5
    assert (options.prefill_replicas, options.decode_replicas, options.prefill_resource) == (2, 3, "gpu_a")
    assert (options.pd.transfer_timeout_s, options.pd.local_prefill_tokens) == (5.0, 0)
    assert options.pd.prefill_backlog_tokens == 4096
    assert not cluster_options(parser.parse_args(["--replicas", "2"])).disaggregated
    assert main(["serve", "--prefill-replicas", "1"]) == 2
    assert "go together" in capsys.readouterr().err
    assert main(["serve", "--replicas", "2", "--prefill-replicas", "1", "--decode-replicas", "1"]) == 2
    assert "exclude each other" in capsys.readouterr().err
    assert main(["serve", "--replicas", "2", "--transfer-timeout", "3"]) == 2
    assert "configure disaggregation" in capsys.readouterr().err


def test_prefill_jobs_carry_a_token_key_and_acks_name_their_replica():
    from radixserve.cluster.pd_jobs import PrefillJob, ReleaseJob
    from radixserve.cluster.routers import _forwarded
    from radixserve.sampling_params import SamplingParams

    job = PrefillJob.of([5, 6, 7], SamplingParams(), "tenant", 0)
    assert job.routing.key == ("ns:tenant", 5, 6, 7)
    assert PrefillJob.of([5, 6], SamplingParams(), None, 1).routing.key == (5, 6)

    class Pending:
        args = [ReleaseJob("replica-b", "h-1")]

    assert _forwarded(Pending()).target_replica == "replica-b"

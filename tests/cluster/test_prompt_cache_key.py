"""OpenAI's prompt_cache_key in the cluster: an affinity key of its own (requests that give the
same key in the same namespace go where the first went, whatever their prompts), led by the
tenant and the cache salt so no key reaches another's; a session id still wins. No Ray."""

from __future__ import annotations

from radixserve.cluster.affinity import AffinityConfig, AffinityPolicy
from radixserve.cluster.routing_key import routing_key

CHAT = "/v1/chat/completions"


def body(content: str, **extra) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": content}], **extra}


def test_the_key_becomes_a_session_of_its_namespace():
    assert routing_key(CHAT, body("hi", prompt_cache_key="agent-7")).session_id == "prompt_cache_key::agent-7"
    assert routing_key(CHAT, body("hi", prompt_cache_key="agent-7"), tenant="t1").session_id == \
        "t1:prompt_cache_key::agent-7"
    assert routing_key(CHAT, body("hi", prompt_cache_key="agent-7", cache_salt="s")).session_id == \
        "prompt_cache_key:s:agent-7"
    assert routing_key(CHAT, body("hi", prompt_cache_key="agent-7", session_id="conv")).session_id == "conv"
    assert routing_key(CHAT, body("hi")).session_id is None
    assert routing_key(CHAT, body("hi", prompt_cache_key="")).session_id is None


def test_requests_with_one_key_follow_the_first_whatever_their_prompts():
    policy = AffinityPolicy(AffinityConfig())
    policy.set_replicas(["r0", "r1"])
    first = routing_key(CHAT, body("a long shared system prompt, then turn one", prompt_cache_key="k"))
    home = policy.choose(["r0", "r1"], first.text, first.session_id, now=1).ranking[0]
    policy.record(home, first.text, first.session_id, now=1)
    other = "r1" if home == "r0" else "r0"
    policy.record(other, "something else entirely", None, now=2)  # the other replica matches the next one longer
    later = routing_key(CHAT, body("something else entirely, and more", prompt_cache_key="k"))
    choice = policy.choose(["r0", "r1"], later.text, later.session_id, now=3)
    assert choice.ranking[0] == home and choice.reason == "session"

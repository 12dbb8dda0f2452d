"""ReplyIdStore: replies kept per namespace and prompt, bounded by entries and by tokens, least
recently used first; one namespace never reaches another's; two replies with the same text
after different prompts keep their own ids."""

from __future__ import annotations

import pytest

from radixserve.engine.reply_ids import ReplySplicer
from radixserve.outputs import RequestOutput
from radixserve.server.reply_store import ReplyIdStore

P = [5, 6, 7]  # a prompt's ids


def test_a_namespace_reaches_only_its_own_replies():
    store = ReplyIdStore()
    store.put("key:a", P, "hello", [1, 2, 3])
    assert store.view("key:a").replies_after(P) == [("hello", [1, 2, 3])]
    assert store.view("key:a").may_begin("hello there")
    for other in ("key:b", None, "key:a/salt"):
        assert store.view(other).replies_after(P) == [] and not store.view(other).may_begin("hello")


def test_a_reply_is_found_by_the_exact_prompt_it_followed():
    store = ReplyIdStore()
    store.put(None, P, "same", [1])
    store.put(None, P + [8], "same", [2])
    assert store.after(None, P) == [("same", [1])] and store.after(None, P + [8]) == [("same", [2])]
    assert store.after(None, P[:-1]) == []


def test_entries_bound_evicts_the_least_recently_used_exactly():
    store = ReplyIdStore(max_entries=3)
    for name in "abc":
        store.put(None, [ord(name)], name, [ord(name)])
    assert store.after(None, [97]) == [("a", [97])]  # a is now the most recent: b goes first
    store.put(None, [100], "d", [100])
    assert store.texts(None) == ["c", "a", "d"]
    assert len(store) == 3 and store.num_tokens == 3
    assert not store.may_begin(None, "b")


def test_tokens_bound_evicts_until_the_ids_fit():
    store = ReplyIdStore(max_tokens=10)
    store.put(None, P, "a", [1] * 4)
    store.put(None, P, "b", [2] * 4)
    store.put(None, P, "c", [3] * 4)  # 12 > 10: a goes
    assert store.texts(None) == ["b", "c"] and store.num_tokens == 8
    store.put(None, P, "b", [2] * 6)  # replaced: 4 + 6 = 10 fits
    assert store.num_tokens == 10 and dict(store.after(None, P)) == {"b": [2] * 6, "c": [3] * 4}
    assert not store.put(None, P, "huge", [0] * 11)  # never fits: not kept, nothing evicted
    assert len(store) == 2


def test_empty_replies_are_not_kept_and_bad_bounds_are_refused():
    store = ReplyIdStore()
    assert not store.put(None, P, "", [1]) and not store.put(None, P, "x", [])
    with pytest.raises(ValueError):
        ReplyIdStore(max_entries=0)


def test_record_keeps_a_finished_reply_under_its_prompt_and_text():
    store = ReplyIdStore()
    view = store.view("key:a")
    view.record(None, RequestOutput("r", None, P, [7, 8, 2], "hi", finished=True, finish_reason="stop"))
    assert view.replies_after(P) == [("hi", [7, 8, 2])]
    view.record(None, RequestOutput("r2", None, P, [9], "cut", finished=True, finish_reason="abort"))
    assert store.texts("key:a") == ["hi"]  # an aborted reply never reaches a client as a whole


def test_the_same_reply_twice_in_a_conversation_keeps_each_ones_ids(real_model_dir):
    """The same call made at two turns, each generated with its own token split: each turn of
    the next prompt gets the ids generated there."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(real_model_dir)
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    render = lambda messages: tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)  # noqa: E731
    store, splicer = ReplyIdStore(), ReplySplicer(tokenizer)
    reply = "Hello world"
    first, second = encode("Hel") + encode("lo world"), encode("Hello") + encode(" wor") + encode("ld")
    messages = [{"role": "user", "content": "Hi"}]
    p1 = splicer.encode(render(messages), store.view(None))
    store.put(None, p1, reply, first)
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "Again"}]
    p2 = splicer.encode(render(messages), store.view(None))
    store.put(None, p2, reply, second)
    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "Done"}]
    ids = splicer.encode(render(messages), store.view(None))
    assert ids[: len(p1) + len(first)] == p1 + first
    assert ids[: len(p2) + len(second)] == p2 + second

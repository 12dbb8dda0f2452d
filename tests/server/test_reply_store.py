"""ReplyIdStore: replies kept per namespace, bounded by entries and by tokens, least recently
used first; one namespace never reaches another's."""

from __future__ import annotations

import pytest

from radixserve.outputs import RequestOutput
from radixserve.server.reply_store import ReplyIdStore


def test_a_namespace_reaches_only_its_own_replies():
    store = ReplyIdStore()
    store.put("key:a", "hello", [1, 2, 3])
    assert store.view("key:a").reply_ids("hello") == [1, 2, 3]
    assert store.view("key:b").reply_ids("hello") is None
    assert store.view(None).reply_ids("hello") is None
    assert store.view("key:a/salt").reply_ids("hello") is None


def test_entries_bound_evicts_the_least_recently_used_exactly():
    store = ReplyIdStore(max_entries=3)
    for name in "abc":
        store.put(None, name, [ord(name)])
    assert store.get(None, "a") == [97]  # a is now the most recent: b goes first
    store.put(None, "d", [100])
    assert [t for t in "abcd" if store.get(None, t) is not None] == ["a", "c", "d"]
    assert len(store) == 3 and store.num_tokens == 3


def test_tokens_bound_evicts_until_the_ids_fit():
    store = ReplyIdStore(max_tokens=10)
    store.put(None, "a", [1] * 4)
    store.put(None, "b", [2] * 4)
    store.put(None, "c", [3] * 4)  # 12 > 10: a goes
    assert store.get(None, "a") is None and store.num_tokens == 8
    store.put(None, "b", [2] * 6)  # replaced in place: 4 + 6 = 10 fits
    assert store.num_tokens == 10 and store.get(None, "c") == [3] * 4
    assert not store.put(None, "huge", [0] * 11)  # never fits: not kept, nothing evicted
    assert len(store) == 2


def test_empty_replies_are_not_kept_and_bad_bounds_are_refused():
    store = ReplyIdStore()
    assert not store.put(None, "", [1]) and not store.put(None, "x", [])
    with pytest.raises(ValueError):
        ReplyIdStore(max_entries=0)


def test_record_keeps_a_finished_reply_under_its_text():
    store = ReplyIdStore()
    view = store.view("key:a")
    output = RequestOutput("r", None, [5], [7, 8, 2], "hi", finished=True, finish_reason="stop")
    view.record(None, output)
    assert view.reply_ids("hi") == [7, 8, 2]
    view.record(None, RequestOutput("r2", None, [5], [9], "cut", finished=True, finish_reason="abort"))
    assert view.reply_ids("cut") is None  # an aborted reply never reaches a client as a whole

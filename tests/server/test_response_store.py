"""ResponseStore: bounded by count (oldest dropped first), by age (TTL) and by size."""

from __future__ import annotations

from radixserve.server.response_store import ResponseStore
from radixserve.tools.history import HistoryCall, HistoryMessage


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def turn(text: str) -> list[HistoryMessage]:
    return [HistoryMessage("user", text), HistoryMessage("assistant", None, (HistoryCall("c1", "f", "{}", "x"),))]


def test_keeps_and_returns_a_copy():
    store = ResponseStore()
    assert store.put("r1", turn("hi"))
    got = store.get("r1")
    assert got == turn("hi")
    got.append(HistoryMessage("user", "more"))
    assert store.get("r1") == turn("hi")
    assert store.get("nope") is None


def test_oldest_dropped_past_the_bound():
    store = ResponseStore(max_entries=2)
    for i in range(3):
        store.put(f"r{i}", turn(str(i)))
    assert store.get("r0") is None and store.get("r1") is not None and store.get("r2") is not None
    assert len(store) == 2


def test_entries_expire():
    clock = Clock()
    store = ResponseStore(ttl_s=10, clock=clock)
    store.put("a", turn("a"))
    clock.now = 5
    store.put("b", turn("b"))
    clock.now = 10.5
    assert store.get("a") is None and store.get("b") is not None
    clock.now = 16
    assert store.get("b") is None and len(store) == 0


def test_too_long_is_not_kept():
    store = ResponseStore(max_chars=10)
    assert not store.put("big", turn("x" * 20))
    assert store.get("big") is None


def test_a_response_is_found_only_by_its_owner():
    store = ResponseStore()
    history = [HistoryMessage("user", "the vault code is 4417")]
    assert store.put("resp_1", history, owner="a")
    assert store.get("resp_1", owner="b") is None and store.get("resp_1") is None
    assert store.get("resp_1", owner="a") == history
    view_b = store.for_owner("b")
    assert view_b.get("resp_1") is None
    assert view_b.put("resp_1", [HistoryMessage("user", "other")])  # the same id under B is B's own
    assert store.for_owner("a").get("resp_1") == history
    assert view_b.get("resp_1") == [HistoryMessage("user", "other")]


def test_one_owner_filling_the_store_never_evicts_anothers():
    store = ResponseStore(max_entries=2)
    assert store.put("a1", [HistoryMessage("user", "mine")], owner="a")
    for i in range(5):
        assert store.put(f"b{i}", [HistoryMessage("user", "flood")], owner="b")
    assert store.get("a1", owner="a") == [HistoryMessage("user", "mine")]
    assert store.get("b0", owner="b") is None and store.get("b4", owner="b") is not None
    assert len(store) == 3

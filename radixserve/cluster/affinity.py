"""AffinityPolicy: which replica a request goes to (sessions, longest cached prefix, balance).

Plain Python, no Ray: the Ray request router (routers.py) feeds it the live replicas and
its own in-flight counts, and reports where each request really went.

Where every candidate replica's KV events are tracked (`kv_index`, kv_index.py) and the
request's block names are known, the prefix match is what the replicas really hold (in
blocks, reason "kv_prefix"); otherwise the per-replica shadow trees of what was routed there.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from radixserve.cluster.kv_index import KVBlockIndex
from radixserve.cluster.prefix_tree import ApproxPrefixTree, Key


@dataclass(frozen=True)
class AffinityConfig:
    balance_threshold: int = 4  # the preferred replica may run this many more requests than the least loaded
    min_match: int = 1  # a shorter longest match counts as no match (the request goes to the least loaded) ...
    min_match_fraction: float = 0.3  # ... and so does one covering less than this share of the key
    max_tree_size: int = 2_000_000  # elements (characters or token ids) remembered per replica
    max_tree_age_s: float | None = 3600.0  # forget paths not routed for this long
    max_sessions: int = 100_000  # session -> replica bindings kept (least recently used dropped)
    evict_every: int = 256  # choices between two age evictions

    def __post_init__(self) -> None:
        if self.balance_threshold < 0:
            raise ValueError(f"balance_threshold must be >= 0, got {self.balance_threshold}")
        if not 0.0 <= self.min_match_fraction <= 1.0:
            raise ValueError(f"min_match_fraction must be within [0, 1], got {self.min_match_fraction}")
        for name in ("min_match", "max_tree_size", "max_sessions", "evict_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class Choice:
    ranking: list[str]  # replica ids, the chosen one first, the rest by load
    reason: str  # "session", "prefix" / "kv_prefix", "new" (no match: least loaded) or "balance" (preferred too busy)
    match_length: int  # of the key on the chosen replica's tree (kv_prefix: blocks it holds)


class AffinityPolicy:
    """Routes by session, then by the longest prefix match over per-replica approximate trees,
    unless the preferred replica's in-flight count exceeds the least loaded one's by more than
    balance_threshold. `choose` records the key on the chosen replica at once (so concurrent
    requests with the same prefix follow it); `routed` corrects that when the request went
    elsewhere."""

    def __init__(self, config: AffinityConfig | None = None, kv_index: KVBlockIndex | None = None):
        self.config = config or AffinityConfig()
        self.kv_index = kv_index
        self.trees: dict[str, ApproxPrefixTree] = {}
        self.sessions: OrderedDict[str, str] = OrderedDict()
        self.in_flight: dict[str, int] = {}
        self._choices = 0

    def set_replicas(self, replicas: Iterable[str]) -> None:
        """The live replicas: new ones start empty, gone ones are forgotten."""
        live = set(replicas)
        for gone in set(self.trees) - live:
            self.remove_replica(gone)
        for replica in live - set(self.trees):
            self.trees[replica] = ApproxPrefixTree(self.config.max_tree_size, self.config.max_tree_age_s)
            self.in_flight.setdefault(replica, 0)

    def remove_replica(self, replica: str) -> None:
        """Forget a replica (it died): its tree, its load and the sessions bound to it."""
        self.trees.pop(replica, None)
        self.in_flight.pop(replica, None)
        if self.kv_index is not None:
            self.kv_index.forget(replica)
        for session in [s for s, r in self.sessions.items() if r == replica]:
            del self.sessions[session]

    def choose(self, candidates: Iterable[str], key: Key, session_id: str | None, now: float,
               blocks: list | None = None) -> Choice:
        """`blocks`: the request's block names as the replicas publish them (kv_index.wire_hashes)."""
        replicas = [r for r in candidates if r in self.trees]
        if not replicas:
            raise ValueError("no live replica to choose from")
        self._maybe_evict(now)
        load = {r: self.in_flight.get(r, 0) for r in replicas}
        by_events = blocks is not None and self.kv_index is not None and all(self.kv_index.tracks(r) for r in replicas)
        if by_events:
            matches = {r: self.kv_index.match(r, blocks) for r in replicas}
        else:
            matches = {r: self.trees[r].match_length(key) for r in replicas}
        preferred, reason = self._preferred(replicas, matches, load, session_id, len(blocks) if by_events else len(key))
        if by_events and reason == "prefix":
            reason = "kv_prefix"
        least = min(replicas, key=lambda r: (load[r], -matches[r], self.trees[r].size, r))
        if load[preferred] > load[least] + self.config.balance_threshold:
            preferred, reason = least, "balance"
        self.record(preferred, key, session_id, now)
        rest = sorted((r for r in replicas if r != preferred), key=lambda r: (load[r], -matches[r], r))
        return Choice([preferred] + rest, reason, matches[preferred])

    def record(self, replica: str, key: Key, session_id: str | None, now: float) -> None:
        """Remember that key (and session) went to replica."""
        tree = self.trees.get(replica)
        if tree is None:
            return
        tree.insert(key, now)
        if session_id is not None:
            self.sessions[session_id] = replica
            self.sessions.move_to_end(session_id)
            while len(self.sessions) > self.config.max_sessions:
                self.sessions.popitem(last=False)

    def routed(self, replica: str, key: Key, session_id: str | None, chosen: str | None, now: float) -> None:
        """The request went to `replica` (choose had picked `chosen`): count it in flight, and
        record it there if that is not where choose recorded it."""
        if replica in self.in_flight:
            self.in_flight[replica] += 1
        if replica != chosen:
            self.record(replica, key, session_id, now)

    def finished(self, replica: str) -> None:
        if self.in_flight.get(replica, 0) > 0:
            self.in_flight[replica] -= 1

    def _preferred(
        self, replicas: list[str], matches: Mapping[str, int], load: Mapping[str, int], session_id: str | None,
        key_length: int,
    ) -> tuple[str, str]:
        bound = self.sessions.get(session_id) if session_id is not None else None
        if bound in matches:
            return bound, "session"
        best = max(replicas, key=lambda r: (matches[r], -load[r], -self.trees[r].size, r))
        if matches[best] >= max(self.config.min_match, self.config.min_match_fraction * key_length):
            return best, "prefix"
        return min(replicas, key=lambda r: (load[r], self.trees[r].size, r)), "new"

    def _maybe_evict(self, now: float) -> None:
        self._choices += 1
        if self._choices % self.config.evict_every == 0:
            for tree in self.trees.values():
                tree.evict(now)

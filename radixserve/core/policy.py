"""SchedulePolicy: the order in which waiting requests are considered for admission.

- fcfs: arrival order (preempted requests first: they return to the queue's front).
- lpm: longest cached prefix first, so the requests that cost least are admitted while
  their prefix is still cached.
- dfs-weight (SGLang): walk the radix tree depth first, heavier subtrees (more waiting
  requests) first, so requests that share a prefix run back to back.

Two guards apply to every policy: a request passed over for `starvation_steps` steps goes
first (longest-prefix-first otherwise starves cache misses), and a queue longer than
`fcfs_threshold` is taken in arrival order (sorting would cost more than it saves).

Agent hints' priority comes before all of that except starvation: where any waiting request
has one, the order is higher priority first, the policy's order within a priority (fcfs:
arrival, moved earlier by latency_sensitivity).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

from radixserve.core.radix_node import RadixNode
from radixserve.core.request import Request


class SchedulePolicy:
    def __init__(self, name: str, kv: Any, starvation_steps: int, fcfs_threshold: int):
        self.name = name
        self.kv = kv  # the KV manager (core/kv_manager.py), read only: caching, peek_prefix
        self.starvation_steps = starvation_steps
        self.fcfs_threshold = fcfs_threshold

    def order(self, waiting: list[Request]) -> list[Request]:
        starving = [r for r in waiting if r.waited_steps >= self.starvation_steps]
        rest = [r for r in waiting if r.waited_steps < self.starvation_steps] if starving else waiting
        if not self.kv.caching or self.name == "fcfs" or len(waiting) > self.fcfs_threshold or len(rest) < 2:
            return starving + _by_hints(rest, arrival=True)
        if self.name == "lpm":
            return starving + _by_hints(self._longest_prefix_first(rest), arrival=False)
        return starving + _by_hints(self._dfs_weight(rest), arrival=False)

    def _longest_prefix_first(self, requests: list[Request]) -> list[Request]:
        cached = {id(r): self.kv.peek_prefix(r.token_ids, r.cache_salt)[0] for r in requests}
        return sorted(requests, key=lambda r: -cached[id(r)])  # stable: fcfs among equals

    def _dfs_weight(self, requests: list[Request]) -> list[Request]:
        at_node: dict[int, list[Request]] = defaultdict(list)
        weight: dict[int, int] = defaultdict(int)
        nodes: dict[int, RadixNode] = {}
        roots: list[RadixNode] = []
        unmatched: list[Request] = []
        for r in requests:
            _, node = self.kv.peek_prefix(r.token_ids, r.cache_salt)
            if node is None or node.is_root:
                unmatched.append(r)
                continue
            at_node[node.node_id].append(r)
            while node is not None:
                weight[node.node_id] += 1
                nodes[node.node_id] = node
                if node.is_root and node not in roots:
                    roots.append(node)
                node = node.parent
        ordered: list[Request] = []
        stack = sorted(roots, key=lambda n: weight[n.node_id])
        while stack:
            node = stack.pop()
            ordered.extend(at_node.get(node.node_id, ()))
            children = [c for c in node.children.values() if weight.get(c.node_id)]
            stack.extend(sorted(children, key=lambda c: weight[c.node_id]))
        return ordered + unmatched  # cache misses last, in arrival order


def _by_hints(ordered: list[Request], arrival: bool) -> list[Request]:
    """Higher priority first (stable: the given order within a priority); with `arrival`,
    by arrival time moved earlier by latency_sensitivity within a priority."""
    if all(r.hints.priority == 0 and r.hints.latency_sensitivity_s == 0 for r in ordered):
        return ordered
    if arrival:
        return sorted(ordered, key=lambda r: r.hints.queue_key(r.arrival_time))
    return sorted(ordered, key=lambda r: -r.hints.priority)

"""ForkGroup: the branches of `state.fork(n)`, and their join.

    forks = s.fork(3)
    for i, f in enumerate(forks):
        f += f"Idea {i + 1}:" + rl.gen("idea", max_tokens=24, seed=i)
    forks.join()                  # s["idea"] == [idea of branch 0, 1, 2]
    best = forks[0]["idea"]

Each branch's text starts as the parent's, so their requests share the parent's prefix
blocks through the cache; their work runs concurrently until read or joined.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Generic, Protocol, TypeVar

from radixserve.lang.record import StateRecord


class Branch(Protocol):
    """What a join needs of a branch (ProgramState is one): wait for its work, read its record."""

    _record: StateRecord

    def sync(self, timeout_s: float | None = None) -> None: ...


B = TypeVar("B", bound=Branch)


class ForkGroup(Sequence, Generic[B]):
    """A list of child states; `+=` appends to every branch, `join` gathers them into the
    parent's record."""

    def __init__(self, parent: StateRecord, children: list[B]):
        self.parent = parent
        self.children = children

    def __getitem__(self, index: int) -> B:  # type: ignore[override]
        return self.children[index]

    def __len__(self) -> int:
        return len(self.children)

    def __iter__(self) -> Iterator[B]:
        return iter(self.children)

    def __iadd__(self, expr: Any) -> "ForkGroup[B]":
        for child in self.children:
            child += expr  # type: ignore[operator]
        return self

    def join(self, timeout_s: float | None = None) -> dict[str, list[Any]]:
        """Wait for every branch; each variable set in a branch after the fork becomes a
        list in the parent (one entry per branch, None where a branch did not set it).
        Returns those lists. Raises the first branch's error, if any."""
        for child in self.children:
            child.sync(timeout_s)
        records = [child._record for child in self.children]
        names: list[str] = []
        for record in records:
            names += [n for n in record.set_since_fork if n not in names]
        gathered = {name: [record.variables.get(name) for record in records] for name in names}
        for name, values in gathered.items():
            self.parent.set_var(name, values, {"branches": [record.meta.get(name) for record in records]})
        return gathered

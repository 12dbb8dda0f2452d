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
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from radixserve.lang.state import ProgramState


class ForkGroup(Sequence):
    """A list of child states; `+=` appends to every branch, `join` gathers them."""

    def __init__(self, parent: "ProgramState", children: list["ProgramState"]):
        self.parent = parent
        self.children = children

    def __getitem__(self, index: int) -> "ProgramState":  # type: ignore[override]
        return self.children[index]

    def __len__(self) -> int:
        return len(self.children)

    def __iter__(self) -> Iterator["ProgramState"]:
        return iter(self.children)

    def __iadd__(self, expr: Any) -> "ForkGroup":
        for child in self.children:
            child += expr
        return self

    def join(self, timeout_s: float | None = None) -> dict[str, list[Any]]:
        """Wait for every branch; each variable set in a branch after the fork becomes a
        list in the parent (one entry per branch, None where a branch did not set it).
        Returns those lists. Raises the first branch's error, if any."""
        for child in self.children:
            child.sync(timeout_s)
        names: list[str] = []
        for child in self.children:
            names += [n for n in child._set_since_fork if n not in names]
        gathered = {name: [child._variables.get(name) for child in self.children] for name in names}
        for name, values in gathered.items():
            self.parent._set_var(name, values, {"branches": [child._meta.get(name) for child in self.children]})
        return gathered

"""Expressions a program appends to its state (`s += ...`), and their flattening into ops.

An expression is text, a `gen`, a `select`, a role wrapping other expressions, or a
concatenation of these (`"Q: " + rl.gen("a")`). The interpreter runs the flat op list
Text / Tools / Gen / Select / RoleBegin / RoleEnd in order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

ROLES = ("system", "user", "assistant")
CHOICES_METHODS = ("total", "token_length_normalized")


class Expr:
    """Base of every expression; `+` concatenates with other expressions and strings."""

    def __add__(self, other: Any) -> "Concat":
        return Concat.of(self, other)

    def __radd__(self, other: Any) -> "Concat":
        return Concat.of(other, self)


@dataclass(frozen=True)
class Text(Expr):
    value: str


@dataclass(frozen=True)
class Concat(Expr):
    parts: tuple[Expr, ...]

    @staticmethod
    def of(*items: Any) -> "Concat":
        parts: list[Expr] = []
        for item in items:
            expr = as_expr(item)
            parts.extend(expr.parts if isinstance(expr, Concat) else [expr])
        return Concat(tuple(parts))


@dataclass(frozen=True)
class Gen(Expr):
    """Generate into the state; `sampling` holds only the options the program gave; `calls`:
    tool_choice (and parallel_tool_calls) when the gen calls the state's tools."""

    name: str | None
    sampling: dict[str, Any] = field(default_factory=dict)
    calls: dict[str, Any] | None = None


@dataclass(frozen=True)
class Tools(Expr):
    """Declare the conversation's tools (checked definitions), before its first message."""

    definitions: tuple[Any, ...]


@dataclass(frozen=True)
class Select(Expr):
    """Append the most likely of `choices` (scored by token log-probabilities)."""

    name: str | None
    choices: tuple[str, ...]
    choices_method: str = "total"


@dataclass(frozen=True)
class Role(Expr):
    """A chat message of `role` whose content is `content` (which may generate)."""

    role: str
    content: Expr


@dataclass(frozen=True)
class RoleBegin(Expr):
    role: str


@dataclass(frozen=True)
class RoleEnd(Expr):
    role: str


def as_expr(value: Any) -> Expr:
    """A string becomes Text; an expression stays; anything else is a TypeError."""
    if isinstance(value, Expr):
        return value
    if isinstance(value, str):
        return Text(value)
    raise TypeError(f"a program appends strings or rl expressions, got {type(value).__name__}: {value!r}")


def to_ops(value: Any) -> list[Expr]:
    """The flat list of Text, Tools, Gen, Select, RoleBegin and RoleEnd ops that `value` stands for."""
    expr = as_expr(value)
    if isinstance(expr, Concat):
        return [op for part in expr.parts for op in to_ops(part)]
    if isinstance(expr, Role):
        return [RoleBegin(expr.role), *to_ops(expr.content), RoleEnd(expr.role)]
    return [expr]

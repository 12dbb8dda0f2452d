"""Scanning generated text piece by piece: where one JSON value ends, and how much of a
text's end may still grow into a marker (held back until the next piece decides)."""

from __future__ import annotations

import json
from dataclasses import dataclass


class JsonValueScanner:
    """Finds where one JSON value ends, fed piece by piece (strings and nesting aware)."""

    def __init__(self) -> None:
        self.started = False
        self.kind = ""
        self.depth = 0
        self.in_string = False
        self.escape = False

    def feed(self, text: str) -> tuple[int, bool]:
        """(characters that belong to the value, whether the value is complete)."""
        for i, ch in enumerate(text):
            if not self.started:
                self._open(ch)
                if self.kind == "scalar" and ch in ",}]":
                    return i, True
                continue
            if self.kind == "scalar":
                if ch in ",}]" or ch.isspace():
                    return i, True
            elif self.in_string:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif ch == '"':
                    self.in_string = False
                    if self.kind == "string":
                        return i + 1, True
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1, True
        return len(text), False

    def _open(self, ch: str) -> None:
        self.started = True
        if ch in "{[":
            self.kind, self.depth = "nested", 1
        elif ch == '"':
            self.kind, self.in_string = "string", True
        else:
            self.kind = "scalar"


def json_value_end(text: str, pos: int) -> int | None:
    """Where the JSON value that starts at `pos` ends; None when the text ends first."""
    used, done = JsonValueScanner().feed(text[pos:])
    return pos + used if done else None


def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker` (held back: it may open a call)."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def decode_name(raw: str) -> str | None:
    """A JSON string's body as a name; None when it is not one."""
    try:
        name = json.loads(f'"{raw}"')
    except ValueError:
        return None
    return name if name else None


def object_items(text: str) -> tuple[list[tuple[str, str]], bool] | None:
    """The (key, value as written) pairs of a JSON object's text, in order, and whether the
    object closes; None when the text is not (the start of) a JSON object."""
    at = skip_ws(text, 0)
    if not text.startswith("{", at):
        return None
    items: list[tuple[str, str]] = []
    at = skip_ws(text, at + 1)
    while at < len(text):
        if text[at] == "}":
            return items, True
        key_end = json_value_end(text, at) if text[at] == '"' else None
        if key_end is None:
            return None
        key = json.loads(text[at:key_end])
        at = skip_ws(text, key_end)
        if not text.startswith(":", at):
            return None
        start = skip_ws(text, at + 1)
        end = json_value_end(text, start)
        items.append((key, text[start:end] if end is not None else text[start:]))
        if end is None:
            return items, False
        at = skip_ws(text, end)
        if text.startswith(",", at):
            at = skip_ws(text, at + 1)
        elif not text.startswith("}", at) and at < len(text):
            return None
    return items, False


@dataclass(frozen=True)
class WrittenObject:
    """A JSON object's text as far as it was written (a call's arguments cut by max_tokens):
    its (key, value as written) pairs, whether it closes, and a key cut short inside its
    string (what was written of it; None when no key is open)."""

    items: list[tuple[str, str]]
    closed: bool
    open_key: str | None = None


def written_object(text: str) -> WrittenObject | None:
    """`text` read as (the start of) a JSON object, a cut inside a key included; None when it is not one."""
    found = object_items(text)
    if found is not None:
        return WrittenObject(*found)
    quote = text.rfind('"')
    head = text[:quote]
    if quote < 0 or not head.rstrip().endswith(("{", ",")):
        return None
    before = object_items(head)
    if before is None or before[1]:
        return None
    return WrittenObject(before[0], False, text[quote + 1:])


def skip_ws(text: str, at: int) -> int:
    """The first position at or after `at` that is not whitespace."""
    while at < len(text) and text[at].isspace():
        at += 1
    return at

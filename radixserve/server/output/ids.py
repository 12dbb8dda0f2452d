"""The ids the server makes up (responses, messages, tool calls): random, so they tell no
count; and the creation time answers carry."""

from __future__ import annotations

import time
import uuid


def new_id(prefix: str, hex_chars: int = 32) -> str:
    """`prefix` then `hex_chars` random hex digits (at most 32)."""
    return prefix + uuid.uuid4().hex[:hex_chars]


def call_hex() -> str:
    """A tool call's own part of its id; each API puts its prefix before it (call_, toolu_)."""
    return uuid.uuid4().hex[:24]


def now_s() -> int:
    """The creation time of an answer: whole seconds since the epoch."""
    return int(time.time())

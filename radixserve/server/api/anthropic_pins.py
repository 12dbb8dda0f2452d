"""cache_control on /v1/messages as a retention hint: each mark pins the prefix it ends
(the conversation rendered up to the marked block) in the request's cache namespace (its
API key's: no other key reads or refreshes it) for the mark's TTL (5m or 1h, capped by
--hint-max-ttl-s as prompt_cache_retention's and agent hints' holds are), once the request
has computed it (at its finish, on the engine thread, while its blocks are in the tree).
Pins order eviction; they reserve nothing (core/sessions.py): under pressure a pinned prefix
leaves the pool after every unpinned entry, demoted to the second tier where there is one
(and leaves the tier last too), rather than dropped. An agent marks the same prefixes on
every turn: a prefix pinned again within a sixteenth of its TTL keeps the pin it has
(RecentPins, a bounded ledger), so pins do not pile up."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from radixserve.outputs import RequestOutput
from radixserve.server.async_engine import FinishHook
from radixserve.engine.prompt_builder import ChatPrompt
from radixserve.tools.history import HistoryMessage

log = logging.getLogger("radixserve.server")

Pin = tuple[float, list[int]]  # (TTL in seconds, the marked prefix's token ids as rendered alone)
RenderPrompt = Callable[[list[HistoryMessage]], ChatPrompt]


async def marked_prefixes(marks: list[tuple[float, list[HistoryMessage]]], render: RenderPrompt,
                          engine: Any) -> list[Pin]:
    """The token ids of each marked prefix (rendered as the whole conversation is), each built
    in one hop, as a prepare worker builds a prompt."""
    pins: list[Pin] = []
    for ttl_s, history in marks:
        built = await asyncio.to_thread(engine.build_prompt, render(history))
        pins.append((ttl_s, list(built.token_ids)))
    return pins


class RecentPins:
    """When each prefix was last pinned, and for how long (the engine thread's only: no lock)."""

    REFRESH = 1 / 16  # of a TTL: a pin younger than this is not made again

    def __init__(self, capacity: int = 4096, clock: Any = time.monotonic):
        self.capacity = capacity
        self.clock = clock
        self._pinned: OrderedDict[tuple, tuple[float, float]] = OrderedDict()  # key -> (when, ttl_s)

    def due(self, key: tuple, ttl_s: float) -> bool:
        """Whether to pin this prefix now (and note it as pinned)."""
        now = self.clock()
        last = self._pinned.get(key)
        if last is not None and last[1] >= ttl_s and now - last[0] < ttl_s * self.REFRESH:
            return False
        self._pinned[key] = (now, ttl_s)
        self._pinned.move_to_end(key)
        while len(self._pinned) > self.capacity:
            self._pinned.popitem(last=False)
        return True


def pin_hook(pins: list[Pin], cache_salt: str | None, recent: RecentPins) -> FinishHook | None:
    """At the request's finish: pin the part of its prompt each mark covers (where the
    prefix rendered alone and the prompt agree; the generation prompt after it differs)."""
    if not pins:
        return None

    def pin(engine: Any, output: RequestOutput) -> None:
        prompt = output.prompt_token_ids
        for ttl_s, ids in capped(pins, engine):
            size = _common_prefix(ids, prompt)
            if size == 0 or not recent.due((cache_salt, size, hash(tuple(prompt[:size]))), ttl_s):
                continue
            try:
                engine.pin_prefix(prompt[:size], ttl_s, cache_salt)
            except ValueError:  # must not raise on the engine thread; a hint is dropped
                log.warning("cache_control: the marked prefix could not be pinned", exc_info=True)

    return pin


def capped(pins: list[Pin], engine: Any) -> list[Pin]:
    """The pins with each TTL capped by the engine's hint_max_ttl_s (its bound on every hold)."""
    config = getattr(engine, "config", None)
    bound = getattr(config, "hint_max_ttl_s", None)
    return pins if bound is None else [(min(ttl_s, float(bound)), ids) for ttl_s, ids in pins]


def chained(*hooks: FinishHook | None) -> FinishHook | None:
    """One hook that runs each given one in turn."""
    present = [h for h in hooks if h is not None]
    if len(present) <= 1:
        return present[0] if present else None

    def run(engine: Any, output: RequestOutput) -> None:
        for hook in present:
            hook(engine, output)

    return run


def _common_prefix(a: list[int], b: list[int]) -> int:
    size = 0
    for x, y in zip(a, b):
        if x != y:
            break
        size += 1
    return size

"""RequestGroup: the engine requests behind one HTTP request, as the event loop sees them."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from radixserve.core.agent_hints import AgentHints
from radixserve.engine.prompt_builder import ChatPrompt
from radixserve.outputs import RequestOutput
from radixserve.sampling_params import SamplingParams
from radixserve.server.errors import APIError


@dataclass(frozen=True)
class GenerationInput:
    """One engine request: a prompt (text, token ids or a conversation, which a prepare worker
    builds: engine/prompt_builder.py) and its sampling params."""

    prompt: str | list[int] | ChatPrompt
    params: SamplingParams
    cache_salt: str | None = None
    session_id: str | None = None  # the agent conversation it continues (a cache hint)
    hints: AgentHints | None = None  # agent hints (core/agent_hints.py)


@dataclass(frozen=True)
class MemberTiming:
    """Server-side timings of one finished member, in seconds from submission."""

    ttft_s: float
    e2e_s: float
    output_tokens: int
    finish_reason: str | None

    @property
    def tpot_s(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


_END = object()  # queued when the group is aborted: iteration stops


@dataclass
class _Member:
    request_id: str
    latest: RequestOutput | None = None
    first_output_at: float | None = None
    finished_at: float | None = None


class RequestGroup:
    """Members (n samples of one or more prompts) of one HTTP request.

    Everything here runs on the event loop. The AsyncEngine feeds outputs (cumulative, as
    the engine gives them) with `push`, and settles acceptance with `accept` / `reject`.
    A group ends when every member finished, when it failed (`fail`), or when aborted.
    """

    def __init__(self, group_id: str, inputs: list[GenerationInput], on_abort: Callable[["RequestGroup"], None]):
        self.group_id = group_id
        self.inputs = inputs
        self.submitted_at = time.monotonic()
        self.members = [_Member(f"{group_id}-{i}") for i in range(len(inputs))]
        self._on_abort = on_abort
        self._events: asyncio.Queue[Any] = asyncio.Queue()
        self._accepted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._error: APIError | None = None
        self._aborted = False
        self.timer: asyncio.TimerHandle | None = None

    # ---- consumer side ------------------------------------------------------------

    async def accepted(self) -> None:
        """Wait until the engine has queued every member; raises APIError if it refused one."""
        await self._accepted

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(member index, cumulative output) as they come; raises APIError if the group fails."""
        finished: set[int] = set()
        while len(finished) < len(self.members):
            item = await self._events.get()
            if isinstance(item, APIError):
                raise item
            if item is _END:
                return
            index, output = item
            if output.finished:
                finished.add(index)
            yield item

    async def results(self) -> list[RequestOutput]:
        """The final output of every member, in member order."""
        async for _ in self.outputs():
            pass
        if self._aborted:
            raise APIError(499, "request aborted", code="aborted")
        return [m.latest for m in self.members]

    def abort(self) -> None:
        """Stop every unfinished member and free its blocks; idempotent."""
        if self.done:
            return
        self._aborted = True
        self._cancel_timer()
        self._on_abort(self)
        self._events.put_nowait(_END)

    @property
    def request_ids(self) -> list[str]:
        return [m.request_id for m in self.members]

    @property
    def finished(self) -> bool:
        """Every member finished normally."""
        return all(m.finished_at is not None for m in self.members)

    @property
    def done(self) -> bool:
        return self.finished or self._aborted or self._error is not None

    @property
    def num_not_started(self) -> int:
        """Members still waiting for their first output (queued in the server or the engine)."""
        if self.done:
            return 0
        return sum(1 for m in self.members if m.first_output_at is None)

    def unfinished_request_ids(self) -> list[str]:
        return [m.request_id for m in self.members if m.finished_at is None]

    def timing(self, index: int) -> MemberTiming:
        member = self.members[index]
        end = member.finished_at or time.monotonic()
        first = member.first_output_at or end
        out = member.latest
        return MemberTiming(
            ttft_s=first - self.submitted_at,
            e2e_s=end - self.submitted_at,
            output_tokens=out.completion_tokens if out is not None else 0,
            finish_reason=out.finish_reason if out is not None else None,
        )

    # ---- engine side (called by the AsyncEngine on the event loop) ------------------

    def accept(self) -> None:
        if not self._accepted.done():
            self._accepted.set_result(None)

    def reject(self, error: APIError) -> None:
        self._error = error
        self._cancel_timer()
        if not self._accepted.done():
            self._accepted.set_exception(error)

    def push(self, index: int, output: RequestOutput) -> None:
        member = self.members[index]
        now = time.monotonic()
        if member.first_output_at is None:
            member.first_output_at = now
        member.latest = output
        if output.finished:
            member.finished_at = now
            if self.finished:
                self._cancel_timer()
        self._events.put_nowait((index, output))

    def fail(self, error: APIError) -> None:
        """End the group with an error the consumer sees (timeout, engine failure, shutdown)."""
        if self.done:
            return
        self.reject(error)
        self._events.put_nowait(error)

    def _cancel_timer(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

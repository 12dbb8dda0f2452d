"""AsyncEngine: an EngineLoop served to asyncio handlers.

Requests are prepared (tokenized, chat-templated, checked, their grammar compiled) on a
small worker pool, so a huge prompt or schema never holds up the engine thread; only
prepared requests reach the EngineLoop. Outputs come back to the event loop with
`loop.call_soon_threadsafe`. The loop's recovery rule applies: a failed step fails the
requests in flight (500); an engine left inconsistent is broken, and later requests get 503.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from radixserve.engine.loop import EngineBrokenError, EngineLoop, EngineStoppedError, Listener
from radixserve.outputs import RequestOutput
from radixserve.engine.inputs import PreparedRequest
from radixserve.request_error import InvalidRequest
from radixserve.server.errors import APIError, bad_request, invalid_request, server_error, template_error, unavailable
from radixserve.engine.prompt_builder import BuiltPrompt, ChatPrompt
from radixserve.server.request_group import GenerationInput, MemberTiming, RequestGroup
from radixserve.server.speculative_prefill import warmup_input

if TYPE_CHECKING:
    from radixserve.engine.protocol import EngineProtocol
    from radixserve.engine.stats import EngineStats

log = logging.getLogger("radixserve.server")

T = TypeVar("T")
FinishHook = Callable[["EngineProtocol", RequestOutput], None]  # on the engine thread, at a request's final output


class AsyncEngine:
    """Asyncio front of an EngineLoop.

    `max_queued_requests` bounds the members submitted but not yet producing output
    (preparing, or waiting in the engine); past it `submit` raises a 503 with Retry-After.
    `request_timeout_s` aborts a group that runs longer (504). `on_finished(timing)` is
    called on the event loop for every member that finishes normally. `prepare_workers`
    threads tokenize and compile grammars.
    """

    def __init__(
        self,
        engine: EngineProtocol,
        max_queued_requests: int = 1024,
        request_timeout_s: float | None = None,
        retry_after_s: int = 1,
        on_finished: Callable[[MemberTiming], None] | None = None,
        prepare_workers: int = 2,
    ):
        self.engine = engine
        self.max_queued_requests = max_queued_requests
        self.request_timeout_s = request_timeout_s
        self.retry_after_s = retry_after_s
        self.on_finished = on_finished
        self.prepare_workers = prepare_workers
        self._initial_snapshot: EngineStats = engine.snapshot()
        self._engine_loop: EngineLoop | None = None
        self._prepare_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._routes: dict[str, tuple[RequestGroup, int]] = {}  # event loop only
        self._groups: dict[str, RequestGroup] = {}  # event loop only
        self._accepting = True
        self._warmups: set[asyncio.Future[None]] = set()  # speculative prefills running (agent hints)
        self._group_ids = (uuid.uuid4().hex[:24] for _ in itertools.count())  # random: tells no count
        # The decode role: an object whose `await prefill(self, prepared)` gives one KV handoff
        # (or TransferFailed, or None: compute here) per member, and `release(handoffs)` acks them.
        self.remote_prefill: Any = None

    # ---- lifecycle (event loop) -------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread and the prepare workers; call from the event loop that
        will consume outputs."""
        self._loop = asyncio.get_running_loop()
        self._engine_loop = EngineLoop(self.engine)
        self._prepare_pool = concurrent.futures.ThreadPoolExecutor(
            self.prepare_workers, thread_name_prefix="radixserve-prepare"
        )

    async def shutdown(self, grace_s: float = 0.0) -> None:
        """Stop taking requests, let running ones finish for up to `grace_s`, abort the rest
        (freeing their blocks), and join the engine thread."""
        self._accepting = False
        deadline = time.monotonic() + grace_s
        while self._groups and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for group in list(self._groups.values()):
            group.fail(unavailable("the server is shutting down", "shutting_down"))
            self._abort_in_engine(group)
        if self._engine_loop is not None:
            await asyncio.to_thread(self._engine_loop.shutdown)
        if self._prepare_pool is not None:
            self._prepare_pool.shutdown(wait=False, cancel_futures=True)
        self._groups.clear()
        self._routes.clear()

    @property
    def healthy(self) -> bool:
        return self._engine_loop is not None and self._engine_loop.healthy

    @property
    def broken_reason(self) -> str | None:
        return self._engine_loop.broken_reason if self._engine_loop is not None else None

    @property
    def latest_snapshot(self) -> EngineStats:
        """The engine's stats as of its latest step (read without waiting for the engine)."""
        return self._engine_loop.latest_snapshot if self._engine_loop is not None else self._initial_snapshot

    @property
    def latest_stats(self) -> dict[str, Any]:
        return self.latest_snapshot.as_dict()

    @property
    def native_thread_id(self) -> int | None:
        """The engine thread's OS id (to read its CPU time in /proc), None before start."""
        return self._engine_loop.native_thread_id if self._engine_loop is not None else None

    @property
    def num_queued(self) -> int:
        """Members submitted whose first output has not come yet."""
        return sum(g.num_not_started for g in self._groups.values())

    @property
    def num_in_flight(self) -> int:
        return sum(len(g.unfinished_request_ids()) for g in self._groups.values())

    # ---- requests (event loop) ----------------------------------------------------------

    async def submit(
        self, inputs: list[GenerationInput], timeout_s: float | None = None, on_finish: FinishHook | None = None,
    ) -> RequestGroup:
        """Queue the members of one HTTP request together: either all are accepted or none.
        Raises APIError: 400 for input the engine refuses, 503 when full or stopping.
        `on_finish(engine, output)` runs on the engine thread with each member's final output,
        before the engine steps again (so the finished prompt's blocks are still in its tree);
        it must not raise, and its cost lands on the engine thread."""
        self._check_accepting()
        if self.num_queued + len(inputs) > self.max_queued_requests:
            raise unavailable(
                f"the server's queue is full ({self.max_queued_requests} requests waiting); retry later",
                "queue_full",
                self.retry_after_s,
            )
        group = RequestGroup(next(self._group_ids), inputs, self._abort_in_engine)
        self._groups[group.group_id] = group
        for index, request_id in enumerate(group.request_ids):
            self._routes[request_id] = (group, index)
        timeout_s = timeout_s if timeout_s is not None else self.request_timeout_s
        if timeout_s is not None:
            group.timer = self._loop.call_later(timeout_s, self._expire, group, timeout_s)
        handoffs = None
        try:
            prepared = await self._prepare(group)
            if prepared is not None and not group.done and self.remote_prefill is not None:
                handoffs = await self.remote_prefill.prefill(self, prepared)
            if prepared is not None and not group.done:  # a timeout may have ended it meanwhile
                self._admit(group, prepared, handoffs, on_finish)
            await group.accepted()
        except BaseException:
            self._forget(group)
            group.abort()
            raise
        finally:
            if handoffs is not None:
                self.remote_prefill.release(handoffs)
        return group

    def run_on_engine(self, fn: Callable[[EngineProtocol], T]) -> concurrent.futures.Future[T]:
        """Run fn(engine) on the engine thread between steps; thread-safe. For tests and
        maintenance (check_integrity, flush_cache, stats)."""
        if self._engine_loop is None:
            future: concurrent.futures.Future[T] = concurrent.futures.Future()
            future.set_exception(RuntimeError("the engine thread is not running"))
            return future
        return self._engine_loop.call(fn)

    async def call(self, fn: Callable[[EngineProtocol], T]) -> T:
        """Await fn(engine) run on the engine thread."""
        return await asyncio.wrap_future(self.run_on_engine(fn))

    # ---- event-loop helpers ------------------------------------------------------------

    def _check_accepting(self) -> None:
        if self.broken_reason is not None:
            raise unavailable(f"the engine failed and stopped: {self.broken_reason}", "engine_failed")
        if not self._accepting or not self.healthy:
            raise unavailable("the server is shutting down", "shutting_down")

    async def _prepare(self, group: RequestGroup) -> list[PreparedRequest] | None:
        """The group's prepared requests, or None after rejecting the group."""
        try:
            future = self._prepare_pool.submit(_prepare_inputs, self.engine, group.inputs)
            return await asyncio.wrap_future(future)
        except Exception as exc:
            self._reject(group, exc)
            return None

    def _admit(
        self, group: RequestGroup, prepared: list[PreparedRequest], handoffs: list[Any] | None = None,
        on_finish: FinishHook | None = None,
    ) -> None:
        future = self._engine_loop.submit(prepared, self._listener(group, on_finish), group.request_ids, handoffs)
        future.add_done_callback(lambda done: self._to_loop(self._settle, group, done))

    def _listener(self, group: RequestGroup, on_finish: FinishHook | None = None) -> Listener:
        def listener(item: RequestOutput | BaseException) -> None:  # on the engine thread
            if on_finish is not None and isinstance(item, RequestOutput) and item.finished:
                on_finish(self.engine, item)
            self._to_loop(self._deliver, group, item)

        return listener

    def _settle(self, group: RequestGroup, admitted: concurrent.futures.Future[list[str]]) -> None:
        exc = admitted.exception()
        if exc is not None:
            self._reject(group, exc)
        else:
            group.accept()

    def _abort_in_engine(self, group: RequestGroup) -> None:
        ids = group.unfinished_request_ids()
        self._forget(group)
        if ids and self._engine_loop is not None:
            self._engine_loop.abort(ids)

    def _forget(self, group: RequestGroup) -> None:
        self._groups.pop(group.group_id, None)
        for request_id in group.request_ids:
            self._routes.pop(request_id, None)

    def _expire(self, group: RequestGroup, timeout_s: float) -> None:
        group.timer = None
        if group.done:
            return
        group.fail(APIError(504, f"request timed out after {timeout_s:g} s", type="timeout_error", code="timeout"))
        self._abort_in_engine(group)

    def _deliver(self, group: RequestGroup, item: RequestOutput | BaseException) -> None:
        if isinstance(item, BaseException):
            if not group.done:
                group.fail(_engine_error(item))
            self._abort_in_engine(group)
            return
        route = self._routes.get(item.request_id)
        if route is None:
            return  # aborted or failed meanwhile
        index = route[1]
        group.push(index, item)
        if item.finished:
            self._routes.pop(item.request_id, None)
            if not _is_warmup(group.inputs[index]):
                self._observe_finished(group, index, item)
            warmup = warmup_input(group.inputs[index], item) if index == 0 else None
            if warmup is not None:
                self._start_warmup(warmup)
            if group.finished:
                self._groups.pop(group.group_id, None)

    def _observe_finished(self, group: RequestGroup, index: int, output: RequestOutput) -> None:
        if self.on_finished is None or output.finish_reason == "abort":
            return
        try:
            self.on_finished(group.timing(index))
        except Exception:
            log.exception("on_finished hook failed")

    def _start_warmup(self, warmup: GenerationInput) -> None:
        """Run a speculative prefill in the background; a full queue or a failure skips it."""
        task = asyncio.ensure_future(self._warmup(warmup))
        self._warmups.add(task)
        task.add_done_callback(self._warmups.discard)

    async def _warmup(self, warmup: GenerationInput) -> None:
        try:
            group = await self.submit([warmup])
            await group.results()
        except Exception as exc:  # a hint, never an error anyone waits for
            log.debug("speculative prefill skipped: %s", exc)

    def _reject(self, group: RequestGroup, exc: BaseException) -> None:
        self._forget(group)
        if not group.done:
            group.reject(_client_error(exc))

    def _to_loop(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop closed during shutdown: nobody is waiting any more
            pass


def _prepare_inputs(engine: EngineProtocol, inputs: list[GenerationInput]) -> list[PreparedRequest]:
    """On a prepare worker: every member's PreparedRequest. A conversation is built here, in
    the same hop (engine/prompt_builder.py: the template, the tools and the grammar of their
    calls), once for the n samples that share it."""
    built: dict[int, BuiltPrompt] = {}
    prepared = []
    for item in inputs:
        prompt, params = item.prompt, item.params
        if isinstance(prompt, ChatPrompt):
            if id(prompt) not in built:
                built[id(prompt)] = engine.build_prompt(prompt)
            prompt, params = built[id(prompt)].token_ids, built[id(prompt)].params(params)
        prepared.append(engine.prepare(prompt, params, item.cache_salt, item.session_id, item.hints))
    return prepared


def _is_warmup(item: GenerationInput) -> bool:
    return item.hints is not None and item.hints.warmup


def _client_error(exc: BaseException) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequest):
        return invalid_request(exc)
    if isinstance(exc, ValueError):
        return bad_request(str(exc))
    if isinstance(exc, EngineBrokenError):
        return unavailable(str(exc), "engine_failed")
    if isinstance(exc, EngineStoppedError):
        return unavailable("the server is shutting down", "shutting_down")
    if type(exc).__module__.startswith("jinja2"):  # the template's own raise_exception
        return template_error(exc)
    log.error("unexpected error while queueing a request", exc_info=exc)
    return server_error(f"{type(exc).__name__}: {exc}")


def _engine_error(exc: BaseException) -> APIError:
    if isinstance(exc, EngineStoppedError):
        return unavailable("the server is shutting down", "shutting_down")
    return server_error(str(exc))

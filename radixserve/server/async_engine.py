"""AsyncEngine: runs an Engine on its own thread and serves it to asyncio handlers.

The Engine is not thread-safe, so the engine thread is the only one that touches it.
Handlers reach it through an inbox of callables (drained before every step); outputs come
back to the event loop with `loop.call_soon_threadsafe`. With no work the thread waits on
an Event instead of spinning.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import queue
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from radixserve.outputs import RequestOutput
from radixserve.server.errors import APIError, bad_request, server_error, unavailable
from radixserve.server.request_group import ChatPrompt, GenerationInput, MemberTiming, RequestGroup

log = logging.getLogger("radixserve.server")


class AsyncEngine:
    """Thread bridge in front of an Engine.

    `max_queued_requests` bounds the members submitted but not yet producing output; past
    it `submit` raises a 503 with Retry-After. `request_timeout_s` aborts a group that runs
    longer (504). `on_finished(timing)` is called on the event loop for every member that
    finishes normally. An exception inside `engine.step()` fails the requests in flight
    with a 500 and aborts them; if the engine is still consistent afterwards (its
    integrity check passes) the loop keeps serving, otherwise the engine is marked broken:
    the thread stops and every later request gets a 503.
    """

    def __init__(
        self,
        engine: Any,
        max_queued_requests: int = 1024,
        request_timeout_s: float | None = None,
        retry_after_s: int = 1,
        on_finished: Callable[[MemberTiming], None] | None = None,
    ):
        self.engine = engine
        self.max_queued_requests = max_queued_requests
        self.request_timeout_s = request_timeout_s
        self.retry_after_s = retry_after_s
        self.on_finished = on_finished
        self.latest_stats: dict[str, Any] = engine.stats()
        self.broken_reason: str | None = None
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop_requested = False  # engine thread only
        self._active_ids: set[str] = set()  # engine thread only: ids the engine holds
        self._routes: dict[str, tuple[RequestGroup, int]] = {}  # event loop only
        self._groups: dict[str, RequestGroup] = {}  # event loop only
        self._accepting = True
        self._group_ids = (f"{uuid.uuid4().hex[:12]}-{i}" for i in itertools.count())

    # ---- lifecycle (event loop) -------------------------------------------------------

    def start(self) -> None:
        """Start the engine thread; call from the event loop that will consume outputs."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._engine_loop, name="radixserve-engine", daemon=True)
        self._thread.start()

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
        self._post(self._request_stop)
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        self._groups.clear()
        self._routes.clear()

    @property
    def healthy(self) -> bool:
        return self.broken_reason is None and self._thread is not None and self._thread.is_alive()

    @property
    def native_thread_id(self) -> int | None:
        """The engine thread's OS id (to read its CPU time in /proc), None before start."""
        return self._thread.native_id if self._thread is not None else None

    @property
    def num_queued(self) -> int:
        """Members submitted whose first output has not come yet."""
        return sum(g.num_not_started for g in self._groups.values())

    @property
    def num_in_flight(self) -> int:
        return sum(len(g.unfinished_request_ids()) for g in self._groups.values())

    # ---- requests (event loop) ----------------------------------------------------------

    async def submit(self, inputs: list[GenerationInput], timeout_s: float | None = None) -> RequestGroup:
        """Queue the members of one HTTP request together: either all are accepted or none.
        Raises APIError: 400 for input the engine refuses, 503 when full or stopping."""
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
        self._post(lambda: self._add_on_engine(group))
        try:
            await group.accepted()
        except BaseException:
            self._forget(group)
            group.abort()
            raise
        return group

    def run_on_engine(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future:
        """Run fn(engine) on the engine thread between steps; thread-safe. For tests and
        maintenance (check_integrity, flush_cache, stats)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        if self._thread is None or not self._thread.is_alive():
            future.set_exception(RuntimeError("the engine thread is not running"))
            return future

        def call() -> None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(self.engine))
                except BaseException as exc:  # handed to the caller
                    future.set_exception(exc)

        self._post(call)
        return future

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """Await fn(engine) run on the engine thread."""
        return await asyncio.wrap_future(self.run_on_engine(fn))

    # ---- event-loop helpers ------------------------------------------------------------

    def _check_accepting(self) -> None:
        if self.broken_reason is not None:
            raise unavailable(f"the engine failed and stopped: {self.broken_reason}", "engine_failed")
        if not self._accepting or not self.healthy:
            raise unavailable("the server is shutting down", "shutting_down")

    def _abort_in_engine(self, group: RequestGroup) -> None:
        ids = group.unfinished_request_ids()
        self._forget(group)
        if ids:
            self._post(lambda: self._abort_on_engine(ids))

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

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for output in outputs:
            route = self._routes.get(output.request_id)
            if route is None:
                continue  # aborted or failed meanwhile
            group, index = route
            group.push(index, output)
            if output.finished:
                self._routes.pop(output.request_id, None)
                self._observe_finished(group, index, output)
                if group.finished:
                    self._groups.pop(group.group_id, None)

    def _observe_finished(self, group: RequestGroup, index: int, output: RequestOutput) -> None:
        if self.on_finished is None or output.finish_reason == "abort":
            return
        try:
            self.on_finished(group.timing(index))
        except Exception:
            log.exception("on_finished hook failed")

    def _accept(self, group: RequestGroup) -> None:
        group.accept()

    def _reject(self, group: RequestGroup, exc: BaseException) -> None:
        self._forget(group)
        group.reject(_client_error(exc))

    def _fail(self, request_ids: list[str], error: APIError) -> None:
        for request_id in request_ids:
            route = self._routes.get(request_id)
            if route is not None:
                group = route[0]
                group.fail(error)
                self._abort_in_engine(group)

    def _mark_broken(self, reason: str) -> None:
        self.broken_reason = reason
        for group in list(self._groups.values()):
            group.fail(server_error(f"the engine failed: {reason}"))
            self._forget(group)

    # ---- engine thread ------------------------------------------------------------------

    def _post(self, fn: Callable[[], None]) -> None:
        self._inbox.put(fn)
        self._wake.set()

    def _to_loop(self, fn: Callable[..., None], *args: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # the loop closed during shutdown: nobody is waiting any more
            pass

    def _engine_loop(self) -> None:
        clean_exit = False
        try:
            while not self._stop_requested:
                try:
                    self._iterate()
                except Exception as exc:
                    log.exception("engine loop failed; failing the requests in flight")
                    self._recover(exc)
            clean_exit = True
        finally:
            self._stop_requested = True
            self._drain_inbox()
            try:
                self._abort_everything()
            except Exception:
                log.exception("aborting the remaining requests at shutdown failed")
            if not clean_exit:
                self._to_loop(self._mark_broken, "the engine thread exited unexpectedly")

    def _iterate(self) -> None:
        self._drain_inbox()
        if self._stop_requested:
            return
        if self.engine.has_unfinished_requests():
            self._step()
        else:
            self._wake.wait()
            self._wake.clear()

    def _drain_inbox(self) -> None:
        while True:
            try:
                fn = self._inbox.get_nowait()
            except queue.Empty:
                return
            try:
                fn()
            except Exception as exc:
                log.exception("engine-thread task failed")
                self._recover(exc)

    def _step(self) -> None:
        outputs = self.engine.step()
        for output in outputs:
            if output.finished:
                self._active_ids.discard(output.request_id)
        if outputs:
            self._to_loop(self._deliver, outputs)
        self.latest_stats = self.engine.stats()

    def _recover(self, exc: Exception) -> None:
        failed = sorted(self._active_ids)
        reason = f"{type(exc).__name__}: {exc}"
        try:
            self._abort_everything()
            self.engine.check_integrity()
        except Exception as second:
            log.exception("the engine is inconsistent after a failed step; stopping")
            self._stop_requested = True
            self._to_loop(self._mark_broken, f"{reason}; then {type(second).__name__}: {second}")
            return
        self.latest_stats = self.engine.stats()
        self._to_loop(self._fail, failed, server_error(f"the engine failed on this request: {reason}"))

    def _add_on_engine(self, group: RequestGroup) -> None:
        if self._stop_requested:
            self._to_loop(self._reject, group, unavailable("the server is shutting down", "shutting_down"))
            return
        added: list[str] = []
        templated: dict[ChatPrompt, list[int]] = {}
        try:
            for request_id, item in zip(group.request_ids, group.inputs):
                prompt = item.prompt
                if isinstance(prompt, ChatPrompt):
                    if prompt not in templated:
                        templated[prompt] = self.engine.apply_chat_template(list(prompt.messages))
                    prompt = templated[prompt]
                self.engine.add_request(prompt, item.params, request_id, item.cache_salt)
                added.append(request_id)
                self._active_ids.add(request_id)
        except Exception as exc:
            self._abort_on_engine(added)
            self._to_loop(self._reject, group, exc)
            return
        self.latest_stats = self.engine.stats()
        self._to_loop(self._accept, group)

    def _abort_on_engine(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            if request_id in self._active_ids:
                self._active_ids.discard(request_id)
                self.engine.abort(request_id)
        self.latest_stats = self.engine.stats()

    def _abort_everything(self) -> None:
        self._abort_on_engine(sorted(self._active_ids))

    def _request_stop(self) -> None:
        self._stop_requested = True


def _client_error(exc: BaseException) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ValueError):
        return bad_request(str(exc))
    if type(exc).__module__.startswith("jinja2"):
        return bad_request(f"the chat template could not render these messages: {exc}", param="messages")
    log.error("unexpected error while queueing a request", exc_info=exc)
    return server_error(f"{type(exc).__name__}: {exc}")

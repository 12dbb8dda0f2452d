"""EngineLoop: the one thread that steps an Engine; the server and the DSL both drive it.

Other threads post work to an inbox that the loop drains before every step: prepared
requests to admit (`submit`), functions to run on the engine (`call`), aborts. Outputs go
back through each submission's listener, called on the engine thread (it must only hand
the output over, e.g. put it in a queue), each carrying its delta as the engine built it:
what the step added to the request's previous output (a step may append several tokens: a
speculative step's are one output). With no work the thread sleeps on an Event.

One recovery rule: when a step (or an admission) fails, every request in flight is
aborted and its listener gets the error; then the engine's integrity is checked. If the
check fails the engine is inconsistent: the loop marks it broken and stops, and every
later submit or call fails with EngineBrokenError.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from radixserve.kernels.heap import return_freed_memory
from radixserve.kernels.openmp_pool import release_thread_pool
from radixserve.outputs import RequestOutput

if TYPE_CHECKING:
    from radixserve.engine.protocol import EngineProtocol
    from radixserve.engine.inputs import PreparedRequest
    from radixserve.engine.stats import EngineStats

log = logging.getLogger("radixserve.engine.loop")

T = TypeVar("T")
IDLE_TRIM_S = 1.0  # idle this long after working: the freed heap goes back to the system
BUSY_TRIM_S = 30.0  # and at most this long apart while the engine works without pause (a trim takes ~1-10 ms)
# While requests run, the stats snapshot is taken at most this far apart, and after every step
# that finishes one (a client that got a whole reply sees its step in the stats), and before
# the loop idles: a snapshot is ~16 us of Python, ~45 us after a batch-1 step's weight stream.
STATS_REFRESH_S = 0.05
Listener = Callable[[RequestOutput | BaseException], None]


class EngineStoppedError(RuntimeError):
    """The loop is shut down (or stopping): it takes no more work."""


class EngineBrokenError(RuntimeError):
    """The engine failed a step and then its integrity check: it serves nothing more."""


class RequestFailedError(RuntimeError):
    """A step failed while this request was in flight; it was aborted."""


@dataclass
class _Task:
    run: Callable[[], None]
    fail: Callable[[BaseException], None]  # when the loop is broken before the task runs


_live_loops: "weakref.WeakSet[EngineLoop]" = weakref.WeakSet()


class EngineLoop:
    """Steps `engine` on a thread of its own (started here) and serves it to any thread."""

    def __init__(self, engine: EngineProtocol, name: str = "radixserve-engine"):
        self.engine = engine
        self.broken_reason: str | None = None
        self.latest_snapshot: EngineStats = engine.snapshot()  # refreshed by the engine thread
        self._inbox: queue.SimpleQueue[_Task] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._closing = False  # set under _lock; once set nothing more is posted
        self._listeners: dict[str, Listener] = {}  # engine thread only
        self._worked = False  # engine thread: stepped since the heap was last trimmed
        self._trimmed_at = time.monotonic()
        self._stats_at = 0.0  # engine thread: when latest_snapshot was taken
        self._stats_stale = False  # engine thread: a step ran since it was
        self.heap_trims = 0  # times an idle loop handed freed heap back
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        release_thread_pool()  # the parallel work moves to the loop's thread (openmp_pool.py)
        self._thread.start()
        _live_loops.add(self)

    # ---- any thread ----------------------------------------------------------------------

    def submit(
        self, prepared: Sequence["PreparedRequest"], listener: Listener, request_ids: Sequence[str] | None = None,
        handoffs: Sequence[Any] | None = None,
    ) -> concurrent.futures.Future[list[str]]:
        """Admit prepared requests together (they join the same step): either all or none.
        The future gives their ids, or the error: ValueError for one the engine refuses,
        EngineStoppedError / EngineBrokenError when the loop takes no more work. From then on
        `listener` gets every output of these requests, or the exception that failed one.
        `handoffs` (one per request, or None) are KV handoffs of prompts another engine
        computed (Engine.admit_handoff): such a request's first output is its handoff's token."""
        prepared = list(prepared)
        ids = list(request_ids) if request_ids is not None else [None] * len(prepared)
        if len(ids) != len(prepared):
            raise ValueError(f"got {len(ids)} request ids for {len(prepared)} requests")
        handoffs = list(handoffs) if handoffs is not None else [None] * len(prepared)
        return self._post_call(lambda: self._admit_all(prepared, ids, listener, handoffs))

    def call(self, fn: Callable[[EngineProtocol], T]) -> concurrent.futures.Future[T]:
        """Run fn(engine) on the engine thread between steps; the stats snapshot is
        refreshed before the result is handed back (fn may close a session, pin, flush)."""
        return self._post_call(lambda: self._call(fn))

    def abort(self, request_ids: Sequence[str]) -> None:
        """Stop these requests if still running and free their blocks; does not wait. Their
        listeners hear nothing more."""
        ids = list(request_ids)
        self._post(_Task(lambda: self._abort(ids, None), lambda exc: None))

    def shutdown(self, timeout_s: float = 60.0) -> None:
        """Take no more work, abort every request left (listeners get EngineStoppedError),
        and join the thread (unless called from it). Idempotent."""
        with self._lock:
            self._closing = True
        self._wake.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)

    @property
    def healthy(self) -> bool:
        return self.broken_reason is None and not self._closing and self._thread.is_alive()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def native_thread_id(self) -> int | None:
        """The engine thread's OS id (to read its CPU time in /proc)."""
        return self._thread.native_id

    @property
    def num_in_flight(self) -> int:
        """Requests submitted through the loop and not yet finished (approximate off-thread)."""
        return len(self._listeners)

    # ---- posting ----------------------------------------------------------------------

    def _post_call(self, fn: Callable[[], T]) -> concurrent.futures.Future[T]:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()

        def run() -> None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn())
                except BaseException as exc:  # handed to the caller
                    future.set_exception(exc)

        def fail(exc: BaseException) -> None:
            if future.set_running_or_notify_cancel():
                future.set_exception(exc)

        if not self._post(_Task(run, fail)):
            fail(self._refusal())
        return future

    def _post(self, task: _Task) -> bool:
        with self._lock:
            if self._closing:
                return False
            self._inbox.put(task)
        self._wake.set()
        return True

    def _refusal(self) -> RuntimeError:
        if self.broken_reason is not None:
            return EngineBrokenError(f"the engine failed and stopped: {self.broken_reason}")
        return EngineStoppedError("the engine loop is shut down")

    # ---- engine thread ------------------------------------------------------------------

    def _main(self) -> None:
        try:
            while not self._closing:
                self._drain()
                if self._closing:
                    break
                if self.engine.has_unfinished_requests():
                    self._step()
                    self._worked = True
                    if time.monotonic() - self._trimmed_at >= BUSY_TRIM_S:
                        self._trim()
                else:
                    self._idle()
        except BaseException as exc:  # a bug in the loop itself: nothing can be trusted now
            log.exception("the engine loop failed")
            self._break(f"the engine loop failed: {type(exc).__name__}: {exc}")
        finally:
            with self._lock:
                self._closing = True
            self._drain()
            if self.broken_reason is None:
                self._abort(list(self._listeners), EngineStoppedError("the engine loop shut down"))
            else:  # the engine is not to be touched any more
                left, self._listeners = self._listeners, {}
                for listener in left.values():
                    _notify(listener, self._refusal())

    def _idle(self) -> None:
        """Wait for work. Once the engine has sat idle for IDLE_TRIM_S after working, the heap
        its steps freed goes back to the system first (kernels/heap.py; a busy engine does
        that every BUSY_TRIM_S, so its resident memory follows what it holds, not its peak)."""
        if self._stats_stale:
            self._refresh_stats()
        if self._worked and not self._wake.wait(IDLE_TRIM_S):
            self._trim()
        self._wake.wait()
        self._wake.clear()

    def _trim(self) -> None:
        self._worked, self._trimmed_at = False, time.monotonic()
        self.heap_trims += return_freed_memory()

    def _drain(self) -> None:
        while True:
            try:
                task = self._inbox.get_nowait()
            except queue.Empty:
                return
            if self.broken_reason is not None:
                task.fail(self._refusal())
                continue
            try:
                task.run()
            except Exception as exc:  # aborts never raise to here unless the engine is off
                log.exception("engine-thread task failed")
                self._recover(exc)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            log.exception("engine step failed; failing the requests in flight")
            self._recover(exc)
            return
        self._stats_stale = True
        if any(o.finished for o in outputs) or time.monotonic() - self._stats_at >= STATS_REFRESH_S:
            self._refresh_stats()  # before the outputs go out: whoever a finished one reaches sees its step
        self._emit(outputs)

    def _call(self, fn: Callable[[EngineProtocol], T]) -> T:
        try:
            return fn(self.engine)
        finally:
            self._refresh_stats()

    def _admit_all(
        self, prepared: list["PreparedRequest"], ids: list[str | None], listener: Listener, handoffs: list[Any]
    ) -> list[str]:
        if self._closing:
            raise self._refusal()
        added: list[str] = []
        firsts: list[RequestOutput] = []
        try:
            for item, request_id, handoff in zip(prepared, ids, handoffs):
                if handoff is None:
                    added.append(self.engine.admit(item, request_id))
                    continue
                request_id, first = self.engine.admit_handoff(item, handoff, request_id)
                added.append(request_id)
                if first is not None:
                    firsts.append(first)
        except BaseException as exc:
            for request_id in added:
                self.engine.abort(request_id)
            if not isinstance(exc, ValueError):
                self._check_or_break(f"{type(exc).__name__}: {exc}")
            raise
        for request_id in added:
            self._listeners[request_id] = listener
        self._refresh_stats()
        if firsts:  # after the caller learns the ids: the next task, before the next step
            self._post(_Task(lambda: self._emit(firsts), lambda exc: None))
        return added

    def _emit(self, outputs: list[RequestOutput]) -> None:
        """Hand each output (with the delta the engine gave it: O(what the step added)) to
        its request's listener."""
        for output in outputs:
            listener = self._listeners.get(output.request_id)
            if listener is None:
                continue
            if output.finished:
                del self._listeners[output.request_id]
            _notify(listener, output)

    def _recover(self, exc: BaseException) -> None:
        """The one recovery rule: fail and abort what is in flight, then check integrity."""
        reason = f"{type(exc).__name__}: {exc}"
        failed = self._listeners
        self._listeners = {}
        for request_id in failed:
            try:
                self.engine.abort(request_id)
            except Exception:
                log.exception("aborting %s after a failed step failed", request_id)
        # Requests admitted without a listener (through call) are in flight too.
        for request_id in self.engine.unfinished_request_ids():
            try:
                self.engine.abort(request_id)
            except Exception:
                log.exception("aborting %s after a failed step failed", request_id)
        intact = self._check_or_break(reason)
        message = f"the engine failed on this request: {reason}"
        if not intact:
            message = f"the engine failed: {self.broken_reason}"
        error = RequestFailedError(message)
        error.__cause__ = exc
        for listener in failed.values():
            _notify(listener, error)

    def _check_or_break(self, reason: str) -> bool:
        try:
            self.engine.check_integrity()
        except Exception as second:
            log.exception("the engine is inconsistent after a failure; stopping")
            self._break(f"{reason}; then {type(second).__name__}: {second}")
            return False
        self._refresh_stats()
        return True

    def _break(self, reason: str) -> None:
        if self.broken_reason is None:
            self.broken_reason = reason
        with self._lock:
            self._closing = True

    def _abort(self, request_ids: list[str], reason: BaseException | None) -> None:
        for request_id in request_ids:
            listener = self._listeners.pop(request_id, None)
            if listener is None:
                continue
            try:
                self.engine.abort(request_id)
            except Exception:
                log.exception("aborting %s failed", request_id)
            if reason is not None:
                _notify(listener, reason)
        self._refresh_stats()

    @property
    def latest_stats(self) -> dict[str, Any]:
        """The latest snapshot as the flat dictionary of Engine.stats()."""
        return self.latest_snapshot.as_dict()

    def _refresh_stats(self) -> None:
        self._stats_at, self._stats_stale = time.monotonic(), False
        try:
            self.latest_snapshot = self.engine.snapshot()
        except Exception:
            log.exception("reading the engine's stats failed")


def _notify(listener: Listener, item: RequestOutput | BaseException) -> None:
    try:
        listener(item)
    except Exception:
        log.exception("an output listener failed")


@atexit.register
def _shutdown_live_loops() -> None:
    """Join every engine thread before the interpreter tears down: a daemon thread still
    inside torch at exit can abort the process ("terminate called without an active exception")."""
    for loop in list(_live_loops):
        loop.shutdown(timeout_s=30.0)

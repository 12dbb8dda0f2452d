"""EngineThread: an Engine stepped on a thread of its own, fed by any number of threads.

The Engine is not thread-safe, so only this thread touches it. Other threads post
callables to an inbox (drained before every step) and get outputs back through listener
callbacks, which run on the engine thread and must only hand the output over (e.g. put it
in a queue). With no work the thread sleeps on an Event.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

from radixserve.outputs import RequestOutput
from radixserve.sampling_params import SamplingParams

log = logging.getLogger("radixserve.lang")

Listener = Callable[[RequestOutput | BaseException], None]


class EngineThread:
    """`submit` requests from any thread; their listener sees every output, or the exception
    that failed them. `shutdown` aborts what is left and joins the thread."""

    def __init__(self, engine: Any):
        self.engine = engine
        self._inbox: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._listeners: dict[str, Listener] = {}  # engine thread only
        self._stopping = False  # set under _lock: after it, nothing more is posted
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="radixserve-lang-engine", daemon=True)
        self._thread.start()

    def submit(self, prompts: list[list[int]], params: list[SamplingParams], listener: Listener) -> list[str]:
        """Queue requests together, so they join the same step; blocks until they are queued.
        Raises ValueError (and queues none) if the engine refuses one."""
        return self.call(lambda engine: self._add(engine, prompts, params, listener)).result()

    def call(self, fn: Callable[[Any], Any]) -> concurrent.futures.Future:
        """Run fn(engine) on the engine thread between steps."""
        future: concurrent.futures.Future = concurrent.futures.Future()

        def run() -> None:
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(self.engine))
                except BaseException as exc:  # handed to the caller
                    future.set_exception(exc)

        if not self._post(run):
            future.set_exception(RuntimeError("the runtime is shut down"))
        return future

    def abort(self, request_ids: list[str]) -> None:
        """Stop these requests (if still running) and free their blocks; does not wait."""
        self._post(lambda: self._abort(request_ids, None))

    def shutdown(self, timeout_s: float = 60.0) -> None:
        """Abort every request left (their listeners get a RuntimeError) and join the thread."""
        self._post(self._request_stop)
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    # ---- engine thread --------------------------------------------------------------------

    def _post(self, fn: Callable[[], None]) -> bool:
        with self._lock:
            if self._stopping:
                return False
            self._inbox.put(fn)
        self._wake.set()
        return True

    def _loop(self) -> None:
        try:
            while not self._stopping:
                self._drain_inbox()
                if self._stopping:
                    break
                if self.engine.has_unfinished_requests():
                    self._step()
                else:
                    self._wake.wait()
                    self._wake.clear()
        finally:
            self._request_stop()
            self._drain_inbox()
            self._abort(list(self._listeners), RuntimeError("the runtime shut down"))

    def _drain_inbox(self) -> None:
        while True:
            try:
                fn = self._inbox.get_nowait()
            except queue.Empty:
                return
            fn()

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            log.exception("engine step failed; failing the requests in flight")
            self._abort(list(self._listeners), exc)
            return
        for output in outputs:
            listener = self._listeners.get(output.request_id)
            if listener is None:
                continue
            if output.finished:
                del self._listeners[output.request_id]
            listener(output)

    def _add(self, engine: Any, prompts: list[list[int]], params: list[SamplingParams], listener: Listener) -> list[str]:
        added: list[str] = []
        try:
            for prompt, sp in zip(prompts, params, strict=True):
                added.append(engine.add_request(prompt, sp))
        except BaseException:
            for request_id in added:
                engine.abort(request_id)
            raise
        for request_id in added:
            self._listeners[request_id] = listener
        return added

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
                listener(reason)

    def _request_stop(self) -> None:
        with self._lock:
            self._stopping = True

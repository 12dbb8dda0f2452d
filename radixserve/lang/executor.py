"""SerialExecutor: runs one state's queued work in order, off the program's thread.

`s += expr` only queues, so forked branches and streaming readers run concurrently with the
program; reading a variable waits for the queue. A worker thread lives while there is work.
After a task fails, the queued rest is dropped and the error is kept for the next reader.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable


class SerialExecutor:
    """Tasks run one at a time in submission order; `wait` blocks until all have run."""

    def __init__(self, condition: threading.Condition, name: str):
        self._cond = condition  # shared with the state, notified on every change of `busy`
        self._name = name
        self._tasks: deque[Callable[[], None]] = deque()
        self._running = False
        self.error: BaseException | None = None

    def submit(self, task: Callable[[], None]) -> None:
        with self._cond:
            if self.error is not None:
                return  # the state failed: later work has nothing to build on
            self._tasks.append(task)
            if not self._running:
                self._running = True
                threading.Thread(target=self._drain, name=self._name, daemon=True).start()

    @property
    def busy(self) -> bool:
        """Work is queued or running (read under the condition)."""
        return self._running

    def wait(self, timeout_s: float | None = None) -> None:
        """Block until the queue is empty; re-raise the error of a failed task."""
        with self._cond:
            if not self._cond.wait_for(lambda: not self._running, timeout_s):
                raise TimeoutError(f"{self._name}: still running after {timeout_s} s")
            if self.error is not None:
                raise self.error

    def _drain(self) -> None:
        while True:
            with self._cond:
                if not self._tasks or self.error is not None:
                    self._tasks.clear()
                    self._running = False
                    self._cond.notify_all()
                    return
                task = self._tasks.popleft()
            try:
                task()
            except BaseException as exc:  # kept for the reader
                with self._cond:
                    self.error = exc

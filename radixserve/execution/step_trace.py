"""StepTrace: one JSON line per engine step, written by its own thread.

The engine thread only queues a small dict per step; the file writes (disk I/O) happen on
the trace's thread, so a slow disk never slows a step. Each line: when the step ended
(time.monotonic, the clock every process on the machine shares, so a client can line its
own timestamps up with it), its ms, and its decode and prompt tokens.
"""

from __future__ import annotations

import atexit
import json
import logging
import queue
import threading
import time

log = logging.getLogger("radixserve.step_trace")


class StepTrace:
    def __init__(self, path: str):
        self.path = path
        self._file = open(path, "a")  # a bad path fails here, before the engine starts
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._failed = False
        self._thread = threading.Thread(target=self._write_loop, name="radixserve-step-trace", daemon=True)
        self._thread.start()
        atexit.register(self.close)  # what is queued reaches the file at a normal exit too

    def record(self, decode_tokens: int, prefill_tokens: int, step_ms: float) -> None:
        if not self._failed:
            self._queue.put({"end": time.monotonic(), "ms": round(step_ms, 3), "decode": decode_tokens,
                             "prefill": prefill_tokens})

    def close(self) -> None:
        """Write what is queued, stop the thread, close the file (idempotent)."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
        try:
            self._file.close()
        except OSError as exc:  # the last flush
            log.warning("step trace %s: %s", self.path, exc)

    def _write_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            if self._failed:
                continue
            try:
                self._file.write(json.dumps(item) + "\n")
                if self._queue.empty():
                    self._file.flush()  # readers see every step so far
            except (OSError, ValueError) as exc:
                log.warning("step trace %s off: %s", self.path, exc)
                self._failed = True

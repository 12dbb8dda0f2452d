"""ProgramState: one run of a program: its text, chat messages, variables and scores.

`s += expr` queues the expression on the state's own executor and returns at once; reading
(`s["name"]`, `s.text()`, ...) waits until everything queued so far has run. So the
branches of a `fork` run concurrently and the backend batches their calls.
"""

from __future__ import annotations

import copy
import itertools
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from radixserve.lang.choice_scoring import SelectResult
from radixserve.lang.executor import SerialExecutor
from radixserve.lang.expr import to_ops
from radixserve.lang.text_stream import TextStream

if TYPE_CHECKING:
    from radixserve.lang.backend import Backend
    from radixserve.lang.fork import ForkGroup

_state_ids = itertools.count()


@dataclass
class OpenMessage:
    """A message whose role marker was written and whose end marker is still owed."""

    role: str
    end_marker: str
    content: str = ""


class ProgramState:
    """Text, messages and variables of one program run (see the module docstring)."""

    def __init__(self, backend: "Backend", defaults: dict[str, Any] | None = None, stream: bool = False):
        self.backend = backend
        self.defaults = dict(defaults or {})  # sampling options for gens that do not set them
        self.streaming = stream  # gens hand their text to text_iter as it decodes
        self.ret_value: Any = None  # what the program function returned (set by run / run_batch)
        self._cond = threading.Condition()
        self._executor = SerialExecutor(self._cond, f"radixserve-program-{next(_state_ids)}")
        self._stream = TextStream(self._cond)
        self._text = ""
        self._messages: list[dict[str, str]] = []
        self._open: OpenMessage | None = None
        self._variables: dict[str, Any] = {}
        self._meta: dict[str, dict[str, Any]] = {}
        self._scores: dict[str, SelectResult] = {}
        self._set_since_fork: list[str] = []  # variable names, in the order they were set

    # ---- writing -----------------------------------------------------------------------

    def __iadd__(self, expr: Any) -> "ProgramState":
        from radixserve.lang.interpreter import run_ops

        ops = to_ops(expr)
        self._executor.submit(lambda: run_ops(self, ops))
        return self

    def fork(self, n: int = 1) -> "ForkGroup":
        """n child states that continue from this one's text (sharing its prefix blocks in
        the cache); `join()` the group to collect their variables here as lists."""
        from radixserve.lang.fork import ForkGroup

        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"fork needs a positive number of branches, got {n!r}")
        self.sync()
        return ForkGroup(self, [self._child() for _ in range(n)])

    # ---- reading (each waits for the queued work) ------------------------------------------

    def __getitem__(self, name: str) -> Any:
        return self.get_var(name)

    def get_var(self, name: str) -> Any:
        self.sync()
        with self._cond:
            if name not in self._variables:
                known = ", ".join(sorted(self._variables)) or "none"
                raise KeyError(f"no variable {name!r} in this state (it has: {known})")
            return self._variables[name]

    def __contains__(self, name: str) -> bool:
        self.sync()
        return name in self._variables

    def variables(self) -> dict[str, Any]:
        self.sync()
        with self._cond:
            return dict(self._variables)

    def text(self) -> str:
        """The whole text so far: every message with its chat-template markers, every gen."""
        self.sync()
        return self._text

    def messages(self) -> list[dict[str, str]]:
        """The chat messages written so far (an open one is not included)."""
        self.sync()
        with self._cond:
            return copy.deepcopy(self._messages)

    def get_meta_info(self, name: str) -> dict[str, Any]:
        """A gen's finish_reason, prompt/cached/completion tokens; a select's scores."""
        self.sync()
        with self._cond:
            return dict(self._meta[name])

    def scores(self, name: str) -> SelectResult:
        """The scores of select `name`: per-choice total and normalized log-probabilities."""
        self.sync()
        with self._cond:
            return self._scores[name]

    def text_iter(self, name: str | None = None) -> Iterator[str]:
        """The text as it is appended (gens as they decode when run with stream=True); with
        `name`, only the text of that gen. Ends when the queued work is done."""
        yield from self._stream.iterate(name, lambda: self._executor.busy)
        if self._executor.error is not None:
            raise self._executor.error

    def sync(self, timeout_s: float | None = None) -> None:
        """Wait for the queued work; raises the error that stopped it, if any."""
        self._executor.wait(timeout_s)

    def error(self) -> BaseException | None:
        """The error that stopped this state's work, or None (waits for the work first)."""
        try:
            self.sync()
        except BaseException as exc:
            return exc
        return None

    def __repr__(self) -> str:
        with self._cond:
            text = self._text if len(self._text) <= 80 else "..." + self._text[-77:]
            return f"ProgramState(variables={sorted(self._variables)}, text={text!r})"

    # ---- used by the interpreter and fork (on the state's executor thread) ------------------

    def _append(self, text: str, stream: bool = True) -> None:
        with self._cond:
            self._text += text
            if self._open is not None:
                self._open.content += text
        if stream:
            self._stream.push(text)

    def _append_marker(self, text: str) -> None:
        """Chat-template text: part of the prompt, not of any message's content."""
        with self._cond:
            self._text += text
        self._stream.push(text)

    def _set_var(self, name: str, value: Any, meta: dict[str, Any], scores: SelectResult | None = None) -> None:
        with self._cond:
            self._variables[name] = value
            self._meta[name] = meta
            if scores is not None:
                self._scores[name] = scores
            if name in self._set_since_fork:
                self._set_since_fork.remove(name)
            self._set_since_fork.append(name)

    def _fail(self, exc: BaseException) -> None:
        """Record an error raised by the program function itself."""
        with self._cond:
            if self._executor.error is None:
                self._executor.error = exc

    def _child(self) -> "ProgramState":
        child = ProgramState(self.backend, self.defaults, self.streaming)
        with self._cond:
            child._text = self._text
            child._messages = copy.deepcopy(self._messages)
            child._open = copy.copy(self._open)
            child._variables = dict(self._variables)
            child._meta = dict(self._meta)
            child._scores = dict(self._scores)
        return child

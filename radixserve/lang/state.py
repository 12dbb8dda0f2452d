"""ProgramState: one run of a program: its text, chat messages, variables and scores.

`s += expr` queues the expression on the state's own executor and returns at once; reading
(`s["name"]`, `s.text()`, ...) waits until everything queued so far has run. So the
branches of a `fork` run concurrently and the backend batches their calls.

Imports go one way: this module uses the interpreter (to run ops), the fork group and
the record; none of those imports this one.
"""

from __future__ import annotations

import copy
import itertools
import threading
from collections.abc import Iterator
from typing import Any

from radixserve.lang.backend import Backend
from radixserve.lang.choice_scoring import SelectResult
from radixserve.lang.executor import SerialExecutor
from radixserve.lang.expr import to_ops
from radixserve.lang.fork import ForkGroup
from radixserve.lang.interpreter import Interpreter
from radixserve.lang.record import StateRecord

_state_ids = itertools.count()


class ProgramState:
    """Text, messages and variables of one program run (see the module docstring)."""

    def __init__(
        self, backend: Backend, defaults: dict[str, Any] | None = None, stream: bool = False,
        session_id: str | None = None,
    ):
        self.ret_value: Any = None  # what the program function returned (set by run / run_batch)
        self._interpreter = Interpreter(backend, dict(defaults or {}), stream, session_id)
        self._cond = threading.Condition()
        self._executor = SerialExecutor(self._cond, f"radixserve-program-{next(_state_ids)}")
        self._record = StateRecord(self._cond)

    @property
    def backend(self) -> Backend:
        return self._interpreter.backend

    @property
    def defaults(self) -> dict[str, Any]:
        """Sampling options for the gens that do not set them."""
        return self._interpreter.defaults

    @property
    def streaming(self) -> bool:
        """Gens hand their text to text_iter as it decodes."""
        return self._interpreter.streaming

    # ---- writing -----------------------------------------------------------------------

    def __iadd__(self, expr: Any) -> "ProgramState":
        ops = to_ops(expr)
        self._executor.submit(lambda: self._interpreter.run(self._record, ops))
        return self

    def fork(self, n: int = 1) -> ForkGroup["ProgramState"]:
        """n child states that continue from this one's text (sharing its prefix blocks in
        the cache); `join()` the group to collect their variables here as lists."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"fork needs a positive number of branches, got {n!r}")
        self.sync()
        return ForkGroup(self._record, [self._child() for _ in range(n)])

    # ---- reading (each waits for the queued work) ------------------------------------------

    def __getitem__(self, name: str) -> Any:
        return self.get_var(name)

    def get_var(self, name: str) -> Any:
        self.sync()
        with self._cond:
            variables = self._record.variables
            if name not in variables:
                known = ", ".join(sorted(variables)) or "none"
                raise KeyError(f"no variable {name!r} in this state (it has: {known})")
            return variables[name]

    def __contains__(self, name: str) -> bool:
        self.sync()
        return name in self._record.variables

    def variables(self) -> dict[str, Any]:
        self.sync()
        with self._cond:
            return dict(self._record.variables)

    def text(self) -> str:
        """The whole text so far: every message with its chat-template markers, every gen."""
        self.sync()
        return self._record.text

    def messages(self) -> list[dict[str, str]]:
        """The chat messages written so far (an open one is not included)."""
        self.sync()
        with self._cond:
            return copy.deepcopy(self._record.messages)

    def get_meta_info(self, name: str) -> dict[str, Any]:
        """A gen's finish_reason, prompt/cached/completion tokens; a select's scores."""
        self.sync()
        with self._cond:
            return dict(self._record.meta[name])

    def tool_calls(self, name: str) -> list[Any]:
        """The tool calls gen `name` made (a gen with tool_choice): each a ToolCall with its
        `name`, `arguments` as the JSON text written and `parsed`, that text as a value."""
        return list(self.get_meta_info(name).get("tool_calls", []))

    def scores(self, name: str) -> SelectResult:
        """The scores of select `name`: per-choice total and normalized log-probabilities."""
        self.sync()
        with self._cond:
            return self._record.scores[name]

    def text_iter(self, name: str | None = None) -> Iterator[str]:
        """The text as it is appended (gens as they decode when run with stream=True); with
        `name`, only the text of that gen. Ends when the queued work is done."""
        yield from self._record.stream.iterate(name, lambda: self._executor.busy)
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
            text = self._record.text
            text = text if len(text) <= 80 else "..." + text[-77:]
            return f"ProgramState(variables={sorted(self._record.variables)}, text={text!r})"

    # ---- used by run_batch -----------------------------------------------------------------

    def _fail(self, exc: BaseException) -> None:
        """Record an error raised by the program function itself."""
        with self._cond:
            if self._executor.error is None:
                self._executor.error = exc

    def _child(self) -> "ProgramState":
        child = ProgramState(self.backend, self.defaults, self.streaming)
        child._record = self._record.branch(child._cond)
        return child

"""StateRecord: what one program run has written so far: text, chat messages, variables.

The interpreter writes it (on the state's executor thread), ProgramState reads it, and a
fork's join gathers the branches' variables into the parent's. This module imports no
other part of the state machinery, so each of those can import it.
"""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass
from typing import Any

from radixserve.lang.choice_scoring import SelectResult
from radixserve.lang.text_stream import TextStream


@dataclass
class OpenMessage:
    """A message whose role marker was written and whose end marker is still owed."""

    role: str
    end_marker: str
    content: str = ""


class StateRecord:
    """Text, messages, variables (with their meta and select scores) and the text stream.

    `cond` guards every field; it is the state's condition, shared with its executor.
    """

    def __init__(self, cond: threading.Condition):
        self.cond = cond
        self.stream = TextStream(cond)
        self.text = ""
        self.messages: list[dict[str, str]] = []
        self.open: OpenMessage | None = None
        self.tools: tuple[Any, ...] = ()  # the conversation's tools (rl.tools), as ToolDefinitions
        self.variables: dict[str, Any] = {}
        self.meta: dict[str, dict[str, Any]] = {}
        self.scores: dict[str, SelectResult] = {}
        self.set_since_fork: list[str] = []  # variable names, in the order they were set

    def append(self, text: str, stream: bool = True) -> None:
        """Text of the program (and of the open message, if any)."""
        with self.cond:
            self.text += text
            if self.open is not None:
                self.open.content += text
        if stream:
            self.stream.push(text)

    def append_marker(self, text: str) -> None:
        """Chat-template text: part of the prompt, not of any message's content."""
        with self.cond:
            self.text += text
        self.stream.push(text)

    def set_var(self, name: str, value: Any, meta: dict[str, Any], scores: SelectResult | None = None) -> None:
        with self.cond:
            self.variables[name] = value
            self.meta[name] = meta
            if scores is not None:
                self.scores[name] = scores
            if name in self.set_since_fork:
                self.set_since_fork.remove(name)
            self.set_since_fork.append(name)

    def branch(self, cond: threading.Condition) -> "StateRecord":
        """A copy for a fork's child (guarded by the child's `cond`): same text, messages
        and variables, an empty stream, and no variable set since the fork."""
        child = StateRecord(cond)
        with self.cond:
            child.text = self.text
            child.messages = copy.deepcopy(self.messages)
            child.open = copy.copy(self.open)
            child.tools = self.tools
            child.variables = dict(self.variables)
            child.meta = dict(self.meta)
            child.scores = dict(self.scores)
        return child

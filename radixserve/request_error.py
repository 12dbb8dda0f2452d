"""InvalidRequest: a request refused for what it asks, naming the field at fault (`param`), as
the layers below the server raise it (tool definitions, a history's tool results, a chat
template that cannot render the conversation). A ValueError, as the engine's other refusals;
the server answers it as a 400 naming `param`."""

from __future__ import annotations


class InvalidRequest(ValueError):
    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code

"""POST /v1/sessions/{session_id}/close and /v1/sessions/pin: their request bodies (the
routes: radixserve/server/api/sessions.py)."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field

from radixserve.server.errors import bad_request
from radixserve.server.protocol.common import Integer, NativeModel

MAX_PIN_TTL_S = 7 * 24 * 3600


class CloseSessionRequest(NativeModel):
    cache_salt: str | None = Field(None, description="the cache_salt the session's requests used")


class ReleaseRequest(NativeModel):
    """What to release now: a session's hold, and the agent-hint holds and pins on its
    context and on a prefix (text or input_ids); at least one of them."""

    session_id: str | None = Field(None, min_length=1, max_length=256)
    text: str | None = Field(None, min_length=1)
    input_ids: Annotated[list[Integer], Field(min_length=1)] | None = None
    cache_salt: str | None = None

    def prompt(self) -> str | list[int] | None:
        if self.text is not None and self.input_ids is not None:
            raise bad_request("give at most one of 'text' and 'input_ids'", param="text")
        if self.text is None and self.input_ids is None and self.session_id is None:
            raise bad_request("give a 'session_id', a prefix ('text' or 'input_ids'), or both", param="session_id")
        return self.text if self.text is not None else (list(self.input_ids) if self.input_ids else None)


class PinPrefixRequest(NativeModel):
    text: str | None = Field(None, min_length=1)
    input_ids: Annotated[list[Integer], Field(min_length=1)] | None = None
    ttl_s: float = Field(gt=0, le=MAX_PIN_TTL_S, description="seconds the prefix stays pinned")
    cache_salt: str | None = None

    def prompt(self) -> str | list[int]:
        """The prefix to pin: exactly one of text and input_ids."""
        if (self.text is None) == (self.input_ids is None):
            raise bad_request("give exactly one of 'text' and 'input_ids'", param="text")
        return self.text if self.text is not None else list(self.input_ids)

"""POST /abort_request and /flush_cache: SGLang's request bodies (the routes:
radixserve/server/api/sglang.py)."""

from __future__ import annotations

from pydantic import Field

from radixserve.server.protocol.common import NativeModel


class AbortRequest(NativeModel):
    rid: str | None = Field(None, min_length=1)
    abort_all: bool = False


class FlushCacheRequest(NativeModel):
    """SGLang's /flush_cache takes no options; an empty object (or no body) is accepted."""

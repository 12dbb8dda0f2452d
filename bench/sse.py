"""The benches' one SSE client: the JSON payload of every `data:` event of a streamed answer
(OpenAI's framing: `data: {...}` lines, `data: [DONE]` at the end), sync or async."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator

import httpx


class StreamRefused(Exception):
    """The server answered the streamed request with another status than 200."""

    def __init__(self, status: int, body: bytes):
        super().__init__(f"{status}: {body[:200]!r}")
        self.status = status


def sse_json(line: str) -> dict | None:
    """The payload of one `data:` line; None for any other line and for [DONE]."""
    if not line.startswith("data: ") or line == "data: [DONE]":
        return None
    return json.loads(line[len("data: "):])


def stream_json(client: httpx.Client, path: str, body: dict) -> Iterator[dict]:
    """POST `body` with stream on; each event's payload as it arrives."""
    with client.stream("POST", path, json={**body, "stream": True}) as answer:
        if answer.status_code != 200:
            raise StreamRefused(answer.status_code, answer.read())
        for line in answer.iter_lines():
            chunk = sse_json(line)
            if chunk is not None:
                yield chunk


async def astream_json(client: httpx.AsyncClient, path: str, body: dict) -> AsyncIterator[dict]:
    """stream_json for an AsyncClient."""
    async with client.stream("POST", path, json={**body, "stream": True}) as answer:
        if answer.status_code != 200:
            raise StreamRefused(answer.status_code, await answer.aread())
        async for line in answer.aiter_lines():
            chunk = sse_json(line)
            if chunk is not None:
                yield chunk

"""The benches' one HTTP client side: the JSON payload of every `data:` event of a streamed answer
(OpenAI's framing: `data: {...}` lines, `data: [DONE]` at the end), sync or async; one streamed
greedy completion as the client saw it (`Record`, `complete`); Poisson arrival times."""

from __future__ import annotations

import json
import random
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field

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


@dataclass
class Record:
    """One request as the client saw it."""

    label: str
    sent: float
    first: float | None = None
    end: float | None = None
    chunks: list[float] = field(default_factory=list)  # when each chunk with text arrived
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    text: str = ""
    error: str | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first is None else self.first - self.sent

    @property
    def tpot(self) -> float | None:
        if self.first is None or self.end is None or self.completion_tokens < 2:
            return None
        return (self.end - self.first) / (self.completion_tokens - 1)

    @property
    def hit(self) -> bool:
        return self.cached_tokens >= self.prompt_tokens // 2


async def complete(client: httpx.AsyncClient, model: str, prompt: str | list[int], max_tokens: int, label: str,
                    url: str = "") -> Record:
    """One streaming greedy completion (EOS ignored) to `url` (default: the client's base URL)."""
    body = {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    record = Record(label, time.monotonic())
    try:
        async for chunk in astream_json(client, url + "/v1/completions", body):
            on_event(record, chunk)
    except StreamRefused as exc:
        record.error = str(exc)
        return record
    except httpx.HTTPError as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    record.end = time.monotonic()
    return record


def on_event(record: Record, chunk: dict) -> None:
    if "error" in chunk:
        record.error = chunk["error"]["message"]
        return
    for choice in chunk["choices"]:
        if record.first is None:
            record.first = time.monotonic()
        if choice["text"]:
            record.chunks.append(time.monotonic())
        record.text += choice["text"]
    usage = chunk.get("usage")
    if usage:
        record.prompt_tokens = usage["prompt_tokens"]
        record.completion_tokens = usage["completion_tokens"]
        record.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def arrivals(rng: random.Random, rate: float, n: int) -> list[float]:
    """Arrival offsets (s) of a Poisson process with `rate` arrivals per second."""
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out

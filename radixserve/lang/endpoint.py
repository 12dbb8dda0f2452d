"""Endpoint: a radixserve server as a backend, over its native POST /generate.

    backend = rl.Endpoint("http://127.0.0.1:30000")
    backend = rl.Endpoint(url, api_key="secret", tokenizer="/path/to/model-dir")

Programs render chat roles and tokenize on the client, with the server model's tokenizer:
by default the Endpoint asks /v1/models which model the server runs and loads its
tokenizer when it is the default model or a local directory; pass `tokenizer` (a path or a
tokenizer object) otherwise. Requests then carry token ids, so a program gives the same
tokens here as on a Runtime.
"""

from __future__ import annotations

import dataclasses
import json
import os
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

from radixserve.lang.backend import Backend, Completion, TextCallback
from radixserve.lang.choice_scoring import ScoreRequest
from radixserve.sampling_params import SamplingParams

_DEFAULT_PARAMS = SamplingParams()
_METRICS = {"radixserve_prompt_tokens": "prompt_tokens", "radixserve_cached_prompt_tokens": "cached_prompt_tokens",
            "radixserve_generated_tokens": "generated_tokens", "radixserve_computed_tokens": "computed_tokens"}


class EndpointError(RuntimeError):
    """The server answered with an error other than a 400 (a 400 raises ValueError)."""


class Endpoint(Backend):
    """Runs programs against `radixserve serve`. Thread-safe (one HTTP request per call)."""

    def __init__(self, url: str, api_key: str | None = None, tokenizer: Any = None, timeout_s: float = 600.0):
        self.url = url.rstrip("/")
        self.api_key = api_key
        self.timeout_s = timeout_s
        self._tokenizer = tokenizer
        self._lock = threading.Lock()

    @property
    def tokenizer(self) -> Any:
        with self._lock:
            if self._tokenizer is None or isinstance(self._tokenizer, (str, os.PathLike)):
                self._tokenizer = _load_tokenizer(self._tokenizer or self._served_model_dir())
            return self._tokenizer

    def generate(
        self, prompt_ids: list[int], params: SamplingParams, on_text: TextCallback | None = None,
        session_id: str | None = None,
    ) -> Completion:
        body = {"input_ids": prompt_ids, "sampling_params": _params_dict(params), "stream": on_text is not None}
        if session_id is not None:
            body["session_id"] = session_id
        if on_text is None:
            return _completion(self._post_json("/generate", body))
        last = None
        sent = 0
        for event in self._post_stream("/generate", body):
            last = event
            text = event["text"]
            if len(text) > sent:
                on_text(text[sent:])
                sent = len(text)
        if last is None:
            raise EndpointError("the server's stream ended without a result")
        return _completion(last)

    def score(self, requests: list[ScoreRequest]) -> list[list[float]]:
        # One batch shares one set of params: score from the earliest start, keep what each needs.
        # Prefill only (max_tokens 0): the prompt is computed, nothing is sampled.
        start = min(r.start for r in requests)
        params = SamplingParams(max_tokens=0, prompt_logprobs=0, prompt_logprobs_start=start)
        body = {"input_ids": [r.token_ids for r in requests], "sampling_params": _params_dict(params)}
        results = self._post_json("/generate", body)
        return [_scored(result, request, start) for result, request in zip(results, requests)]

    def stats(self) -> dict[str, Any]:
        """Engine counters read from /metrics."""
        text = self._request("GET", "/metrics").decode()
        stats = {}
        for line in text.splitlines():
            name, _, value = line.partition(" ")
            key = _METRICS.get(name.removesuffix("_total"))
            if key is not None and not line.startswith("#"):
                stats[key] = int(float(value))
        return stats

    def flush_cache(self) -> int:
        return json.loads(self._request("POST", "/flush_cache", b"{}"))["freed_blocks"]

    # ---- HTTP ---------------------------------------------------------------------------

    def _post_json(self, path: str, body: dict[str, Any]) -> Any:
        return json.loads(self._request("POST", path, json.dumps(body).encode()))

    def _post_stream(self, path: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        with self._open("POST", path, json.dumps(body).encode()) as response:
            for raw in response:
                line = raw.decode("utf-8").strip()
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    return
                event = json.loads(data)
                if "error" in event:
                    raise EndpointError(event["error"].get("message", str(event["error"])))
                yield event

    def _request(self, method: str, path: str, data: bytes | None = None) -> bytes:
        with self._open(method, path, data) as response:
            return response.read()

    def _open(self, method: str, path: str, data: bytes | None):
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        request = urllib.request.Request(self.url + path, data=data, headers=headers, method=method)
        try:
            return urllib.request.urlopen(request, timeout=self.timeout_s)
        except urllib.error.HTTPError as exc:
            message = _error_message(exc)
            if exc.code == 400:
                raise ValueError(message) from None
            raise EndpointError(f"{method} {path}: HTTP {exc.code}: {message}") from None

    def _served_model_dir(self) -> str:
        from radixserve.model.default_model import DEFAULT_MODEL_NAME, ensure_default_model

        names = [card["id"] for card in json.loads(self._request("GET", "/v1/models"))["data"]]
        for name in names:
            if os.path.isdir(name):
                return name
            if name == DEFAULT_MODEL_NAME:
                return str(ensure_default_model())
        raise ValueError(f"cannot find a local tokenizer for the server's model {names}; pass Endpoint(tokenizer=...)")


def _load_tokenizer(path: str | os.PathLike) -> Any:
    from radixserve.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(path)
    if tokenizer is None:
        raise ValueError(f"{path} has no tokenizer files")
    return tokenizer


def _params_dict(params: SamplingParams) -> dict[str, Any]:
    """Only the fields that differ from the defaults (the server applies the same defaults)."""
    return {
        f.name: getattr(params, f.name)
        for f in dataclasses.fields(params)
        if getattr(params, f.name) != getattr(_DEFAULT_PARAMS, f.name)
    }


def _completion(result: dict[str, Any]) -> Completion:
    meta = result["meta_info"]
    reason = meta["finish_reason"]  # SGLang's shape: {"type": "stop" | "length" | "abort", ...}
    return Completion(result["text"], result["output_ids"], reason["type"] if reason else None, meta["prompt_tokens"],
                      meta["cached_tokens"])


def _scored(result: dict[str, Any], request: ScoreRequest, start: int) -> list[float]:
    """The request's prompt logprobs from its own start (the answer's begin at `start`)."""
    entries = result["meta_info"]["input_token_logprobs"][request.start - start:]
    if any(entry[0] is None for entry in entries):
        raise EndpointError("the server left prompt logprobs uncomputed")
    return [entry[0] for entry in entries]


def _error_message(exc: urllib.error.HTTPError) -> str:
    try:
        return json.loads(exc.read())["error"]["message"]
    except Exception:
        return exc.reason or f"HTTP {exc.code}"

"""Schemathesis over every operation of /openapi.json against a live server on loopback:
every answer is 2xx or a 4xx with an OpenAI-style error body (Anthropic's on /v1/messages)
(never a 5xx), streams carry no error event, the server stays up, and the block pool is intact afterwards.

Bounded: a fixed number of examples per operation and mode (derandomized, so a run is
reproducible), a wall-clock budget, and generation lengths clamped to a few tokens.
"""

from __future__ import annotations

import json
import time
from collections import Counter

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance, response_schema_conformance, status_code_conformance,
)

from radixserve.server import ServerOptions
from radixserve.server.testing import BackgroundServer

pytestmark = pytest.mark.real_model

EXAMPLES = {GenerationMode.POSITIVE: 40, GenerationMode.NEGATIVE: 25}
BUDGET_S = 70.0  # split evenly among the operations with a body
MAX_TOKENS = 3
MODEL = "SmolLM2-135M-Instruct"
# The token-limit fields of each OpenAI body (absent: up to the context, so the fuzzer must set one).
TOKEN_LIMITS = {
    "/v1/completions": ["max_tokens"],
    "/v1/chat/completions": ["max_tokens", "max_completion_tokens"],
    "/v1/responses": ["max_output_tokens"],
    "/v1/messages": ["max_tokens"],
}
ANTHROPIC_PATHS = ("/v1/messages", "/v1/messages/count_tokens")
SCHEMA_CHECKS = [status_code_conformance, content_type_conformance, response_schema_conformance]


@pytest.fixture(scope="module")
def server_options() -> ServerOptions:
    return ServerOptions(enable_debug_endpoints=True, max_n=2, max_prompts=4)


def test_fuzz_every_operation(server):
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    answered: Counter[tuple[str, int]] = Counter()
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {
        "/v1/completions", "/v1/chat/completions", "/generate", "/health", *ANTHROPIC_PATHS}
    # Each operation with a body gets an equal share of the budget per mode (the others are instant).
    share_s = BUDGET_S / (len(EXAMPLES) * max(1, sum(1 for op in operations if op.body)))

    for operation in operations:
        modes = list(EXAMPLES) if operation.body else [GenerationMode.POSITIVE]
        for mode in modes:
            deadline = time.monotonic() + share_s

            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(
                max_examples=EXAMPLES[mode] if operation.body else 2,
                deadline=None,
                database=None,
                derandomize=True,
                phases=[Phase.explicit, Phase.generate],
                suppress_health_check=list(HealthCheck),
            )
            def run(case):
                if time.monotonic() > deadline:
                    return
                _bound(case)
                response = case.call(base_url=server.url, timeout=60)
                answered[(f"{case.method} {case.path}", response.status_code)] += 1
                _check_answer(case, response)
                case.validate_response(response, checks=SCHEMA_CHECKS)

            run()

    assert {f"{op.method.upper()} {op.path}" for op in operations} == {where for where, _ in answered}, answered
    assert sum(answered.values()) >= 50, answered
    assert any(status == 200 for (_, status) in answered), answered
    assert any(400 <= status < 500 for (_, status) in answered), answered
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    stats = _wait_idle(server)
    assert stats["blocks_free"] + stats["blocks_cached"] == stats["blocks_total"]


def _bound(case) -> None:
    """Keep generations short: clamp (or set) the token limits that a valid body would use.
    Values of the wrong type are left alone: they are what a negative case tests."""
    body = case.body
    if not isinstance(body, dict):
        return
    if isinstance(body.get("model"), str):
        body["model"] = MODEL  # a random name is a 404 (covered elsewhere); reach the engine instead
    if case.path in TOKEN_LIMITS:
        names = TOKEN_LIMITS[case.path]
        if not any(isinstance(body.get(name), int) for name in names):
            body[names[0]] = MAX_TOKENS
        for name in names:
            _clamp(body, name)
    elif case.path == "/generate":
        params = body.get("sampling_params")
        if params is None:
            body["sampling_params"] = params = {}
        if isinstance(params, dict):
            if "max_tokens" not in params or params["max_tokens"] is None:
                params["max_tokens"] = MAX_TOKENS
            _clamp(params, "max_tokens")
            _clamp(params, "max_new_tokens")  # SGLang's name for it


def _clamp(values: dict, name: str) -> None:
    value = values.get(name)
    if value is None and name in values:
        values[name] = MAX_TOKENS
    elif isinstance(value, int) and not isinstance(value, bool) and value > MAX_TOKENS:
        values[name] = MAX_TOKENS


def _check_answer(case, response) -> None:
    where = f"{case.method} {case.path} body={json.dumps(case.body, default=str)[:2000]}"
    assert response.status_code < 500, f"{where} -> {response.status_code}: {response.text[:2000]}"
    if response.status_code >= 400 and case.path in ANTHROPIC_PATHS:
        body = response.json()
        assert set(body) == {"type", "error"} and body["type"] == "error", where
        assert set(body["error"]) == {"type", "message"} and body["error"]["message"], where
    elif response.status_code >= 400:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}, where
        assert isinstance(error["message"], str) and error["message"], where
    elif _content_type(response).startswith("text/event-stream") and case.path in ANTHROPIC_PATHS:
        lines = response.text.splitlines()
        kinds = [line[len("event: "):] for line in lines if line.startswith("event: ")]
        assert kinds and kinds[0] == "message_start" and kinds[-1] == "message_stop", where
        assert "error" not in kinds, f"{where} -> stream error {response.text[-2000:]}"
    elif _content_type(response).startswith("text/event-stream"):
        events = [line[len("data: "):] for line in response.text.splitlines() if line.startswith("data: ")]
        assert events and events[-1] == "[DONE]", where
        for event in events[:-1]:
            assert "error" not in json.loads(event), f"{where} -> stream error {event}"


def _content_type(response) -> str:
    """schemathesis' Response keeps each header as a list of values."""
    for name, values in response.headers.items():
        if name.lower() == "content-type":
            return values[0] if isinstance(values, list) else values
    return ""


def _wait_idle(server: BackgroundServer, timeout_s: float = 30.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        check = httpx.post(server.url + "/debug/check_integrity", timeout=60).json()
        assert check["ok"]
        stats = check["stats"]
        if (stats["running"] == 0 and stats["waiting"] == 0) or time.monotonic() > deadline:
            assert stats["running"] == 0 and stats["waiting"] == 0
            return stats
        time.sleep(0.1)

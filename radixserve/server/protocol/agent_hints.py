"""Agent hints on a generating request's body: `agent_hints: {...}`, or Dynamo's spelling
`nvext: {"agent_hints": {...}}` (its `latency_sensitivity` included). Taken out of the body
before the route's own model reads it, checked here (an unknown key, a wrong type or a value
out of range is a 400 naming it) and handed on as a core AgentHints.

OpenAI's `prompt_cache_retention` is read here too: "24h" is a TTL hold of 24 hours on the
request's prefix (an agent hint's ttl_s: in the caller's namespace only, capped by
--hint-max-ttl-s, an eviction order, so under pressure the prefix is demoted to the second
tier where there is one rather than dropped); "in_memory" is the default caching. An explicit
agent hint's ttl_s wins."""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any

from pydantic import Field
from starlette.requests import Request

from radixserve.core.agent_hints import (
    MAX_LATENCY_SENSITIVITY_S, MAX_TTL_S, PRIORITY_MAX, PRIORITY_MIN, AgentHints,
)
from radixserve.server.errors import bad_request
from radixserve.server.protocol.body import read_json
from radixserve.server.protocol.common import Integer, NativeModel, parse

HINT_KEYS = ("agent_hints", "nvext")
RETENTION_TTL_S = {"in_memory": None, "24h": 24 * 3600.0}  # OpenAI's prompt_cache_retention values


class AgentHintsBody(NativeModel):
    priority: Integer = Field(0, ge=PRIORITY_MIN, le=PRIORITY_MAX, description="higher: admitted first")
    latency_sensitivity: float = Field(0.0, ge=0.0, le=MAX_LATENCY_SENSITIVITY_S,
                                       description="seconds earlier than its arrival it is queued (Dynamo)")
    osl: Annotated[Integer, Field(ge=0)] | None = Field(None, description="expected output tokens")
    ttl_s: float | None = Field(None, gt=0, le=MAX_TTL_S, description="seconds its prefix is held after it finishes")
    speculative_prefill: bool = False
    release: bool = False

    def hints(self) -> AgentHints:
        if self.release and self.ttl_s is not None:
            raise bad_request("'agent_hints': release and ttl_s contradict each other; give one",
                              param="agent_hints.release")
        return AgentHints(self.priority, self.latency_sensitivity, self.osl, self.ttl_s,
                          self.speculative_prefill, self.release)


class _AgentHintsOnly(NativeModel):
    agent_hints: AgentHintsBody | None = None


class _Nvext(NativeModel):
    nvext: _AgentHintsOnly


async def read_hinted_json(request: Request) -> Any:
    """The body as JSON with its agent hints taken out; the hints (None if it gives none) go
    to `request.state.agent_hints`, where in_namespace (api/serving.py) puts them on the job."""
    body = await read_json(request)
    request.state.agent_hints = with_retention(take_agent_hints(body), body)
    return body


def take_agent_hints(body: Any) -> AgentHints | None:
    """Remove `agent_hints` and `nvext` from a body (a dict) and return the hints they give."""
    if not isinstance(body, dict) or not any(k in body for k in HINT_KEYS):
        return None
    direct, nvext = body.pop("agent_hints", None), body.pop("nvext", None)
    if direct is not None and nvext is not None:
        raise bad_request("give agent hints once: as 'agent_hints' or as 'nvext.agent_hints'", param="nvext")
    if direct is not None:
        return parse(_AgentHintsOnly, {"agent_hints": direct}).agent_hints.hints()
    if nvext is None:
        return None
    parsed = parse(_Nvext, {"nvext": nvext}).nvext.agent_hints
    return parsed.hints() if parsed is not None else None


def with_retention(hints: AgentHints | None, body: Any) -> AgentHints | None:
    """The hints with OpenAI's prompt_cache_retention as their TTL (left in the body: the
    route's model accepts it as a field with no other effect)."""
    retention = body.get("prompt_cache_retention") if isinstance(body, dict) else None
    if retention is None:
        return hints
    if not isinstance(retention, str) or retention not in RETENTION_TTL_S:
        raise bad_request(f"'prompt_cache_retention' must be one of {', '.join(RETENTION_TTL_S)}, got {retention!r}",
                          param="prompt_cache_retention")
    ttl_s = RETENTION_TTL_S[retention]
    if ttl_s is None or (hints is not None and (hints.ttl_s is not None or hints.release)):
        return hints
    return dataclasses.replace(hints or AgentHints(), ttl_s=ttl_s)


def without_hints(body: Any) -> Any:
    """The body without its hint keys (unchecked), for readers that only look at the rest."""
    if isinstance(body, dict) and any(k in body for k in HINT_KEYS):
        return {k: v for k, v in body.items() if k not in HINT_KEYS}
    return body

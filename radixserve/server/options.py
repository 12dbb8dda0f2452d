"""ServerOptions: the HTTP server's own settings (the engine's are EngineConfig)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class ServerOptions:
    api_key: str | None = None  # when set, every endpoint but /health needs "Authorization: Bearer <key>"
    api_keys: tuple[str, ...] = ()  # more accepted keys (tenants), beside api_key
    admin_api_keys: tuple[str, ...] = ()  # accepted keys that may also act for every tenant (flush all, abort all)
    shared_cache_across_keys: bool = False  # else each key has its own prefix-cache namespace
    max_queued_requests: int = 1024  # engine requests waiting for their first token; past it: 503
    request_timeout_s: float | None = None  # abort a request running longer (504)
    max_n: int = 16  # most samples per request (`n`)
    max_prompts: int = 64  # most prompts in one /v1/completions or /generate batch
    retry_after_s: int = 1  # Retry-After of a 503 when the queue is full
    shutdown_grace_s: float = 5.0  # at shutdown, how long running requests may finish
    served_model_name: str | None = None  # another name the model answers to
    enable_debug_endpoints: bool = False  # /debug/check_integrity and /debug/stats
    tool_call_parser: str = "auto"  # how tool calls are written: a format's name (tools/formats/), or auto (from the template)
    chat_template: str | None = None  # a Jinja chat template's text in place of the model's own (--chat-template)
    trust_request_chat_template: bool = False  # whether a chat request may bring its own `chat_template`
    reasoning_parser: str = "auto"  # how reasoning is written: deepseek_r1, qwen3, gpt_oss, none, or auto (from the template)
    reply_token_reuse: bool = True  # a re-sent reply is prompted with the ids it was generated as (reply_store.py)

    def __post_init__(self) -> None:
        for name in ("max_queued_requests", "max_n", "max_prompts"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.request_timeout_s is not None and self.request_timeout_s <= 0:
            raise ValueError(f"request_timeout_s must be > 0, got {self.request_timeout_s}")
        from radixserve.tools.formats import PARSER_CHOICES

        if self.tool_call_parser not in PARSER_CHOICES:
            raise ValueError(f"tool_call_parser must be one of {', '.join(PARSER_CHOICES)}, got {self.tool_call_parser!r}")
        from radixserve.reasoning.registry import CHOICES as REASONING_CHOICES

        if self.reasoning_parser not in REASONING_CHOICES:
            raise ValueError(f"reasoning_parser must be one of {', '.join(REASONING_CHOICES)}, got {self.reasoning_parser!r}")
        if self.shared_cache_across_keys and not self.all_api_keys:
            raise ValueError("shared_cache_across_keys needs API keys: without keys every caller already shares "
                             "one cache (one trusted tenant)")
        for key in ((self.api_key,) if self.api_key is not None else ()) + tuple(self.api_keys) + tuple(self.admin_api_keys):
            if not isinstance(key, str) or not key.strip() or key != key.strip():
                raise ValueError("API keys must be non-empty strings without surrounding whitespace")

    def reported(self) -> dict[str, object]:
        """The options as /get_server_info reports them: keys counted, never shown."""
        shown = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if "api_key" not in f.name}
        return {**shown, "api_keys": len(self.all_api_keys) - len(set(self.admin_api_keys)),
                "admin_api_keys": len(set(self.admin_api_keys))}

    @property
    def all_api_keys(self) -> tuple[str, ...]:
        """Every accepted key, without duplicates; empty: no authentication."""
        keys = ((self.api_key,) if self.api_key else ()) + tuple(self.api_keys) + tuple(self.admin_api_keys)
        return tuple(dict.fromkeys(keys))

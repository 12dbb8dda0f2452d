"""AnthropicEventStream: server-sent events framed as Anthropic's API frames them:
`event: <type>` then `data: <json>` for each event, an error as `event: error`, and no
closing [DONE] (message_stop ends a message)."""

from __future__ import annotations

import json
from typing import Any

from radixserve.server.anthropic_errors import anthropic_error_body
from radixserve.server.errors import APIError
from radixserve.server.sse import EventStream


class AnthropicEventStream(EventStream):
    end = b""

    def frame(self, payload: dict[str, Any]) -> bytes:
        data = json.dumps(payload, ensure_ascii=False)
        return f"event: {payload['type']}\ndata: {data}\n\n".encode("utf-8")

    def error_frame(self, error: APIError) -> bytes:
        return self.frame(anthropic_error_body(error))

"""RequestBlocks: a request's block names at the ingress, as the replica that serves it will
publish them (kv_index.wire_hashes): its prompt's token ids (the chat template and tokenizer
of the replicas' model, as the replica prepares a prompt) in the replica's cache namespace
(the caller's key and cache_salt, as server/middleware.cache_namespace names it).

Only routes whose prompt the ingress renders as the replica does are named: /generate and
/v1/completions (text or token ids) and /v1/chat/completions without tools; others (and any
body it cannot read) get None, and route on the shadow tree. A rendering that differs from
the replica's (a template fed more than the messages) only makes the match shorter.
"""

from __future__ import annotations

from typing import Any

from radixserve.cluster.kv_index import wire_hashes

MAX_CHARS = 1 << 20  # longer prompts are not named (the ingress does not tokenize megabytes)


class RequestBlocks:
    def __init__(self, tokenizer: Any, block_size: int, scheme: str = "chained", shared_cache: bool = False):
        self.tokenizer, self.block_size, self.scheme, self.shared_cache = tokenizer, block_size, scheme, shared_cache

    def names(self, path: str, body: Any, tenant: str | None) -> tuple | None:
        if not isinstance(body, dict):
            return None
        try:
            ids = self._token_ids(path, body)
        except Exception:  # the replica answers a body it cannot read with its own error
            return None
        if not ids:
            return None
        return tuple(wire_hashes(ids, self.block_size, self._salt(tenant, body.get("cache_salt")), self.scheme))

    def _token_ids(self, path: str, body: dict) -> list[int] | None:
        if path == "/generate":
            return self._ids(body.get("input_ids"), body.get("text"))
        if path == "/v1/completions":
            prompt = body.get("prompt")
            return self._ids(prompt, None) if not isinstance(prompt, str) else self._ids(None, prompt)
        if path == "/v1/chat/completions" and not body.get("tools") and isinstance(body.get("messages"), list):
            text = self.tokenizer.apply_chat_template(body["messages"], tokenize=False, add_generation_prompt=True)
            return self.tokenizer.encode(text, add_special_tokens=False) if len(text) <= MAX_CHARS else None
        return None

    def _ids(self, ids: Any, text: Any) -> list[int] | None:
        if isinstance(ids, list) and ids and isinstance(ids[0], list):
            ids = ids[0]
        if isinstance(ids, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            return ids
        if isinstance(text, list) and text:
            text = text[0]
        if isinstance(text, str) and text and len(text) <= MAX_CHARS:
            return self.tokenizer.encode(text)
        return None

    def _salt(self, tenant: str | None, cache_salt: Any) -> str | None:
        salt = cache_salt if isinstance(cache_salt, str) else None
        if tenant is None or self.shared_cache:
            return salt
        namespace = f"key:{tenant}"
        return namespace if salt is None else f"{namespace}/{salt}"

"""RequestBlocks: a request's block names at the ingress, as the replica that serves it will
publish them (kv_index.wire_hashes): its prompt's token ids, rendered by the server's own code
without an engine (server/prompt_ids.py: each route's job builder, the chat template with
tools, the Anthropic and Responses conversions, the replicas' server options), in the
replica's cache namespace (the caller's key and the request's cache_salt, as
server/middleware.cache_namespace names it).

Every route the cluster routes by prompt is named (routing_key.ROUTED_PATHS: completions,
chat completions with or without tools, /v1/responses, /v1/messages, /generate and a pin);
a body the route refuses, a Responses request continuing a stored response (only its replica
knows the conversation: it routes by that session) and a body over MAX_NAMED_BYTES get None,
and route on the shadow trees. Where the rendering still differs from the replica's (a
re-sent reply whose generated ids the replica splices in, --reply-token-reuse), the names
match the replica's blocks up to there: the match is only shorter.
"""

from __future__ import annotations

from typing import Any

from radixserve.cluster.kv_index import wire_hashes
from radixserve.server.options import ServerOptions
from radixserve.server.prompt_ids import PromptIds

MAX_NAMED_BYTES = 1 << 20  # larger bodies are not named (the ingress does not tokenize megabytes)


class RequestBlocks:
    def __init__(self, tokenizer: Any, block_size: int, scheme: str = "chained", shared_cache: bool = False,
                 server: ServerOptions | None = None):
        self.prompts = PromptIds(tokenizer, server)
        self.block_size, self.scheme, self.shared_cache = block_size, scheme, shared_cache

    async def names(self, path: str, body: Any, tenant: str | None) -> tuple | None:
        """The block names of the request's prompt (its first, in a batch), or None."""
        prompt = await self.prompts.of(path, body)
        if prompt is None:
            return None
        return tuple(wire_hashes(prompt.token_ids, self.block_size, self._salt(tenant, prompt.cache_salt), self.scheme))

    def _salt(self, tenant: str | None, cache_salt: str | None) -> str | None:
        if tenant is None or self.shared_cache:
            return cache_salt
        namespace = f"key:{tenant}"
        return namespace if cache_salt is None else f"{namespace}/{cache_salt}"

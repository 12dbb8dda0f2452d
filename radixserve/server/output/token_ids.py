"""return_token_ids (vLLM's extension): the prompt's and the output's token ids in an answer.

A chat completion carries `prompt_token_ids` beside its choices and `token_ids` in each choice;
a text completion carries both in each choice (each choice has its own prompt). Streamed, the
prompt's ids come once (chat: on the first chunk, which waits for the first output as vLLM's
does; completions: on each choice's first chunk) and each chunk's `token_ids` are the ids
generated since that choice's previous chunk, so a choice's chunks add up to all its ids.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from radixserve.outputs import RequestOutput
from radixserve.server.request_group import RequestGroup


class TokenIdsResponder:
    """Wraps an API's responder (chat or completions) and adds the ids to what it answers."""

    def __init__(self, inner: Any):
        self.inner = inner

    def body(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        body = self.inner.body(outputs)
        chat = _is_chat(body)
        if chat:
            body["prompt_token_ids"] = list(outputs[0].prompt_token_ids)
        for choice in body["choices"]:
            output = outputs[choice["index"]]
            choice["token_ids"] = list(output.token_ids)
            if not chat:
                choice["prompt_token_ids"] = list(output.prompt_token_ids)
        return body

    async def chunks(self, group: RequestGroup) -> AsyncIterator[dict[str, Any]]:
        observed = _ObservedGroup(group)
        held: list[dict[str, Any]] = []  # chat's opening chunks, until the prompt's ids are known
        prompt_sent = False
        async for chunk in self.inner.chunks(observed):
            chat = _is_chat(chunk)
            if chat and not observed.latest:
                held.append(chunk)
                continue
            for choice in chunk["choices"]:
                self._add_ids(choice, observed, not chat)
            if chat and not prompt_sent:
                prompt_sent = True
                first = held[0] if held else chunk
                first["prompt_token_ids"] = list(next(iter(observed.latest.values())).prompt_token_ids)
            for opening in held:
                yield opening
            held = []
            yield chunk
        for opening in held:
            yield opening

    def _add_ids(self, choice: dict[str, Any], observed: "_ObservedGroup", with_prompt: bool) -> None:
        index = choice["index"]
        output = observed.latest.get(index)
        if output is None:
            choice["token_ids"] = []
            return
        if with_prompt and not observed.num_sent(index) and "prompt_token_ids" not in choice:
            choice["prompt_token_ids"] = list(output.prompt_token_ids)
        choice["token_ids"] = observed.take(index)


class _ObservedGroup:
    """A RequestGroup as a responder sees it, remembering the latest output handed to it per
    member (a chunk yielded right after an output was read belongs to that output) and the
    ids its deltas added since that member's previous chunk."""

    def __init__(self, group: RequestGroup):
        self._group = group
        self.latest: dict[int, RequestOutput] = {}
        self._unsent: dict[int, list[int]] = {}
        self._sent: dict[int, int] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._group, name)

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        async for index, output in self._group.outputs():
            self.latest[index] = output
            self._unsent.setdefault(index, []).extend(output.delta.token_ids)
            yield index, output

    def num_sent(self, index: int) -> int:
        return self._sent.get(index, 0)

    def take(self, index: int) -> list[int]:
        """The member's ids not in a chunk yet (what its outputs' deltas added since)."""
        ids = self._unsent.pop(index, [])
        self._sent[index] = self._sent.get(index, 0) + len(ids)
        return ids


def _is_chat(body: dict[str, Any]) -> bool:
    return str(body.get("object", "")).startswith("chat.completion")

"""POST /v1/completions (OpenAI's legacy completions): the route, and the encoder of its
answers, whole or streamed (the body: protocol/completions.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from radixserve.outputs import RequestOutput
from radixserve.server.api.serving import in_namespace, serve_job, server_state
from radixserve.server.logprob_format import LegacyLogprobs, merge_legacy
from radixserve.server.output.ids import new_id, now_s
from radixserve.server.output.usage import Usage
from radixserve.server.protocol import CompletionRequest, parse
from radixserve.server.protocol.agent_hints import read_hinted_json
from radixserve.server.protocol.jobs import GenerationJob
from radixserve.server.request_group import RequestGroup
from radixserve.server.token_text import TokenTexts


def routes() -> list[Route]:
    return [Route("/v1/completions", completions, methods=["POST"])]


async def completions(request: Request) -> Response:
    state = server_state(request)
    job = in_namespace(request, parse(CompletionRequest, await read_hinted_json(request)).to_job(state.served))
    return await serve_job(request, job, CompletionResponder(job, state.texts))


class CompletionResponder:
    """Turns a job's outputs into "text_completion" objects; one responder per request."""

    def __init__(self, job: GenerationJob, texts: TokenTexts):
        self.job = job
        self.texts = texts
        self.id = new_id("cmpl-")
        self.created = now_s()

    def body(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        choices = []
        for index, output in enumerate(outputs):
            logprobs = LegacyLogprobs(self.texts) if self.job.logprobs is not None else None
            text, lp = self._opening(output, logprobs)
            if logprobs is not None:
                lp = merge_legacy(lp, logprobs.piece(output.token_ids, output.logprobs or []))
            choices.append(self._choice(index, text + output.text, lp, finish_reason(output), output))
        return self._object(choices, self._usage(outputs))

    async def chunks(self, group: RequestGroup) -> AsyncIterator[dict[str, Any]]:
        """Stream chunks as outputs arrive (each the engine's delta), then the usage chunk when asked for."""
        logprobs = [LegacyLogprobs(self.texts) if self.job.logprobs is not None else None for _ in group.members]
        async for index, output in group.outputs():
            delta = output.delta
            text, lp = self._opening(output, logprobs[index]) if delta.first else ("", None)
            text += delta.text
            if logprobs[index] is not None:
                piece = logprobs[index].piece(delta.token_ids, delta.logprobs or [])
                lp = merge_legacy(lp, piece) if lp is not None else piece
            if text or delta.token_ids or output.finished:
                chunk = self._object([self._choice(index, text, lp, finish_reason(output), output)])
                yield {**chunk, "usage": None} if self.job.include_usage else chunk  # as OpenAI streams them
        if self.job.include_usage:
            yield self._object([], self._usage([m.latest for m in group.members]))

    def _usage(self, outputs: list[RequestOutput | None]) -> dict[str, Any]:
        return Usage.of_group(len(self.job.prompts), self.job.n, outputs).openai()

    def _opening(self, output: RequestOutput, logprobs: LegacyLogprobs | None) -> tuple[str, dict | None]:
        """The echoed prompt (text and logprobs) that starts a choice, or nothing."""
        if not self.job.echo:
            empty = logprobs.piece([], []) if logprobs is not None else None
            return "", empty
        prompt_text = output.prompt if output.prompt is not None else self.texts.decode(output.prompt_token_ids)
        if logprobs is None:
            return prompt_text, None
        entries = output.prompt_logprobs or [None] * output.prompt_tokens
        return prompt_text, logprobs.piece(output.prompt_token_ids, entries)

    def _choice(
        self, index: int, text: str, logprobs: dict | None, reason: str | None, output: RequestOutput
    ) -> dict[str, Any]:
        return {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": reason,
            "stop_reason": output.stop_reason if reason is not None else None,
        }

    def _object(self, choices: list[dict[str, Any]], usage_: dict[str, Any] | None = None) -> dict[str, Any]:
        body = {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.job.model,
            "choices": choices,
        }
        if usage_ is not None:
            body["usage"] = usage_
        return body


def finish_reason(output: RequestOutput) -> str | None:
    return output.finish_reason if output.finished else None

"""POST /v1/responses: the subset of OpenAI's Responses API that agent SDKs use.

Input: a string or items (`message` with text parts, `function_call`,
`function_call_output`), `instructions`, function `tools`, `tool_choice`,
`parallel_tool_calls`, `max_output_tokens`, `temperature`, `top_p`, `text.format`
(text, json_object, json_schema), `stream`, `reasoning.effort` (to the chat template), and
`seed` and `thinking_token_budget` (extensions, as on chat). Output: `reasoning` items (with
a reasoning parser: the reasoning text as a reasoning_text part), `message` and
`function_call` items, usage with `input_tokens_details.cached_tokens` and
`output_tokens_details.reasoning_tokens`; streamed as the typed events the official client
parses.

`store` (default true) keeps the conversation in memory (ResponseStore: bounded, with a
TTL, one namespace per API key) so a later request of the same key can continue it with
`previous_response_id`; an unknown, expired or another key's id is a 404. Other tool types,
non-text inputs, `background`, `conversation`, `prompt`, output logprobs, reasoning
summaries other than "auto" and `truncation: "auto"` are refused, as is any field this
server does not know.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from radixserve.outputs import RequestOutput
from radixserve.sampling_params import SamplingParams
from radixserve.engine.reply_ids import ReplyLookup
from radixserve.server.api.serving import caller_replies, in_namespace, serve_job, server_state
from radixserve.server.errors import bad_request
from radixserve.server.middleware import tenant
from radixserve.server.output.encoder import BlockEncoder
from radixserve.server.output.events import CallArguments, CallStart, Event, OutputEvents, ReasoningDelta, TextDelta
from radixserve.server.output.ids import new_id, now_s
from radixserve.server.protocol.agent_hints import read_hinted_json
from radixserve.server.protocol.common import ServedModel, parse
from radixserve.server.protocol.jobs import GenerationJob
from radixserve.server.protocol.responses import ResponsesRequest
from radixserve.reasoning.mode import ReasoningMode
from radixserve.server.reasoning import Reasoning, with_reasoning
from radixserve.server.request_group import RequestGroup
from radixserve.server.response_store import OwnedResponses
from radixserve.tools.definitions import ToolSpec
from radixserve.tools.history import HistoryCall, HistoryMessage
from radixserve.tools.parser import ToolCallParser
from radixserve.server.tool_calling import ToolCalling


def routes() -> list[Route]:
    return [Route("/v1/responses", responses, methods=["POST"])]


async def responses(request: Request) -> Response:
    state = server_state(request)
    body = parse(ResponsesRequest, await read_hinted_json(request))
    replies = caller_replies(request, None)
    job, responder = await responses_job(
        body, state.served, state.tools, state.responses.for_owner(tenant(request.scope)), replies, state.reasoning,
    )
    return await serve_job(request, in_namespace(request, job), responder,
                           on_finish=replies.record if replies is not None else None)


async def responses_job(
    body: ResponsesRequest, served: ServedModel, calling: ToolCalling, store: OwnedResponses,
    replies: ReplyLookup | None = None, reasoning: Reasoning | None = None,
) -> tuple[GenerationJob, "ResponsesResponder"]:
    """The engine job of a Responses request and the responder that answers it; `replies`:
    the caller's stored reply ids, so that a conversation continued by previous_response_id
    is prompted with the ids its replies were generated as. `reasoning`: the server's
    reasoning parser (None: none)."""
    model = served.check_model(body.model)
    body.check_supported()
    spec = calling.spec(body)
    kwargs = body.template_kwargs()
    budget = body.thinking_token_budget
    mode = await reasoning.mode_async(kwargs, budget) if reasoning is not None else None
    if mode is None and budget is not None:
        raise bad_request("'thinking_token_budget' needs a model whose reasoning the server reads: start it with "
                          "--reasoning-parser (or a chat template that reasons)", param="thinking_token_budget")
    head, conversation = body.history(store)
    prompt = calling.prompt(head + conversation, spec, replies, kwargs or None)
    try:
        params = SamplingParams(
            max_tokens=body.max_output_tokens, temperature=body.temperature, top_p=body.top_p, seed=body.seed,
            **body.constraint(spec),
        )
    except ValueError as exc:
        raise bad_request(str(exc)) from None
    job = with_reasoning(GenerationJob(model, [prompt], [params], 1, body.stream, False), mode)
    return job, ResponsesResponder(job, body, spec if spec.parses_calls else None, calling, store, conversation, mode)


# ---- response ----------------------------------------------------------------------------


class ResponsesResponder:
    """Builds the "response" object, and its stream of events, from one engine request."""

    def __init__(
        self, job: GenerationJob, body: ResponsesRequest, spec: ToolSpec | None, calling: ToolCalling,
        store: OwnedResponses, conversation: list[HistoryMessage], reasoning: ReasoningMode | None = None,
    ):
        self.job = job
        self.reasoning = reasoning  # None: no reasoning block is read
        self.request = body
        self.spec = spec
        self.calling = calling
        self.store = store
        self.conversation = conversation
        self.id = new_id("resp_")
        self.created = now_s()

    def body(self, outputs: list[RequestOutput]) -> dict[str, Any]:
        builder = ResponseOutputBuilder()
        builder.apply(OutputEvents(self._parser(), self.reasoning).whole(outputs[0]))
        return self._response(builder)

    async def chunks(self, group: RequestGroup) -> AsyncIterator[dict[str, Any]]:
        builder, events = ResponseOutputBuilder(), OutputEvents(self._parser(), self.reasoning)
        sequence = itertools.count()
        for kind in ("response.created", "response.in_progress"):
            yield {"type": kind, "sequence_number": next(sequence), "response": self._response(builder)}
        async for _, output in group.outputs():
            for event in builder.apply(events.step(output)):
                yield {**event, "sequence_number": next(sequence)}
            if builder.finish is not None:
                response = self._response(builder)
                kind = "response.incomplete" if response["status"] == "incomplete" else "response.completed"
                yield {"type": kind, "sequence_number": next(sequence), "response": response}

    def _parser(self) -> ToolCallParser | None:
        return ToolCallParser(self.calling.fmt, self.spec.names, self.spec.schemas) if self.spec is not None else None

    def _response(self, builder: ResponseOutputBuilder) -> dict[str, Any]:
        """The response object: in progress until the builder has seen the finish."""
        body, finish = self.request, builder.finish
        status = "in_progress" if finish is None else ("incomplete" if finish.reason == "length" else "completed")
        stored = False
        if finish is not None and body.store:
            stored = self.store.put(self.id, self.conversation + builder.history())
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self.job.model,
            "output": builder.items if finish is not None else [],
            "instructions": body.instructions,
            "tools": [t.model_dump(by_alias=True, exclude_none=True) for t in body.tools or []],
            "tool_choice": _dump(body.tool_choice) if body.tool_choice is not None else "auto",
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "temperature": body.temperature,
            "top_p": body.top_p,
            "max_output_tokens": body.max_output_tokens,
            "previous_response_id": body.previous_response_id,
            "store": stored if finish is not None else body.store,
            "text": {"format": _dump(body.text.format) if body.text and body.text.format else {"type": "text"}},
            "truncation": "disabled",
            "metadata": body.metadata or {},
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "usage": finish.usage.responses() if finish is not None else None,
        }


def _dump(value: Any) -> Any:
    return value.model_dump(by_alias=True, exclude_none=True) if hasattr(value, "model_dump") else value


# ---- output items ------------------------------------------------------------------------


class ResponseOutputBuilder(BlockEncoder):
    """Output items (message, function_call) from one answer's events, and the response.*
    events that announce them."""

    def __init__(self) -> None:
        super().__init__()
        self.items: list[dict[str, Any]] = []

    def history(self) -> list[HistoryMessage]:
        """The output as one assistant turn (reasoning, text, then calls), for a later previous_response_id."""
        text = "".join(i["content"][0]["text"] for i in self.items if i["type"] == "message") or None
        calls = tuple(HistoryCall(i["call_id"], i["name"], i["arguments"], "output") for i in self.items
                      if i["type"] == "function_call")
        reasoning = [i["content"][0]["text"] for i in self.items if i["type"] == "reasoning"]
        return [HistoryMessage("assistant", text, calls, reasoning="".join(reasoning) if reasoning else None)]

    def _apply(self, event: Event) -> list[dict[str, Any]]:
        if isinstance(event, ReasoningDelta):
            return self._reasoning(event.text)
        if isinstance(event, TextDelta):
            events = [] if self._open is not None and self._open["type"] == "message" else self._close() + self._open_message()
            item = self._open
            item["content"][0]["text"] += event.text
            return events + [{"type": "response.output_text.delta", **self._where(), "content_index": 0,
                              "delta": event.text, "logprobs": []}]
        if isinstance(event, CallStart):
            events = self._close()
            item = {"id": new_id("fc_"), "type": "function_call", "status": "in_progress",
                    "call_id": "call_" + event.id_hex, "name": event.name, "arguments": ""}
            return events + self._add(item)
        if isinstance(event, CallArguments):
            self._open["arguments"] += event.text
            return [{"type": "response.function_call_arguments.delta", **self._where(), "delta": event.text}]
        return self._close()  # CallEnd, Finish

    def _reasoning(self, text: str) -> list[dict[str, Any]]:
        """A reasoning item (its text as one reasoning_text part) opens or grows."""
        events = []
        if self._open is None or self._open["type"] != "reasoning":
            item = {"id": new_id("rs_"), "type": "reasoning", "status": "in_progress", "summary": [],
                    "content": [{"type": "reasoning_text", "text": ""}]}
            events = self._close() + self._add(item)
        self._open["content"][0]["text"] += text
        return events + [{"type": "response.reasoning_text.delta", **self._where(), "content_index": 0, "delta": text}]

    def _open_message(self) -> list[dict[str, Any]]:
        item = {"id": new_id("msg_"), "type": "message", "status": "in_progress", "role": "assistant",
                "content": []}
        events = self._add(item)
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        item["content"].append(part)
        return events + [{"type": "response.content_part.added", **self._where(), "content_index": 0,
                          "part": dict(part)}]

    def _add(self, item: dict[str, Any]) -> list[dict[str, Any]]:
        self.items.append(item)
        self._open = item
        return [{"type": "response.output_item.added", "output_index": len(self.items) - 1, "item": _copy(item)}]

    def _close(self) -> list[dict[str, Any]]:
        item = self._open
        if item is None:
            return []
        self._open = None
        item["status"] = "completed"
        where = {"item_id": item["id"], "output_index": self.items.index(item)}
        if item["type"] == "reasoning":
            events = [{"type": "response.reasoning_text.done", **where, "content_index": 0,
                       "text": item["content"][0]["text"]}]
        elif item["type"] == "message":
            part = item["content"][0]
            events = [
                {"type": "response.output_text.done", **where, "content_index": 0, "text": part["text"], "logprobs": []},
                {"type": "response.content_part.done", **where, "content_index": 0, "part": dict(part)},
            ]
        else:
            events = [{"type": "response.function_call_arguments.done", **where, "name": item["name"],
                       "arguments": item["arguments"]}]
        return events + [{"type": "response.output_item.done", "output_index": where["output_index"], "item": _copy(item)}]

    def _where(self) -> dict[str, Any]:
        return {"item_id": self._open["id"], "output_index": len(self.items) - 1}


def _copy(item: dict[str, Any]) -> dict[str, Any]:
    copied = dict(item)
    if "content" in copied:
        copied["content"] = [dict(p) for p in copied["content"]]
    return copied

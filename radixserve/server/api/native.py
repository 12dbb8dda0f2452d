"""POST /generate, the native endpoint: the route and its answers, in SGLang's spelling (the
body is protocol/generate.py).

An answer is {"text", "output_ids", "meta_info"} per engine request (a list for a batch of
prompts or for n > 1). meta_info:
- "id" (the request's `rid` when given), "prompt_tokens", "completion_tokens",
  "cached_tokens", "ttft_s", "e2e_latency" (seconds; set once finished);
- "finish_reason": {"type": "stop" | "length" | "abort", ...}: a stop carries "matched"
  (the stop string, stop_regex match or stop token id; null for EOS or a completed
  constraint), a length carries "length" (tokens generated);
- with logprobs asked for (`return_logprob`, or `logprobs` / `prompt_logprobs` in
  sampling_params): "output_token_logprobs" and "input_token_logprobs" as
  [logprob, token_id, text or null] entries (text with `return_text_in_logprobs`), the
  input ones from `logprob_start_len` on (the first prompt token's logprob is null), and
  with top alternatives asked for "output_top_logprobs" / "input_top_logprobs" (per
  position a list of such entries, null where there is none).
Streaming sends the cumulative answer as `data: {...}` events, then `data: [DONE]`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from radixserve.outputs import RequestOutput, TokenLogprob
from radixserve.server.api.serving import CLIENT_CLOSED, in_namespace, results_unless_disconnected, server_state
from radixserve.server.errors import APIError
from radixserve.server.logprob_format import finite
from radixserve.server.middleware import tenant
from radixserve.server.protocol import GenerateRequest, parse
from radixserve.server.protocol.agent_hints import read_hinted_json
from radixserve.server.protocol.jobs import NativeJob
from radixserve.server.request_group import RequestGroup
from radixserve.server.api.sglang import RidTable, rid_table
from radixserve.server.sse import EventStream
from radixserve.server.token_text import TokenTexts


def routes() -> list[Route]:
    return [Route("/generate", generate, methods=["POST"])]


async def generate(request: Request) -> Response:
    state = server_state(request)
    job = in_namespace(request, parse(GenerateRequest, await read_hinted_json(request)).to_job(state.served))
    return await respond(request, job, state.engine, state.texts)


async def respond(request: Request, job: NativeJob, engine: Any, texts: TokenTexts) -> Response:
    """Submit the job, then answer: JSON, or an event stream."""
    rids, owner = rid_table(request.app), tenant(request.scope)
    rids.check_free(owner, job.rids)
    group = await engine.submit(job.inputs())
    answer = Answer(job, group, texts)
    rids.hold(owner, job.rids, group)
    if job.stream:
        return EventStream(answer.stream(rids), on_close=lambda: _release(rids, owner, job, group))
    try:
        outputs = await results_unless_disconnected(request, group)
    except APIError:
        if not rids.aborted(group):
            raise
        outputs = answer.latest()
    finally:
        _release(rids, owner, job, group)
    if outputs is None:
        return Response(status_code=CLIENT_CLOSED)
    results = answer.results(outputs)
    return JSONResponse(results if job.answers_list else results[0])


class Answer:
    """The answers to one /generate job, built from the engine's cumulative outputs."""

    def __init__(self, job: NativeJob, group: RequestGroup, texts: TokenTexts):
        self.job = job
        self.group = group
        self.texts = texts

    def results(self, outputs: list[RequestOutput | None]) -> list[dict[str, Any]]:
        return [self.result(i, o) for i, o in enumerate(outputs)]

    def latest(self) -> list[RequestOutput | None]:
        """Each member's latest output (None where none came), after an abort by rid."""
        return [m.latest for m in self.group.members]

    async def stream(self, rids: RidTable) -> AsyncIterator[dict[str, Any]]:
        """Cumulative answers as they grow; with several members each carries its "index".
        Members an abort by rid ended get a last answer with finish_reason abort."""
        finished: set[int] = set()
        try:
            async for index, output in self.group.outputs():
                if output.finished:
                    finished.add(index)
                yield self._indexed(index, self.result(index, output))
        except APIError:
            if not rids.aborted(self.group):
                raise
        if rids.aborted(self.group):
            for index, output in enumerate(self.latest()):
                if index not in finished:
                    yield self._indexed(index, self.result(index, output))

    def result(self, index: int, output: RequestOutput | None) -> dict[str, Any]:
        """One member's answer; a member with no output (or unfinished) after an abort by
        rid is reported as aborted (with prompt_tokens null when it was never tokenized)."""
        timing = self.group.timing(index)
        if output is None:
            meta = {"id": self._id(index, None), "finish_reason": {"type": "abort", "message": "aborted by rid"},
                    "prompt_tokens": None, "completion_tokens": 0, "cached_tokens": 0,
                    "ttft_s": None, "e2e_latency": timing.e2e_s}
            return {"text": "", "output_ids": [], "meta_info": meta}
        finished = output.finished or self.group.done
        meta: dict[str, Any] = {
            "id": self._id(index, output),
            "finish_reason": _finish_reason(output) if output.finished else (_ABORT if finished else None),
            "prompt_tokens": output.prompt_tokens,
            "completion_tokens": output.completion_tokens,
            "cached_tokens": output.cached_tokens,
            "ttft_s": timing.ttft_s if output.completion_tokens else None,
            "e2e_latency": timing.e2e_s if finished else None,
        }
        meta.update(self._logprobs(output))
        return {"text": output.text, "output_ids": output.token_ids, "meta_info": meta}

    def _id(self, index: int, output: RequestOutput | None) -> str | None:
        if self.job.rids is not None:
            return self.job.rids[index // self.job.n]
        return output.request_id if output is not None else None

    def _indexed(self, index: int, item: dict[str, Any]) -> dict[str, Any]:
        if len(self.group.members) > 1:
            item["index"] = index
        return item

    def _logprobs(self, output: RequestOutput) -> dict[str, Any]:
        params = self.job.params
        meta: dict[str, Any] = {}
        if output.logprobs is not None:
            meta["output_token_logprobs"] = [self._entry(e.logprob, e.token_id) for e in output.logprobs]
            if params.logprobs:
                meta["output_top_logprobs"] = [self._top(e) for e in output.logprobs]
        elif self.job.return_logprob:
            meta["output_token_logprobs"] = []
        if output.prompt_logprobs is not None:
            start = params.prompt_logprobs_start
            pairs = list(zip(output.prompt_logprobs, output.prompt_token_ids))[start:]
            meta["input_token_logprobs"] = [self._entry(e.logprob if e else None, t) for e, t in pairs]
            if params.prompt_logprobs:
                meta["input_top_logprobs"] = [self._top(e) for e, _ in pairs]
        elif self.job.return_logprob:
            meta["input_token_logprobs"] = []
        return meta

    def _entry(self, logprob: float | None, token_id: int) -> list[Any]:
        text = self.texts.text(token_id) if self.job.return_text_in_logprobs else None
        return [finite(logprob) if logprob is not None else None, token_id, text]

    def _top(self, entry: TokenLogprob | None) -> list[list[Any]] | None:
        if entry is None:
            return None
        return [self._entry(logprob, token_id) for token_id, logprob in entry.top]


_ABORT = {"type": "abort", "message": "aborted by rid"}


def _finish_reason(output: RequestOutput) -> dict[str, Any]:
    if output.finish_reason == "stop":
        return {"type": "stop", "matched": output.stop_reason}
    if output.finish_reason == "length":
        return {"type": "length", "length": output.completion_tokens}
    return {"type": output.finish_reason, "message": "aborted"}


def _release(rids: RidTable, owner: str | None, job: NativeJob, group: RequestGroup) -> None:
    rids.release(owner, job.rids, group)
    group.abort()  # a no-op once every member finished


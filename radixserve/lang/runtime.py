"""Runtime: the in-process backend, an Engine stepped by an EngineLoop.

    backend = rl.Runtime()                         # the default model; any EngineConfig option
    backend = rl.Runtime(enable_prefix_cache=False)
    backend = rl.Runtime(engine=my_engine)         # an existing Engine (left usable after shutdown)
"""

from __future__ import annotations

import queue
from typing import TYPE_CHECKING, Any

from radixserve.engine.loop import EngineLoop
from radixserve.lang.backend import Backend, Completion, TextCallback
from radixserve.lang.choice_scoring import ScoreRequest
from radixserve.outputs import RequestOutput
from radixserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from radixserve.engine import Engine


class Runtime(Backend):
    """Runs programs on an Engine in this process. Thread-safe: each program thread
    prepares (tokenizes, compiles grammars for) its own calls and blocks on them while the
    engine thread batches all of them. The engine loop is shut down by `shutdown()`, or at
    interpreter exit at the latest."""

    def __init__(self, model: str | None = None, *, engine: "Engine | None" = None, **engine_options: Any):
        if engine is None:
            from radixserve.engine import Engine

            engine = Engine(model, **engine_options)
        elif model is not None or engine_options:
            raise ValueError("give either engine= or model/engine options, not both")
        self.engine = engine
        self._loop = EngineLoop(engine, name="radixserve-lang-engine")

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self, prompt_ids: list[int], params: SamplingParams, on_text: TextCallback | None = None,
        session_id: str | None = None,
    ) -> Completion:
        outputs: queue.SimpleQueue[RequestOutput | BaseException] = queue.SimpleQueue()
        prepared = self.engine.prepare(prompt_ids, params, session_id=session_id)
        (request_id,) = self._loop.submit([prepared], outputs.put).result()
        try:
            final = _follow(outputs, on_text)
        except BaseException:
            self._loop.abort([request_id])
            raise
        return Completion(final.text, list(final.token_ids), final.finish_reason, final.prompt_tokens, final.cached_tokens)

    def score(self, requests: list[ScoreRequest]) -> list[list[float]]:
        outputs: queue.SimpleQueue[RequestOutput | BaseException] = queue.SimpleQueue()
        prepared = [
            self.engine.prepare(
                r.token_ids, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, prompt_logprobs_start=r.start)
            )
            for r in requests
        ]
        ids = self._loop.submit(prepared, outputs.put).result()
        finals: dict[str, RequestOutput] = {}
        try:
            while len(finals) < len(ids):
                item = outputs.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    finals[item.request_id] = item
        except BaseException:
            self._loop.abort(ids)
            raise
        return [_scored(finals[i], r) for i, r in zip(ids, requests)]

    def stats(self) -> dict[str, Any]:
        return self._loop.call(lambda engine: engine.stats()).result()

    def flush_cache(self) -> int:
        """Drop the unused prefix-cache entries; returns the number of blocks freed."""
        return self._loop.call(lambda engine: engine.flush_cache()).result()

    def shutdown(self) -> None:
        """Abort what is still running and stop the engine thread (the Engine stays usable)."""
        self._loop.shutdown()


def _follow(outputs: queue.SimpleQueue, on_text: TextCallback | None) -> RequestOutput:
    while True:
        item = outputs.get()
        if isinstance(item, BaseException):
            raise item
        if on_text is not None and item.delta.text:  # what this output adds (never the whole text)
            on_text(item.delta.text)
        if item.finished:
            if item.finish_reason == "abort":
                raise RuntimeError(f"request {item.request_id} was aborted")
            return item


def _scored(output: RequestOutput, request: ScoreRequest) -> list[float]:
    entries = output.prompt_logprobs[request.start:]
    if any(e is None for e in entries):
        raise RuntimeError(f"the engine left prompt logprobs of {output.request_id} uncomputed")
    return [e.logprob for e in entries]

"""The server's own output path, without the model: a synthetic engine stream (a sentence of
content, then tool calls with long arguments, 4 characters a token) as the engine loop hands it
out, pushed in-process into a RequestGroup and through each API's streaming encoder (chat with
tools, completions, Anthropic messages, Responses, native /generate), every chunk framed as its
SSE bytes. Prints the cost per token at each stream length: flat means no step's cost grows with
the answer. One more row, "engine", times the engine's side of the same stream: extending a
request by a token, its logprob and its text (a stop string checked and held back), and building
the step's output as Engine.step returns it (not the model, not detokenizing). A second table
times that engine side alone at longer answers (--engine-lengths), with logprobs on and off,
beside "before": the same steps as the engine took them before outputs were deltas and views
(846554d's OutputProcessor and the loop's delta slicing, copied here), copying the answer's
token ids, logprobs and text every step. The engine side is timed in the process's CPU time
(one thread's work: what other load on a shared host takes stays out); the APIs in wall time.

    .venv/bin/python -m bench.bench_output_path            # lengths 500 1000 2000 (engine 500 2000 8000), best of 5
    .venv/bin/python -m bench.bench_output_path --quick    # best of 2
    .venv/bin/python -m bench.bench_output_path --json     # one JSON object on stdout
    .venv/bin/python -m bench.bench_output_path --plot output_path.png
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Callable
from typing import Any

from bench.lib.cli import apply_quick, bench_parser, write_json
from bench.lib.report import plot_bars
from radixserve import outputs as engine_outputs
from radixserve.core.request import Request, RequestStatus
from radixserve.engine.output import OutputProcessor
from radixserve.outputs import RequestOutput, TokenLogprob
from radixserve.sampling_params import SamplingParams
from radixserve.server.protocol.jobs import GenerationJob, NativeJob
from radixserve.server.request_group import GenerationInput, RequestGroup
from radixserve.server.response_store import ResponseStore
from radixserve.server.sse import EventStream
from radixserve.server.token_text import TokenTexts
from radixserve.tools import HERMES
from radixserve.tools.definitions import FunctionDefinition, ToolDefinition, ToolSpec
from radixserve.tools.parser import ToolCallParser
from radixserve.server.tool_calling import ToolCalling, ToolOutput

try:  # each API's module in server/api/
    from radixserve.server.api.anthropic import AnthropicEventStream, MessagesResponder
    from radixserve.server.api.chat import ChatResponder
    from radixserve.server.api.completions import CompletionResponder
    from radixserve.server.api.native import Answer
    from radixserve.server.api.responses import ResponsesResponder
    from radixserve.server.api.sglang import RidTable
    from radixserve.server.protocol.responses import ResponsesRequest
except ImportError:  # an older tree (flat server/ modules), measured for comparison
    from radixserve.server.anthropic_output import MessagesResponder
    from radixserve.server.anthropic_sse import AnthropicEventStream
    from radixserve.server.native_api import Answer
    from radixserve.server.openai_chat import ChatResponder
    from radixserve.server.openai_completions import CompletionResponder
    from radixserve.server.responses_api import ResponsesRequest, ResponsesResponder
    from radixserve.server.sglang_api import RidTable

CHARS_PER_TOKEN = 4
PROMPT = list(range(1, 65))
TOOLS = ("write_file", "search")
SPEC = ToolSpec(tuple(ToolDefinition(type="function", function=FunctionDefinition(name=n)) for n in TOOLS), "auto")


def script(num_tokens: int) -> str:
    """The answer's text: content, then calls whose arguments are long strings."""
    text = "I will write the notes and then search for more. "
    body = "the quick brown fox jumps over the lazy dog, " * 24
    i = 0
    while len(text) < num_tokens * CHARS_PER_TOKEN:
        name = TOOLS[i % 2]
        args = json.dumps({"path": f"notes_{i}.txt", "content": body} if name == "write_file" else {"query": body})
        text += f'<tool_call>\n{{"name": "{name}", "arguments": {args}}}\n</tool_call>\n'
        i += 1
    return text[: num_tokens * CHARS_PER_TOKEN]


def engine_stream(num_tokens: int) -> list[RequestOutput]:
    """The outputs an engine loop hands out for a `num_tokens` answer, one token a step: as
    Engine.step builds them (deltas and views) where this tree's engine does, else each
    cumulative, with its delta where this tree's loop sets one."""
    if hasattr(OutputProcessor, "add_text"):
        return _engine_outputs(num_tokens)
    text, outs = script(num_tokens), []
    has_delta = hasattr(engine_outputs, "OutputDelta")
    for i in range(1, num_tokens + 1):
        done = i == num_tokens
        out = RequestOutput("bench-0", None, PROMPT, list(range(i)), text[: i * CHARS_PER_TOKEN], done,
                            "stop" if done else None, cached_tokens=32)
        if has_delta:
            piece = text[(i - 1) * CHARS_PER_TOKEN: i * CHARS_PER_TOKEN]
            out.delta = engine_outputs.OutputDelta([i - 1], None, piece, i == 1)
        outs.append(out)
    return outs


def _job(num_tokens: int) -> GenerationJob:
    return GenerationJob("m", [PROMPT], [SamplingParams(max_tokens=num_tokens)], 1, True, True)


def encoders(num_tokens: int) -> dict[str, Callable[[RequestGroup], Any]]:
    """Per API: a function from a group to (its chunks, the frame that turns one into bytes)."""
    job, texts, parser = _job(num_tokens), TokenTexts(None), lambda: ToolCallParser(HERMES, TOOLS)
    sse = EventStream(None, lambda: None).frame  # type: ignore[arg-type]
    anthropic = AnthropicEventStream(None, lambda: None).frame  # type: ignore[arg-type]
    responses_body = ResponsesRequest.model_validate({"model": "m", "input": "go", "stream": True, "store": False,
                                                      "tools": [{"type": "function", "name": n} for n in TOOLS]})
    native = NativeJob([PROMPT], SamplingParams(max_tokens=num_tokens), True, False, None)
    return {
        "chat": lambda g: (ChatResponder(job, texts, ToolOutput(SPEC, HERMES)).chunks(g), sse),
        "completions": lambda g: (CompletionResponder(job, texts).chunks(g), sse),
        "anthropic": lambda g: (MessagesResponder(job, parser(), []).chunks(g), anthropic),
        "responses": lambda g: (ResponsesResponder(job, responses_body, SPEC, ToolCalling(None, "hermes"),
                                                   ResponseStore().for_owner(None), []).chunks(g), sse),
        "native": lambda g: (Answer(native, g, texts).stream(RidTable()), sse),
    }


async def _run_once(make: Callable[[RequestGroup], Any], stream: list[RequestOutput]) -> float:
    """Seconds to push the stream into a group and encode and frame every chunk."""
    group = RequestGroup("bench", [GenerationInput(PROMPT, SamplingParams())], lambda g: None)
    start = time.perf_counter()
    for output in stream:
        group.push(0, output)
    chunks, frame = make(group)
    size = 0
    async for chunk in chunks:
        size += len(frame(chunk))
    elapsed = time.perf_counter() - start
    assert size > len(stream), "the encoder sent less than a byte a token"
    return elapsed


_clock = time.process_time  # the engine side is one thread's work: its CPU time (a shared host's load stays out)
STOP = ["</never>"]  # a stop string the answer never holds: checked and held back every step
LOGPROB = TokenLogprob(0, -0.5, [(0, -0.5), (1, -1.5)])


def _params(num_tokens: int, logprobs: bool) -> SamplingParams:
    return SamplingParams(max_tokens=num_tokens, stop=STOP, logprobs=1 if logprobs else None)


def _pieces(num_tokens: int) -> list[str]:
    text = script(num_tokens)
    return [text[i * CHARS_PER_TOKEN: (i + 1) * CHARS_PER_TOKEN] for i in range(num_tokens)]


def _engine_outputs(num_tokens: int) -> list[RequestOutput]:
    """The outputs this tree's engine builds for the answer (no stop string: all text shown)."""
    request = Request("bench-0", PROMPT, SamplingParams(max_tokens=num_tokens), len(PROMPT) + num_tokens)
    processor, outs = OutputProcessor(None, set()), []
    for i, piece in enumerate(_pieces(num_tokens)):
        request.token_ids.append(i)
        reason, _ = processor.add_text(request, i, piece)
        if reason is not None:
            request.status, request.finish_reason = RequestStatus.FINISHED, "stop"
        out = processor.output(request)
        out.cached_tokens = 32
        outs.append(out)
    return outs


def engine_side(num_tokens: int, logprobs: bool = True) -> float:
    """Seconds the engine spends outside the model on a `num_tokens` answer: each token
    appended with its logprob and its text (stop checks, a stop string held back), then the
    step's output built: what Engine.step returns (its delta, views of the whole)."""
    pieces = _pieces(num_tokens)
    request = Request("bench-0", PROMPT, _params(num_tokens, logprobs), len(PROMPT) + num_tokens)
    processor = OutputProcessor(None, set())
    start = _clock()
    for i, piece in enumerate(pieces):
        request.token_ids.append(i)
        if logprobs:
            request.logprobs.append(LOGPROB)
        processor.add_text(request, i, piece)
        processor.output(request)
    return _clock() - start


class _BeforeRequest(Request):
    """The request as 846554d kept it: its text one string, extended by concatenation."""

    def __init__(self, *args: Any):
        super().__init__(*args)
        self.__dict__["output_text"] = ""  # a plain attribute, as it was (not GrowingText)

    output_text = None  # type: ignore[assignment]  # shadows Request.output_text: the instance's own


@dataclasses.dataclass
class _BeforeOutput:
    """846554d's RequestOutput: a dataclass of whole lists and strings."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None
    stop_reason: str | int | None = None
    cached_tokens: int = 0
    restored_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_preemptions: int = 0
    metrics: dict[str, float] = dataclasses.field(default_factory=dict)
    delta: Any = None


class _BeforeOutputs:
    """846554d's OutputProcessor (add_token, its stop checks and output) and the engine loop's
    _Subscriber.hand, copied: every step copied the token ids, the logprobs and the shown text
    into a cumulative RequestOutput, then the loop sliced its delta back out of it."""

    def __init__(self) -> None:
        self.eos_token_ids: set[int] = set()
        self.sent_tokens = self.sent_chars = 0
        self.started = False

    def add_text(self, request: _BeforeRequest, token: int, piece: str) -> Any:
        text_before = len(request.output_text)
        request.output_text += piece
        return self._stop_check(request, token, text_before)

    def output(self, request: _BeforeRequest) -> _BeforeOutput:
        text = request.output_text
        if not request.finished and request.params.stop:
            text = text[: max(0, len(text) - request.params.max_stop_len + 1)]
        metrics: dict[str, float] = {}
        if request.first_token_time is not None:
            metrics["ttft_s"] = request.first_token_time - request.arrival_time
        output = _BeforeOutput(
            request_id=request.request_id, prompt=request.prompt, prompt_token_ids=request.prompt_token_ids,
            token_ids=request.output_token_ids, text=text, finished=request.finished,
            finish_reason=request.finish_reason, stop_reason=request.stop_reason,
            cached_tokens=request.cached_tokens, restored_tokens=request.restored_tokens,
            logprobs=list(request.logprobs) if request.params.logprobs is not None else None,
            prompt_logprobs=list(request.prompt_logprobs) if request.prompt_logprobs is not None else None,
            num_preemptions=request.num_preemptions, metrics=metrics,
        )
        tokens, logprobs = output.token_ids, output.logprobs  # the loop's _Subscriber.hand
        output.delta = engine_outputs.OutputDelta(
            tokens[self.sent_tokens:], logprobs[self.sent_tokens:] if logprobs is not None else None,
            output.text[self.sent_chars:], not self.started,
        )
        self.sent_tokens, self.started = len(tokens), True
        self.sent_chars = max(self.sent_chars, len(output.text))
        return output

    def _stop_check(self, request: _BeforeRequest, token: int, text_before: int) -> Any:
        params = request.params
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token in self.eos_token_ids:
                return "stop", None
            if token in params.stop_token_ids:
                return "stop", token
            if params.stop:  # find_stop_string (a stop string the bench's text never holds)
                text = request.output_text
                offset = max(0, text_before - params.max_stop_len + 1)
                window = text[offset:]
                best = None
                for stop in params.stop:
                    i = window.find(stop)
                    if i >= 0 and (best is None or i < best[0]):
                        best = (i, stop)
                if best is not None:
                    raise AssertionError("the bench's text holds its stop string")
        if request.grammar is not None and request.grammar.is_terminated():
            return "stop", None
        if request.num_tokens >= request.max_total_tokens:
            return "length", None
        return None, None


def engine_side_before(num_tokens: int, logprobs: bool = True) -> float:
    """engine_side, the way 846554d's engine and loop did it (_BeforeOutputs)."""
    pieces = _pieces(num_tokens)
    request = _BeforeRequest("bench-0", PROMPT, _params(num_tokens, logprobs), len(PROMPT) + num_tokens)
    processor = _BeforeOutputs()
    start = _clock()
    for i, piece in enumerate(pieces):
        request.token_ids.append(i)
        if logprobs:
            request.logprobs.append(LOGPROB)
        processor.add_text(request, i, piece)
        processor.output(request)
    return _clock() - start


def measure(lengths: list[int], repeats: int) -> dict[str, dict[int, float]]:
    """Microseconds per token, best of `repeats`, per API (and the engine side) and stream length."""
    results: dict[str, dict[int, float]] = {}
    for length in lengths:
        stream = engine_stream(length)
        for api, make in encoders(length).items():
            best = min(asyncio.run(_run_once(make, stream)) for _ in range(repeats))
            results.setdefault(api, {})[length] = best / length * 1e6
        results.setdefault("engine", {})[length] = min(engine_side(length) for _ in range(repeats)) / length * 1e6
    return results


ENGINE_ROWS: dict[str, Callable[[int], float]] = {
    "before, logprobs": lambda n: engine_side_before(n, True),
    "now, logprobs": lambda n: engine_side(n, True),
    "before, none": lambda n: engine_side_before(n, False),
    "now, none": lambda n: engine_side(n, False),
}


def measure_engine(lengths: list[int], repeats: int) -> dict[str, dict[int, float]]:
    """The engine side alone, before and now, with logprobs and without: microseconds per
    token, best of `repeats`, per answer length (the rows interleaved, so load hits all alike)."""
    results: dict[str, dict[int, float]] = {}
    for length in lengths:
        best = {row: float("inf") for row in ENGINE_ROWS}
        for _ in range(repeats):
            for row, run in ENGINE_ROWS.items():
                best[row] = min(best[row], run(length))
        for row, seconds in best.items():
            results.setdefault(row, {})[length] = seconds / length * 1e6
    return results


def main(argv: list[str] | None = None) -> None:
    parser = bench_parser(__doc__, quick="two runs per point",
                          plot="write a bar chart (us per token by API and length) here (PNG)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[500, 1000, 2000], help="tokens per stream")
    parser.add_argument("--engine-lengths", type=int, nargs="+", default=[500, 2000, 8000],
                        help="tokens per answer for the engine side's own table")
    parser.add_argument("--repeats", type=int, default=5, help="runs per point; the best is kept")
    args = parser.parse_args(argv)
    apply_quick(parser, args, repeats=2)
    results = measure(args.lengths, args.repeats)
    _print_table("output path", "api", results, args.lengths, args.repeats)
    engine = measure_engine(args.engine_lengths, args.repeats)
    print()
    _print_table("engine side (a token, its logprob and text, the step's output)", "engine", engine,
                 args.engine_lengths, args.repeats)
    if args.json:
        write_json(args.json, {"unit": "us_per_token", "lengths": args.lengths, "repeats": args.repeats,
                               "results": {api: {str(k): round(v, 2) for k, v in r.items()}
                                           for api, r in results.items()},
                               "engine_lengths": args.engine_lengths,
                               "engine": {row: {str(k): round(v, 2) for k, v in r.items()}
                                          for row, r in engine.items()}}, args)
    if args.plot:
        plot_bars(args.plot, "output path: microseconds per token", [f"{n} tokens" for n in args.lengths],
                  {api: [r[n] for n in args.lengths] for api, r in results.items()}, "us per token")


def _print_table(title: str, label: str, results: dict[str, dict[int, float]], lengths: list[int],
                 repeats: int) -> None:
    print(f"{title}, microseconds per token (best of {repeats}); last column: longest / shortest")
    width = max(12, *(len(name) + 2 for name in results))
    print(f"{label:<{width}}" + "".join(f"{n:>10}" for n in lengths) + f"{'ratio':>8}")
    for name, per_length in results.items():
        row = [per_length[n] for n in lengths]
        print(f"{name:<{width}}" + "".join(f"{v:>10.1f}" for v in row) + f"{row[-1] / row[0]:>8.2f}")


if __name__ == "__main__":
    main()

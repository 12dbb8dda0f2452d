"""The server's own output path, without the model: a synthetic engine stream (a sentence of
content, then tool calls with long arguments, 4 characters a token) as the engine loop hands it
out, pushed in-process into a RequestGroup and through each API's streaming encoder (chat with
tools, completions, Anthropic messages, Responses, native /generate), every chunk framed as its
SSE bytes. Prints the cost per token at each stream length: flat means no step's cost grows with
the answer. One more row, "engine", times the engine's side of the same stream: extending a
request by a token and its text, and building Engine.step's cumulative RequestOutput (not the
model, not detokenizing).

    .venv/bin/python -m bench.bench_output_path            # lengths 500 1000 2000, best of 5
    .venv/bin/python -m bench.bench_output_path --quick    # best of 2
    .venv/bin/python -m bench.bench_output_path --json     # one JSON object on stdout
    .venv/bin/python -m bench.bench_output_path --plot output_path.png
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

from bench.cli import apply_quick, bench_parser, write_json
from bench.report import plot_bars
from radixserve import outputs as engine_outputs
from radixserve.core.request import Request
from radixserve.engine.output import OutputProcessor
from radixserve.outputs import RequestOutput
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
    """The outputs an engine loop hands out for a `num_tokens` answer, one token a step: each
    cumulative as Engine.step builds it, with its delta where this tree's loop sets one."""
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


def engine_side(num_tokens: int) -> float:
    """Seconds the engine spends outside the model on a `num_tokens` answer: each token
    appended with its text, then the step's RequestOutput built (what Engine.step returns)."""
    text = script(num_tokens)
    request = Request("bench-0", PROMPT, SamplingParams(max_tokens=num_tokens), len(PROMPT) + num_tokens)
    processor = OutputProcessor(None, set())
    start = time.perf_counter()
    for i in range(num_tokens):
        request.token_ids.append(i)
        request.output_text += text[i * CHARS_PER_TOKEN: (i + 1) * CHARS_PER_TOKEN]
        processor.output(request)
    return time.perf_counter() - start


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


def main(argv: list[str] | None = None) -> None:
    parser = bench_parser(__doc__, quick="two runs per point",
                          plot="write a bar chart (us per token by API and length) here (PNG)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[500, 1000, 2000], help="tokens per stream")
    parser.add_argument("--repeats", type=int, default=5, help="runs per point; the best is kept")
    args = parser.parse_args(argv)
    apply_quick(parser, args, repeats=2)
    results = measure(args.lengths, args.repeats)
    _print_table(results, args.lengths, args.repeats)
    if args.json:
        write_json(args.json, {"unit": "us_per_token", "lengths": args.lengths, "repeats": args.repeats,
                               "results": {api: {str(k): round(v, 2) for k, v in r.items()}
                                           for api, r in results.items()}}, args)
    if args.plot:
        plot_bars(args.plot, "output path: microseconds per token", [f"{n} tokens" for n in args.lengths],
                  {api: [r[n] for n in args.lengths] for api, r in results.items()}, "us per token")


def _print_table(results: dict[str, dict[int, float]], lengths: list[int], repeats: int) -> None:
    print(f"output path, microseconds per token (best of {repeats}); last column: longest / shortest")
    print(f"{'api':<12}" + "".join(f"{n:>10}" for n in lengths) + f"{'ratio':>8}")
    for api, per_length in results.items():
        row = [per_length[n] for n in lengths]
        print(f"{api:<12}" + "".join(f"{v:>10.1f}" for v in row) + f"{row[-1] / row[0]:>8.2f}")


if __name__ == "__main__":
    main()

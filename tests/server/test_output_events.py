"""OutputEvents: one engine request's deltas as typed events, the same whether streamed in
pieces or taken whole; usage spelt per API from one count."""

from __future__ import annotations

from dataclasses import replace

from radixserve.outputs import OutputDelta, RequestOutput
from radixserve.server.output.events import CallArguments, CallEnd, CallStart, Finish, OutputEvents, TextDelta
from radixserve.server.output.usage import Usage
from radixserve.tools import HERMES
from radixserve.tools.parser import ToolCallParser

TEXT = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
        '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>')


def outputs(text: str, piece: int) -> list[RequestOutput]:
    """The outputs an engine loop would hand out for `text`, `piece` characters a step."""
    out, sent = [], 0
    for end in range(piece, len(text) + piece, piece):
        end = min(end, len(text))
        finished = end == len(text)
        output = RequestOutput("r", None, [1, 2, 3], list(range(end)), text[:end], finished,
                               "stop" if finished else None, cached_tokens=2)
        output.delta = OutputDelta(list(range(sent, end)), None, text[sent:end], sent == 0)
        out.append(output)
        sent = end
    return out


def stream(text: str, piece: int) -> list:
    events = OutputEvents(ToolCallParser(HERMES, {"get_weather", "add"}))
    return [e for output in outputs(text, piece) for e in events.step(output)]


def merged(events: list) -> list:
    """Events with adjacent text and argument pieces joined and ids dropped (they are random)."""
    out: list = []
    for e in events:
        if out and type(e) is type(out[-1]) and isinstance(e, (TextDelta, CallArguments)):
            out[-1] = replace(out[-1], text=out[-1].text + e.text)
        else:
            out.append(replace(e, id_hex="") if isinstance(e, CallStart) else e)
    return out


def test_a_stream_in_any_pieces_makes_the_events_of_the_whole_output():
    whole = OutputEvents(ToolCallParser(HERMES, {"get_weather", "add"})).whole(outputs(TEXT, len(TEXT))[-1])
    assert merged(whole) == [
        TextDelta("Let me check. "), CallStart(0, "", "get_weather"), CallArguments(0, '{"city": "Paris"}'),
        CallEnd(0, '{"city": "Paris"}'), CallStart(1, "", "add"), CallArguments(1, '{"a": 1, "b": 2}'),
        CallEnd(1, '{"a": 1, "b": 2}'), Finish("stop", None, 2, Usage(3, 2, len(TEXT))),
    ]
    for piece in (1, 3, 7, 40):
        assert merged(stream(TEXT, piece)) == merged(whole)


def test_every_call_gets_its_own_id_and_content_after_a_call_ends_it():
    events = stream(TEXT[:86] + "done", 5)
    starts = [e for e in events if isinstance(e, CallStart)]
    assert len(starts) == 1 and len(starts[0].id_hex) == 24
    kinds = [type(e).__name__ for e in merged(events)]
    assert kinds == ["TextDelta", "CallStart", "CallArguments", "CallEnd", "TextDelta", "Finish"]


def test_without_a_parser_all_text_is_content():
    events = OutputEvents(None)
    got = [e for output in outputs("plain <tool_call> text", 4) for e in events.step(output)]
    assert "".join(e.text for e in got if isinstance(e, TextDelta)) == "plain <tool_call> text"
    assert got[-1] == Finish("stop", None, 0, Usage(3, 2, 22))


def test_usage_is_counted_once_and_spelt_per_api():
    usage = Usage(10, 4, 3)
    assert usage.openai() == {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13,
                              "prompt_tokens_details": {"cached_tokens": 4}}
    assert usage.anthropic() == {"input_tokens": 6, "output_tokens": 3, "cache_read_input_tokens": 4,
                                 "cache_creation_input_tokens": 0}
    assert usage.responses()["input_tokens"] == 10 and usage.responses()["total_tokens"] == 13
    a = RequestOutput("a", None, [1] * 10, [5, 6], "", True, "stop", cached_tokens=4)
    b = RequestOutput("b", None, [1] * 10, [7], "", True, "stop", cached_tokens=4)
    assert Usage.of_group(1, 2, [a, b]) == Usage(10, 4, 3)  # one prompt, two samples: counted once


def test_the_output_path_bench_runs_every_encoder():
    from bench.bench_output_path import measure

    results = measure([40, 80], repeats=1)
    assert set(results) == {"chat", "completions", "anthropic", "responses", "native", "engine"}
    assert all(v > 0 for per_length in results.values() for v in per_length.values())

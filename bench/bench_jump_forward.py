"""Jump-forward under a grammar: engine steps per tool call (and per JSON-schema answer) with
the forced text drafted and verified in one step, against stepping through it token by token
(--no-jump-forward); greedy outputs compared token for token.

    .venv/bin/python -m bench.bench_jump_forward                  # the default model
    .venv/bin/python -m bench.bench_jump_forward --model gemma3-270m --quick

Each workload runs its requests one at a time (batch 1) on an engine of each kind, in turns;
steps counts every engine step a request took (its prompt's too), wall the seconds.
"""

from __future__ import annotations

import sys
import time

from bench.lib.cli import Figures, apply_quick, bench_parser
from radixserve import Engine, SamplingParams

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": ADD}}]
ASKS = ["What is the weather in Paris? Use celsius.", "Add 12 and 30.", "What's the weather like in Tokyo in fahrenheit?",
        "Please add 7 and 8 for me.", "Is it raining in London? Celsius please.", "What is 250 plus 17?"]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "city": {"enum": ["Paris", "London", "Tokyo"]}},
          "required": ["name", "age", "city"], "additionalProperties": False}
RECORDS = ["Describe a person as JSON: ", "A user record: ", "Someone from Tokyo, as JSON: "]


def run(engine: Engine, workload: str, n: int) -> tuple[int, float, list[list[int]]]:
    """(steps, seconds, output ids) for the workload's first n requests, one at a time."""
    greedy = SamplingParams(max_tokens=200, temperature=0.0)
    steps, t0, outs = engine.scheduler.stats.steps, time.perf_counter(), []
    for i in range(n):
        if workload == "tool calls":
            (out,) = engine.chat([{"role": "user", "content": ASKS[i % len(ASKS)]}], greedy, tools=TOOLS,
                                 tool_choice="required", parallel_tool_calls=False)
        else:
            (out,) = engine.generate([RECORDS[i % len(RECORDS)]], SamplingParams(max_tokens=80, temperature=0.0,
                                                                                 json_schema=PERSON))
        outs.append(list(out.token_ids))
    return engine.scheduler.stats.steps - steps, time.perf_counter() - t0, outs


def main(argv: list[str] | None = None) -> int:
    p = bench_parser(__doc__, quick="three requests a workload")
    p.add_argument("--model", default=None, help="default: the default model")
    p.add_argument("--requests", type=int, default=6)
    args = p.parse_args(argv)
    apply_quick(p, args, requests=3)
    engines = {"jump-forward": Engine(args.model), "stepping": Engine(args.model, jump_forward=False)}
    for engine in engines.values():  # compile the grammars, warm the kernels
        run(engine, "tool calls", 1)
        run(engine, "json schema", 1)
    figures = Figures()
    print(f"batch 1, {args.requests} requests a workload, greedy")
    print(f"  {'workload':<12} {'engine':<13} {'steps/request':>13} {'tokens/request':>14} {'s/request':>9}")
    for workload in ("tool calls", "json schema"):
        result = {label: run(engine, workload, args.requests) for label, engine in engines.items()}
        for label, (steps, wall, outs) in result.items():
            tokens = sum(len(o) for o in outs) / args.requests
            print(f"  {workload:<12} {label:<13} {steps / args.requests:>13.1f} {tokens:>14.1f} {wall / args.requests:>9.3f}")
            figures.add(workload, f"{label} steps", steps / args.requests, seconds=wall / args.requests)
        (js, jw, jo), (ss, sw, so) = result["jump-forward"], result["stepping"]
        print(f"  {workload}: steps {js / ss:.2f}x, wall {jw / sw:.2f}x, greedy outputs identical: {jo == so}"
              f" [{'meets' if js <= 0.6 * ss and jo == so else 'BELOW'} target: <= 0.6x steps, identical]")
    stats = engines["jump-forward"].drafter.stats
    print(f"forced drafts {stats.forced_drafts}: {stats.forced_tokens} tokens, {stats.forced_accepted} accepted")
    figures.finish(args, "engine steps per request, batch 1", "steps")
    return 0


if __name__ == "__main__":
    sys.exit(main())

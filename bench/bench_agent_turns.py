"""Agent loops over chat completions with tools: does the next turn compute only what is new?

    python -m bench.bench_agent_turns [--quick] [--agents 6 --turns 5] [--systems on,off]
                                      [--json agent_turns.json] [--plot agent_turns.png]

Several agents run at once against a `radixserve serve` started for each system (the default
model, --reply-token-reuse on, then off), each through the official openai client with two
tools. Every turn re-sends the whole conversation: the agent's task, each earlier reply (its
content and tool calls, as the server returned them) and a tool result for each call. Turns
alternate tool_choice `required` and `auto`; some turns are cut by a small max_tokens inside
the call (finish_reason `length`), and the agent answers those with an error result, as an
agent framework would. Sampling at temperature 0.7, seeded per agent and turn.

For each system it reports the agents stopped by an error (target 0) and the prompt tokens
computed beyond what whole blocks of the previous turn allow: turn k+1 may take from the cache
every whole block of what turn k computed (its prompt and reply, less the last sampled token),
so `allowed - cached_tokens` (usage.prompt_tokens_details.cached_tokens) is what was computed
again; summed, as a share of the earlier replies' tokens (target <= 5%), by the kind of the
earlier reply: tool calls, a call cut by max_tokens, text.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any

from bench.lib.cli import bench_parser, write_json

BLOCK_SIZE = 16
TARGET_SHARE = 0.05
CITIES = ["Paris", "Oslo", "Lima", "Cairo", "Hanoi", "Quito", "Perth", "Dakar", "Riga", "Sapporo", "Tunis", "Porto"]
TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                       "required": ["city", "unit"]}}},
    {"type": "function", "function": {
        "name": "add", "description": "Add two integers",
        "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                       "required": ["a", "b"]}}},
]


@dataclass(frozen=True)
class ToolLoops:
    agents: int
    turns: int
    max_tokens: int = 64
    cut_tokens: int = 22  # a cut turn's max_tokens: inside a get_weather call's arguments
    cut_every: int = 4  # turn t of agent i is cut when (i + t) % cut_every == cut_every - 1
    name: str = "tool-loops"

    def describe(self) -> str:
        return (f"{self.agents} agents x {self.turns} turns, the default model, 2 tools; tool_choice required and "
                f"auto alternating; max_tokens {self.max_tokens}, {self.cut_tokens} on every {self.cut_every}th "
                f"turn (cut inside a call); temperature 0.7, seeded; blocks of {BLOCK_SIZE} tokens")

    def plan(self, agent: int, turn: int) -> tuple[str, int]:
        """(tool_choice, max_tokens) of an agent's turn."""
        if (agent + turn) % self.cut_every == self.cut_every - 1:
            return "required", self.cut_tokens
        return ("required" if (agent + turn) % 2 == 0 else "auto"), self.max_tokens


FULL = ToolLoops(agents=6, turns=5)
QUICK = ToolLoops(agents=3, turns=3)


@dataclass
class Turn:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    kind: str  # "tool calls", "cut call", "text"
    finish_reason: str


@dataclass
class AgentRun:
    turns: list[Turn] = field(default_factory=list)
    error: str | None = None


@dataclass
class SystemResult:
    name: str
    wall_s: float
    agents: list[AgentRun]

    @property
    def stopped(self) -> int:
        return sum(a.error is not None for a in self.agents)

    def recomputed(self, kind: str | None = None) -> tuple[int, int]:
        """(tokens computed beyond the previous turn's whole blocks, the earlier replies' tokens)."""
        extra = earlier = 0
        for agent in self.agents:
            for before, after in zip(agent.turns, agent.turns[1:]):
                if kind is not None and before.kind != kind:
                    continue
                allowed = min((before.prompt_tokens + before.completion_tokens - 1) // BLOCK_SIZE,
                              (after.prompt_tokens - 1) // BLOCK_SIZE) * BLOCK_SIZE
                extra += max(0, allowed - after.cached_tokens)
                earlier += before.completion_tokens
        return extra, earlier

    def share(self, kind: str | None = None) -> float:
        extra, earlier = self.recomputed(kind)
        return extra / earlier if earlier else 0.0


# ---- one agent ---------------------------------------------------------------------------------


def run_agent(url: str, model: str, workload: ToolLoops, agent: int, bar: Any) -> AgentRun:
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key=os.environ.get("RADIXSERVE_API_KEY") or "unused",
                           max_retries=0, timeout=600)
    cities = CITIES[2 * agent % len(CITIES)], CITIES[(2 * agent + 1) % len(CITIES)]
    history: list[dict[str, Any]] = [{"role": "user", "content": f"What is the weather in {cities[0]} and in "
                                                                 f"{cities[1]}? Use celsius, then add the two."}]
    run = AgentRun()
    for turn in range(workload.turns):
        tool_choice, max_tokens = workload.plan(agent, turn)
        try:
            out = client.chat.completions.create(model=model, messages=history, tools=TOOLS, tool_choice=tool_choice,
                                                 max_tokens=max_tokens, temperature=0.7, seed=1000 * agent + turn)
        except openai.OpenAIError as exc:
            run.error = f"turn {turn}: {type(exc).__name__}: {exc}"
            break
        finally:
            bar.update(1)
        choice = out.choices[0]
        run.turns.append(_turn(out))
        history += _next_messages(choice.message, agent, turn)
    return run


def _turn(out: Any) -> Turn:
    choice = out.choices[0]
    details = out.usage.prompt_tokens_details
    if choice.message.tool_calls:
        kind = "cut call" if choice.finish_reason == "length" else "tool calls"
    else:
        kind = "text"
    return Turn(out.usage.prompt_tokens, out.usage.completion_tokens, details.cached_tokens if details else 0, kind,
                choice.finish_reason)


def _next_messages(message: Any, agent: int, turn: int) -> list[dict[str, Any]]:
    """The reply as the agent re-sends it, and what answers it: a result per call, or a user turn."""
    reply: dict[str, Any] = {"role": "assistant", "content": message.content}
    if not message.tool_calls:
        return [reply, {"role": "user", "content": f"Thanks. Now check {CITIES[(agent + turn) % len(CITIES)]}."}]
    reply["tool_calls"] = [{"id": c.id, "type": "function",
                            "function": {"name": c.function.name, "arguments": c.function.arguments}}
                           for c in message.tool_calls]
    return [reply] + [{"role": "tool", "tool_call_id": c.id, "content": _tool_result(c.function)}
                      for c in message.tool_calls]


def _tool_result(function: Any) -> str:
    try:
        arguments = json.loads(function.arguments)
    except ValueError:
        return "error: your call was cut off before its arguments ended; call again"
    if function.name == "add" and isinstance(arguments, dict):
        return json.dumps({"sum": int(arguments.get("a", 0) or 0) + int(arguments.get("b", 0) or 0)})
    city = str(arguments.get("city", "?")) if isinstance(arguments, dict) else "?"
    return json.dumps({"city": city, "temperature_c": 10 + len(city) % 15, "sky": "clear"})


# ---- one system --------------------------------------------------------------------------------


def run_system(name: str, reuse: str, args: argparse.Namespace, workload: ToolLoops) -> SystemResult:
    from bench.lib.servers import served
    from bench.lib.harness import progress

    command = [sys.executable, "-m", "radixserve", "serve", "--log-level", "warning", "--reply-token-reuse", reuse]
    command += ["--model", args.model] if args.model else []
    with served(command) as url:
        model = _served_model(url)
        bar = progress(workload.agents * workload.turns, f"{name}: requests")
        start = time.perf_counter()
        with ThreadPoolExecutor(workload.agents) as pool:
            agents = list(pool.map(lambda i: run_agent(url, model, workload, i, bar), range(workload.agents)))
        wall = time.perf_counter() - start
        bar.close()
    return SystemResult(name, wall, agents)


def _served_model(url: str) -> str:
    import httpx

    return httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]


# ---- report ------------------------------------------------------------------------------------


KINDS = ("tool calls", "cut call", "text")


def print_report(workload: ToolLoops, results: list[SystemResult]) -> None:
    from bench.lib.report import print_header

    print_header("Agent turns: prompt tokens computed again beyond the previous turn's whole blocks",
                 [workload.describe(), "systems: --reply-token-reuse on (the earlier replies' generated ids "
                                       "spliced into the prompt) and off (their text tokenized again)"])
    print(f"{'system':<18}{'wall s':>8}{'stopped':>9}{'replies':>9}" + "".join(f"{k:>22}" for k in KINDS)
          + f"{'all replies':>22}")
    for r in results:
        replies = sum(len(a.turns) for a in r.agents)
        cells = []
        for kind in KINDS + (None,):
            extra, earlier = r.recomputed(kind)
            cells.append(f"{extra:>5}/{earlier:<5} {r.share(kind):>6.1%}   ")
        print(f"{r.name:<18}{r.wall_s:>8.1f}{r.stopped:>9}{replies:>9}" + "".join(f"{c:>22}" for c in cells))
    print("  (each cell: tokens computed again / the earlier replies' tokens, and the share)")
    for r in results:
        verdict = "meets" if r.stopped == 0 and r.share() <= TARGET_SHARE else "MISSES"
        print(f"{r.name}: {r.stopped} agents stopped by an error (target 0); {r.share():.1%} of the earlier replies' "
              f"tokens computed again (target <= {TARGET_SHARE:.0%}) [{verdict} target]")
        for agent, run in enumerate(r.agents):
            if run.error:
                print(f"  agent {agent} stopped at {run.error}")
    by_name = {r.name: r for r in results}
    if "reuse on" in by_name and "reuse off" in by_name:
        on, off = by_name["reuse on"].recomputed()[0], by_name["reuse off"].recomputed()[0]
        print(f"reuse on computes {on} tokens again where reuse off computes {off}"
              + (f" ({off / on:.1f}x)" if on else ""))


def plot(path: str, results: list[SystemResult]) -> None:
    from bench.lib.report import plot_bars

    groups = list(KINDS) + ["all"]
    series = {r.name: [100 * r.share(k) for k in KINDS] + [100 * r.share()] for r in results}
    plot_bars(path, "Earlier replies' tokens computed again on the next turn", groups, series, "% of reply tokens")


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, quick=f"{QUICK.agents} agents x {QUICK.turns} turns",
                          plot="write a bar chart of the shares here (PNG)",
                          json_help="write every turn's usage and the summary here (JSON)")
    parser.add_argument("--agents", type=int, default=None)
    parser.add_argument("--turns", type=int, default=None)
    parser.add_argument("--systems", default="on,off", help="which --reply-token-reuse settings to run, in order")
    parser.add_argument("--model", default=None, help="the model to serve (default: the server's default)")
    args = parser.parse_args(argv)
    base = QUICK if args.quick else FULL
    workload = ToolLoops(args.agents or base.agents, args.turns or base.turns)
    results = [run_system(f"reuse {s}", s, args, workload) for s in args.systems.split(",")]
    print_report(workload, results)
    if args.json:
        write_json(args.json, {"workload": asdict(workload), "systems": [
            {"name": r.name, "wall_s": r.wall_s, "stopped": r.stopped, "share": r.share(),
             "share_by_kind": {k: r.share(k) for k in KINDS},
             "agents": [asdict(a) for a in r.agents]} for r in results]}, args)
    if args.plot:
        plot(args.plot, results)
    return 0 if all(r.stopped == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

"""A tool-using agent on the official `anthropic` SDK, served by radixserve's Messages API
(POST /v1/messages) instead of Anthropic's: the same client code, `base_url` pointed here.

The model is asked a question and must call one of its tools each turn (tool_choice "any",
one call a turn); each call's `input` is constrained by the tool's input_schema, the agent
runs it and sends the result back as a tool_result block, and once the turns are spent the
model answers in text (tool_choice "none"). Every turn re-sends the conversation, whose
prefix the server's cache holds: `cache_read_input_tokens` counts it.

    python examples/agents/anthropic_tools.py                   # starts a server, asks, stops it
    python examples/agents/anthropic_tools.py --url http://127.0.0.1:30000
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from langchain_tools import DEFAULT_QUESTION, calculator, lookup  # noqa: E402  (the sibling example's tools)
from react_agent import LocalServer  # noqa: E402

TOOLS = [
    {"name": "lookup", "description": lookup.__doc__,
     "input_schema": {"type": "object", "properties": {"topic": {"type": "string"}}, "required": ["topic"]}},
    {"name": "calculator", "description": calculator.__doc__,
     "input_schema": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}},
]
RUN = {"lookup": lookup, "calculator": calculator}
SYSTEM = "Answer with the tools: look up facts, then calculate."


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=None, help="a running server; default: start one on a free port")
    parser.add_argument("--model", default=None, help="model for the server this example starts")
    parser.add_argument("--question", default=DEFAULT_QUESTION)
    parser.add_argument("--max-steps", type=int, default=4, help="tool-calling turns before the answer")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args(argv)

    server = None if args.url else LocalServer(args.model).start()
    try:
        answer, usage = run_agent(args.url or server.url, args.question, args.max_steps, args.max_tokens)
    finally:
        if server is not None:
            server.stop()
    print(f"answer: {answer}")
    rate = usage["cached"] / usage["prompt"] if usage["prompt"] else 0.0
    print(f"cache hit rate: {rate:.1%} ({usage['cached']} cached of {usage['prompt']} prompt tokens, {usage['steps']} steps)")
    return 0


def run_agent(url: str, question: str, max_steps: int, max_tokens: int) -> tuple[str, dict[str, int]]:
    """Tool turns, then an answer in text; returns it and the usage summed over the turns."""
    import anthropic
    import httpx

    api_key = os.environ.get("RADIXSERVE_API_KEY", "unused")
    model = httpx.get(url + "/v1/models", headers={"x-api-key": api_key}, timeout=60).json()["data"][0]["id"]
    client = anthropic.Anthropic(base_url=url, api_key=api_key, max_retries=0, timeout=600)
    messages: list[dict] = [{"role": "user", "content": question}]
    usage = {"prompt": 0, "cached": 0, "steps": 0}

    def turn(tool_choice: dict):
        reply = client.messages.create(model=model, max_tokens=max_tokens, system=SYSTEM, tools=TOOLS,
                                       tool_choice=tool_choice, messages=messages, extra_body={"temperature": 0})
        # Anthropic's input_tokens excludes what the cache served and what this turn wrote to it
        usage["prompt"] += (reply.usage.input_tokens + (reply.usage.cache_read_input_tokens or 0)
                            + (reply.usage.cache_creation_input_tokens or 0))
        usage["cached"] += reply.usage.cache_read_input_tokens or 0
        usage["steps"] += 1
        return reply

    for _ in range(max_steps):
        reply = turn({"type": "any", "disable_parallel_tool_use": True})
        messages.append(reply.to_param())
        results = []
        for block in reply.content:
            if block.type == "tool_use":
                result = _call(block.name, block.input)
                print(f"step {usage['steps']}: {block.name}({block.input}) -> {result}")
                results.append({"type": "tool_result", "tool_use_id": block.id, "content": result})
        if not results:  # cut short by max_tokens before a call was complete
            break
        messages.append({"role": "user", "content": results})
    final = turn({"type": "none"})
    return "".join(b.text for b in final.content if b.type == "text").strip(), usage


def _call(name: str, arguments: dict) -> str:
    try:
        return RUN[name](**arguments)
    except TypeError as exc:  # arguments the function does not take
        return f"error: {exc}"


if __name__ == "__main__":
    sys.exit(main())

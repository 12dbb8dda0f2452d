"""A LangChain tool-calling agent served by radixserve, unchanged: `ChatOpenAI(...).bind_tools`
against the server's OpenAI-compatible endpoint (install the `agents` extra:
`pip install -e ".[agents]"`).

The model is asked a question, calls the tools it is bound to (LangChain turns the Python
functions below into OpenAI tool definitions, and the server constrains the calls so they
always parse), the results go back as ToolMessages, and it answers once the tools have
answered. Every turn re-sends the conversation, whose prefix the server's cache holds.

    python examples/agents/langchain_tools.py                   # starts a server, asks, stops it
    python examples/agents/langchain_tools.py --url http://127.0.0.1:30000
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from react_agent import DOCUMENTS, LocalServer, calculate  # noqa: E402  (the sibling example's tools and server)

DEFAULT_QUESTION = "How much do tickets to the Riverton museum cost for 2 adults and 3 children?"


def lookup(topic: str) -> str:
    """Returns the document about one topic: riverton, hillcrest, museum, ferry or orchards."""
    return DOCUMENTS.get(topic.strip().lower(), "no document about that topic")


def calculator(expression: str) -> str:
    """Evaluates arithmetic such as 12400 * 3 or (8 + 3) * 2."""
    try:
        return str(calculate(expression))
    except (ValueError, SyntaxError, ZeroDivisionError) as exc:
        return f"error: {exc}"


TOOLS = {"lookup": lookup, "calculator": calculator}


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
    """Tool turns (the model must call a tool), then an answer in text; returns it and the usage."""
    from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    import openai

    api_key = os.environ.get("RADIXSERVE_API_KEY", "unused")
    model_name = openai.OpenAI(base_url=url + "/v1", api_key=api_key).models.list().data[0].id
    llm = ChatOpenAI(base_url=url + "/v1", api_key=api_key, model=model_name, temperature=0, max_tokens=max_tokens,
                     max_retries=0)
    tools = [tool(fn) for fn in TOOLS.values()]
    messages = [SystemMessage("Answer with the tools: look up facts, then calculate."), HumanMessage(question)]
    usage = {"prompt": 0, "cached": 0, "steps": 0}
    for _ in range(max_steps):
        reply = llm.bind_tools(tools, tool_choice="required", parallel_tool_calls=False).invoke(messages)
        _count(reply, usage)
        messages.append(reply)
        for call in reply.tool_calls:
            result = TOOLS[call["name"]](**call["args"])
            print(f"step {usage['steps']}: {call['name']}({call['args']}) -> {result}")
            messages.append(ToolMessage(result, tool_call_id=call["id"]))
    final = llm.bind_tools(tools, tool_choice="none").invoke(messages)
    _count(final, usage)
    return str(final.content).strip(), usage


def _count(reply, usage: dict[str, int]) -> None:
    meta = reply.usage_metadata or {}
    usage["prompt"] += meta.get("input_tokens", 0)
    usage["cached"] += (meta.get("input_token_details") or {}).get("cache_read", 0) or 0
    usage["steps"] += 1


if __name__ == "__main__":
    sys.exit(main())

"""A ReAct-style tool agent through the official `openai` client against `radixserve serve`,
with real tool calling: the tools go in `tools`, the server constrains every reply to a
call of one of them (`tool_choice`), and the conversation carries the calls and their
results as OpenAI messages (assistant `tool_calls`, `tool` results with `tool_call_id`).

The tools are a calculator and a keyword lookup over a small local document set, and
`finish`, which gives the answer. The conversation only grows, so every step's prompt
starts with the previous one and the prefix cache serves it.

    python examples/agents/react_agent.py                      # starts a server, asks, stops it
    python examples/agents/react_agent.py --url http://127.0.0.1:30000 --question "..."
    python examples/agents/react_agent.py --max-tokens 24 --max-steps 2   # smoke test
"""

from __future__ import annotations

import argparse
import ast
import json
import operator
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

DOCUMENTS = {
    "riverton": "Riverton is a river town with a population of 12400 people. It has two bridges and one museum.",
    "hillcrest": "Hillcrest is a hill village with a population of 3100 people. It is known for its apple orchards.",
    "museum": "The Riverton museum opens at 10 am and a ticket costs 8 dollars for adults and 3 dollars for children.",
    "ferry": "A ferry connects Riverton and Hillcrest. The trip takes 25 minutes and runs every 40 minutes.",
    "orchards": "The Hillcrest orchards grow 6 kinds of apples and sell them for 2 dollars per kilogram.",
}

SYSTEM = """You are a careful assistant that answers questions with tools.
Look up the facts you need, then calculate, then call finish with the answer."""


def tool_definitions() -> list[dict]:
    """The tools, as OpenAI function definitions: a lookup over the topics, a calculator
    for arithmetic, and finish with the answer. They are the same at every step (they are
    part of the prompt, whose prefix the cache serves); `tool_choice` steers each step."""
    return [
        _function("lookup", "Returns the document about one topic.",
                  {"topic": {"type": "string", "enum": list(DOCUMENTS)}}),
        _function("calculator", "Evaluates arithmetic such as 12400 * 3 or (8 + 3) * 2.",
                  {"expression": {"type": "string", "pattern": "^[0-9][0-9+*/(). -]{0,38}$"}}),
        _function("finish", "Gives the final answer to the user.", {"answer": {"type": "string", "maxLength": 80}}),
    ]


def _function(name: str, description: str, properties: dict) -> dict:
    parameters = {"type": "object", "properties": properties, "required": list(properties),
                  "additionalProperties": False}
    return {"type": "function", "function": {"name": name, "description": description, "parameters": parameters}}


TOOLS = tool_definitions()


DEFAULT_QUESTION = "How much do tickets to the Riverton museum cost for 2 adults and 3 children?"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=None, help="a running server; default: start one on a free port")
    parser.add_argument("--model", default=None, help="model for the server this example starts")
    parser.add_argument("--question", default=DEFAULT_QUESTION)
    parser.add_argument("--max-steps", type=int, default=5)
    parser.add_argument("--max-tokens", type=int, default=96, help="tokens per step (a JSON object)")
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
    """The ReAct loop; returns the final answer and the summed usage."""
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key=os.environ.get("RADIXSERVE_API_KEY", "unused"), max_retries=0)
    model = client.models.list().data[0].id
    messages: list[dict] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    usage = {"prompt": 0, "cached": 0, "steps": 0}
    done: set[tuple[str, str]] = set()
    for step in range(max_steps):
        message = _ask(client, model, messages, step, max_steps, max_tokens, usage)
        name, argument = _parse(message)
        print(f"step {step + 1}: {name}({argument!r})")
        if name == "finish":
            return argument, usage
        observation = "You already did that; take another step." if (name, argument) in done else run_tool(name, argument)
        done.add((name, argument))
        call = message.tool_calls[0]
        messages.append({"role": "assistant", "content": None, "tool_calls": [
            {"id": call.id, "type": "function", "function": {"name": call.function.name, "arguments": call.function.arguments}}
        ]})
        messages.append({"role": "tool", "tool_call_id": call.id, "content": observation})
    return "(no answer)", usage


def run_tool(action: str, argument: str) -> str:
    if action == "calculator":
        try:
            return str(calculate(argument))
        except (ValueError, SyntaxError, ZeroDivisionError) as exc:
            return f"error: {exc}"
    return lookup(argument)


def calculate(expression: str) -> float | int:
    """Arithmetic only: numbers, + - * / // % ** and parentheses."""
    return _evaluate(ast.parse(expression.replace(",", "").strip(), mode="eval").body)


def lookup(query: str) -> str:
    """The document sharing the most words with the query."""
    words = {w.strip(".,?!").lower() for w in query.split()}

    def overlap(item: tuple[str, str]) -> int:
        key, text = item
        return 3 * (key in words) + len(words & {w.strip(".,").lower() for w in text.split()})

    key, text = max(DOCUMENTS.items(), key=overlap)
    return text if overlap((key, text)) else "no document matches"


class LocalServer:
    """`radixserve serve` in a subprocess on a free port, stopped with SIGTERM."""

    def __init__(self, model: str | None):
        self.model = model
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen | None = None

    def start(self, timeout_s: float = 180.0) -> "LocalServer":
        command = [sys.executable, "-m", "radixserve", "serve", "--port", str(self.port), "--log-level", "warning"]
        if self.model:
            command += ["--model", self.model]
        print(f"starting: {' '.join(command[1:])}", file=sys.stderr)
        self.process = subprocess.Popen(command)
        deadline = time.monotonic() + timeout_s
        while not _healthy(self.url):
            if self.process.poll() is not None:
                raise RuntimeError(f"the server exited with code {self.process.returncode} before it was healthy")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the server was not healthy after {timeout_s:.0f} s")
            time.sleep(0.5)
        return self

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGTERM)
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


# ---- helpers -----------------------------------------------------------------------------


def _ask(client, model: str, messages: list[dict], step: int, max_steps: int, max_tokens: int, usage: dict[str, int]):
    """One step: a call the server constrains to one of the tools (the first step looks
    something up, since every question here needs a fact; the last one finishes)."""
    choice: str | dict = "required"
    if step == max_steps - 1:
        choice = {"type": "function", "function": {"name": "finish"}}
    elif step == 0:
        choice = {"type": "function", "function": {"name": "lookup"}}
    response = client.chat.completions.create(
        model=model, messages=messages, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False,
        temperature=0, max_tokens=max_tokens,
    )
    details = response.usage.prompt_tokens_details
    usage["prompt"] += response.usage.prompt_tokens
    usage["cached"] += (details.cached_tokens or 0) if details is not None else 0
    usage["steps"] += 1
    return response.choices[0].message


def _parse(message) -> tuple[str, str]:
    """(tool, its one argument); a call cut short by max_tokens becomes a finish with its text."""
    if not message.tool_calls:
        return "finish", message.content or ""
    call = message.tool_calls[0]
    try:
        arguments = json.loads(call.function.arguments)
    except json.JSONDecodeError:
        return "finish", call.function.arguments
    return call.function.name, str(next(iter(arguments.values()), ""))


_OPERATORS = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow,
}


def _evaluate(node: ast.AST) -> float | int:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
        return node.value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
        right = _evaluate(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > 16:
            raise ValueError("exponent too large")
        return _OPERATORS[type(node.op)](_evaluate(node.left), right)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
        value = _evaluate(node.operand)
        return value if isinstance(node.op, ast.UAdd) else -value
    raise ValueError("only numbers and + - * / // % ** are allowed")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


if __name__ == "__main__":
    sys.exit(main())

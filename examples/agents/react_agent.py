"""A ReAct-style tool agent through the official `openai` client against `radixserve serve`.

Every step the model answers with one JSON object {"thought", "action", "input"}, kept
parseable by `response_format` (a JSON schema the server enforces token by token). The
tools are a calculator and a keyword lookup over a small local document set; each
observation goes back as the next user message. The conversation only grows, so every
step's prompt starts with the previous one and the prefix cache serves it.

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

SYSTEM = f"""You are a careful assistant that answers questions with tools.
Tools:
- lookup: returns the document about one topic. Topics: {", ".join(DOCUMENTS)}.
- calculator: evaluates arithmetic such as 12400 * 3 or (8 + 3) * 2.
- finish: gives the final answer to the user.
Reply with one JSON object per step: {{"thought": "...", "action": "...", "input": "..."}}.
Look up the facts you need, then calculate, then finish with the answer.

Example:
Question: How long do two ferry trips take?
{{"thought": "I need the ferry trip time.", "action": "lookup", "input": "ferry"}}
Observation: A ferry connects Riverton and Hillcrest. The trip takes 25 minutes and runs every 40 minutes.
{{"thought": "Two trips of 25 minutes.", "action": "calculator", "input": "2 * 25"}}
Observation: 50
{{"thought": "I know the answer.", "action": "finish", "input": "Two ferry trips take 50 minutes."}}"""

THOUGHT = {"type": "string", "maxLength": 60}


def step_schema(actions: tuple[str, ...], topics: list[str] | None = None) -> dict:
    """One step: a thought, then an action whose input fits the tool: a topic not looked up
    yet for lookup, arithmetic for the calculator, any short text for finish."""
    topics = list(DOCUMENTS) if topics is None else topics
    actions = tuple(a for a in actions if a != "lookup" or topics)
    inputs = {
        "lookup": {"enum": topics},
        "calculator": {"type": "string", "pattern": "^[0-9][0-9+*/(). -]{0,38}$"},
        "finish": {"type": "string", "maxLength": 80},
    }
    return {
        "anyOf": [
            {
                "type": "object",
                "properties": {"thought": THOUGHT, "action": {"const": action}, "input": inputs[action]},
                "required": ["thought", "action", "input"],
                "additionalProperties": False,
            }
            for action in actions
        ]
    }



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
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    usage = {"prompt": 0, "cached": 0, "steps": 0}
    done: set[tuple[str, str]] = set()
    for step in range(max_steps):
        reply = _ask(client, model, messages, _next_schema(step, max_steps, done), max_tokens, usage)
        action = _parse(reply)
        print(f"step {step + 1}: {action['action']}({action['input']!r})  # {action['thought']}")
        if action["action"] == "finish":
            return action["input"], usage
        call = (action["action"], action["input"])
        observation = "You already did that; take another step." if call in done else run_tool(*call)
        done.add(call)
        messages.append({"role": "assistant", "content": reply})
        messages.append({"role": "user", "content": f"Observation: {observation}"})
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
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("the server did not start")
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


def _ask(client, model: str, messages: list[dict], schema: dict, max_tokens: int, usage: dict[str, int]) -> str:
    response = client.chat.completions.create(
        model=model,
        messages=messages,
        temperature=0,
        max_tokens=max_tokens,
        response_format={"type": "json_schema", "json_schema": {"name": "step", "schema": schema}},
    )
    details = response.usage.prompt_tokens_details
    usage["prompt"] += response.usage.prompt_tokens
    usage["cached"] += (details.cached_tokens or 0) if details is not None else 0
    usage["steps"] += 1
    return response.choices[0].message.content


def _next_schema(step: int, max_steps: int, done: set[tuple[str, str]]) -> dict:
    """The first step looks something up (every question here needs a fact), the last one
    finishes; a topic is looked up once."""
    if step == max_steps - 1:
        return step_schema(("finish",))
    topics = [t for t in DOCUMENTS if ("lookup", t) not in done]
    return step_schema(("lookup",) if step == 0 else ("lookup", "calculator", "finish"), topics)


def _parse(reply: str) -> dict[str, str]:
    """The step as a dict; a reply cut short by max_tokens becomes a finish with its text."""
    try:
        step = json.loads(reply)
    except json.JSONDecodeError:
        return {"thought": "(cut short)", "action": "finish", "input": reply}
    return {"thought": step["thought"], "action": step["action"], "input": step["input"]}


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

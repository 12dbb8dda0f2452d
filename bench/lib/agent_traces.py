"""Agent traces for speculative decoding: chat requests as agents send them, each the
conversation so far, asking for the agent's next step. Several agents run the same kind of
task (as in a fleet of agents on one workflow), so what one agent wrote, another writes again
in part: the corpus that drafting from the radix tree reads (issue 61).

- tool_loop: a tool-calling loop with JSON arguments: look up a few cities' weather, one call
  per step, each tool result fed back (the next call is asked for).
- coding: a coding agent that read a file and writes an edited copy (one change per task; the
  agents share the repository's files).
- react: a ReAct loop (Thought / Action / Observation) answering questions with a search tool.
- chat: plain chat with nothing to copy (different open questions), the control.

Every request is a list of chat messages; the traces are deterministic for a seed.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass

CITIES = ["Lisbon", "Oslo", "Kyoto", "Quito", "Perth", "Tunis", "Dublin", "Austin", "Hanoi", "Lima", "Cairo", "Riga"]
CONDITIONS = ["sunny", "cloudy", "light rain", "windy", "clear"]

TOOL_SYSTEM = (
    "You are a travel assistant. You can call these tools:\n"
    "- get_weather(city: string, unit: \"celsius\" | \"fahrenheit\"): the current weather of a city\n"
    "- find_restaurants(city: string, cuisine: string, max_results: integer): restaurants in a city\n"
    "To call a tool, answer with one line of JSON and nothing else, exactly in this form:\n"
    "{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\", \"unit\": \"celsius\"}}\n"
    "After every tool result, call the next tool the task needs."
)

FILES = {
    "inventory.py": (
        "from dataclasses import dataclass\n\n\n"
        "@dataclass\nclass Item:\n    name: str\n    price: float\n    quantity: int\n\n\n"
        "def total_value(items):\n    total = 0\n    for item in items:\n        total += item.price * item.quantity\n"
        "    return total\n\n\n"
        "def low_stock(items, threshold=5):\n    return [item for item in items if item.quantity < threshold]\n\n\n"
        "def restock(item, amount):\n    if amount < 0:\n        raise ValueError(\"amount must be positive\")\n"
        "    item.quantity += amount\n    return item\n"
    ),
    "report.py": (
        "import csv\n\n\n"
        "def read_rows(path):\n    with open(path) as f:\n        return list(csv.DictReader(f))\n\n\n"
        "def summarize(rows, column):\n    values = [float(row[column]) for row in rows]\n"
        "    return {\"count\": len(values), \"mean\": sum(values) / len(values), \"max\": max(values)}\n\n\n"
        "def write_summary(summary, path):\n    with open(path, \"w\") as f:\n        for key, value in summary.items():\n"
        "            f.write(f\"{key}: {value}\\n\")\n"
    ),
}
EDITS = [
    "Rename the function total_value to inventory_value.",
    "Change the default threshold of low_stock to 10.",
    "Make restock raise the error when amount is zero too (amount <= 0).",
    "Add a docstring to total_value.",
    "Rename the parameter items to stock in low_stock.",
    "Rename the function summarize to summarize_column.",
    "Make summarize also return the minimum as \"min\".",
    "Change read_rows to open the file with newline=\"\".",
]

REACT_SYSTEM = (
    "Answer questions by thinking step by step and using a search tool. Use exactly this format:\n"
    "Thought: what you need to find out next\nAction: search[the query]\n"
    "Then you get an Observation. When you know the answer, write:\nThought: I now know the answer.\n"
    "Final Answer: the answer\n\n"
    "Example:\nQuestion: What is the capital of the country where the Eiffel Tower is?\n"
    "Thought: I need to find out which country the Eiffel Tower is in.\nAction: search[Eiffel Tower country]\n"
    "Observation: The Eiffel Tower is in Paris, France.\n"
    "Thought: I need to find out the capital of France.\nAction: search[capital of France]\n"
    "Observation: The capital of France is Paris.\nThought: I now know the answer.\nFinal Answer: Paris"
)
REACT_QUESTIONS = [
    ("What is the population of the largest city in Norway?", ["largest city in Norway", "population of Oslo"],
     ["The largest city in Norway is Oslo.", "Oslo has about 700,000 inhabitants."]),
    ("Which river flows through the capital of Peru?", ["capital of Peru", "river through Lima"],
     ["The capital of Peru is Lima.", "The Rimac River flows through Lima."]),
    ("What language is spoken in the country where Kyoto is?", ["Kyoto country", "language of Japan"],
     ["Kyoto is a city in Japan.", "The official language of Japan is Japanese."]),
    ("How tall is the highest mountain in Ecuador?", ["highest mountain in Ecuador", "height of Chimborazo"],
     ["The highest mountain in Ecuador is Chimborazo.", "Chimborazo is 6,263 metres high."]),
    ("What is the currency of the country whose capital is Hanoi?", ["Hanoi country", "currency of Vietnam"],
     ["Hanoi is the capital of Vietnam.", "The currency of Vietnam is the dong."]),
    ("Which sea is next to the capital of Latvia?", ["capital of Latvia", "sea near Riga"],
     ["The capital of Latvia is Riga.", "Riga lies on the Gulf of Riga of the Baltic Sea."]),
]

CHAT_QUESTIONS = [
    "Why is the sky blue?", "Give me three ideas for a birthday party.", "What makes a good cup of coffee?",
    "Explain what a black hole is to a child.", "How do plants make food?", "What should I pack for a hike?",
    "Why do cats purr?", "Describe a sunset over the sea.", "What is the difference between weather and climate?",
    "How do I start learning to paint?", "Why do we dream?", "What are the benefits of walking every day?",
]


def _call(name: str, arguments: dict) -> str:
    return json.dumps({"name": name, "arguments": arguments})


def tool_loop(agents: int = 4, steps: int = 4, seed: int = 0) -> list[list[dict]]:
    """Each agent checks `steps` cities' weather, one call a step; a request asks for the next call."""
    rng = random.Random(seed)
    requests = []
    for _ in range(agents):
        cities = rng.sample(CITIES, steps)
        unit = rng.choice(["celsius", "fahrenheit"])
        task = (f"Check the weather in {', '.join(cities)} (in {unit}), one city at a time, then find two Italian "
                f"restaurants in the warmest one.")
        messages = [{"role": "system", "content": TOOL_SYSTEM}, {"role": "user", "content": task}]
        for city in cities:
            requests.append(list(messages))
            messages.append({"role": "assistant", "content": _call("get_weather", {"city": city, "unit": unit})})
            result = {"city": city, "temperature": rng.randint(5, 32), "unit": unit,
                      "conditions": rng.choice(CONDITIONS)}
            messages.append({"role": "user", "content": f"Tool result: {json.dumps(result)}"})
        requests.append(list(messages))
    return requests


def coding(tasks: int = 8, seed: int = 0) -> list[list[dict]]:
    """A coding agent read a file (the tool's output) and is asked to write the edited copy."""
    requests = []
    names = list(FILES)
    for i in range(tasks):
        edit = EDITS[i % len(EDITS)]
        name = names[0] if i % len(EDITS) < 5 else names[1]
        messages = [
            {"role": "system", "content": "You are a coding agent. To change a file, write the whole new file in "
                                          "one ```python block."},
            {"role": "user", "content": f"In {name}: {edit}"},
            {"role": "assistant", "content": _call("read_file", {"path": name})},
            {"role": "user", "content": f"Tool result ({name}):\n```python\n{FILES[name]}```\nNow write the whole "
                                        f"edited file."},
        ]
        requests.append(messages)
    return requests


def react(questions: int = 6, seed: int = 0) -> list[list[dict]]:
    """ReAct steps: each question asked, then with one observation; a request asks for the next step."""
    requests = []
    for question, queries, observations in REACT_QUESTIONS[:questions]:
        history = f"Question: {question}\n"
        messages = [{"role": "system", "content": REACT_SYSTEM}, {"role": "user", "content": history}]
        requests.append(list(messages))
        step = f"Thought: I need to find out the {queries[0]}.\nAction: search[{queries[0]}]\nObservation: {observations[0]}\n"
        requests.append([{"role": "system", "content": REACT_SYSTEM}, {"role": "user", "content": history + step}])
    return requests


def chat(questions: int = 8, seed: int = 0) -> list[list[dict]]:
    """Plain chat: open questions, nothing to copy."""
    return [[{"role": "user", "content": q}] for q in CHAT_QUESTIONS[:questions]]


@dataclass
class AgentTrace:
    """One trace's requests (chat messages, in the order agents send them)."""

    name: str
    requests: list[list[dict]]

    def describe(self) -> str:
        return f"{self.name}: {len(self.requests)} requests, {NOTES[self.name]}"


TRACES = {"tool_loop": tool_loop, "coding": coding, "react": react, "chat": chat}
NOTES = {"tool_loop": "4 agents x 4 weather calls (JSON arguments), the next call asked after each tool result",
         "coding": "8 coding-agent tasks: a file read back by a tool, the whole edited copy asked for",
         "react": "6 ReAct questions, the first step and the step after one observation",
         "chat": "8 open chat questions, nothing to copy (the control)"}


def trace(name: str) -> AgentTrace:
    return AgentTrace(name, TRACES[name]())

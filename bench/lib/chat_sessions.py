"""Chat sessions over HTTP (a `Workload`): sessions sharing system prompts, several turns each.

Each session has one of a few long system prompts and grows its chat turn by turn: each
user turn carries a tool's output (a few dozen words of its own) and a question, and the
assistant's answers stay in the history, so turn k's prompt extends turn k-1's. Sessions run at
once (one thread each); a session's turns run in order. The cache reuse this yields is
what prefix-affinity routing must keep when the sessions are spread over replicas.
Used by bench/bench_cluster.py and the cluster tests; plain Python (httpx), no Ray.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx

from radixserve.cluster.forwarding import REPLICA_HEADER


_SYSTEM_PROMPTS = (
    "You are the operations agent of a small logistics company. You plan deliveries, answer "
    "questions about shipments, and keep every answer short and factual. Routes start at the "
    "north depot at six in the morning; trucks carry at most twelve pallets; drivers rest for "
    "thirty minutes every four hours. When a customer asks about a delay, apologise once, give "
    "the new estimate, and offer a callback. Never promise a delivery window shorter than two hours.",
    "You are a code review assistant for a Python team. You read diffs, point out bugs first, then "
    "risky patterns, then style, each as one bullet. The team uses type hints everywhere, small "
    "functions, no global state, and tests for every behaviour. Prefer concrete suggestions with a "
    "line reference over general advice, and say plainly when a change looks correct and complete.",
    "You are a travel desk agent. You book trains before planes for trips under six hundred "
    "kilometres, keep a spare hour at every connection, and list the options as a numbered list "
    "with price, duration and the number of changes. Ask for the traveller's date before anything else.",
)
_QUESTIONS = (
    "What should I do first?",
    "Give me the next step, briefly.",
    "Anything I should double-check?",
    "Summarise what we decided so far.",
    "What is the main risk here?",
    "Can you make that shorter?",
)


_WORDS = (
    "pallet route depot driver invoice order delay north south truck customer window callback status "
    "function test branch commit review error module import value return string config deploy train "
    "station ticket platform change price hour minute city budget hotel seat booking confirmed pending"
).split()


@dataclass(frozen=True)
class ChatSessions:
    sessions: int = 8
    turns: int = 4
    system_prompts: int = 2
    max_tokens: int = 12
    observation_words: int = 40  # words of tool output in each user turn
    think_s: float = 0.0  # before each turn, the tool "runs" for a random time within [0, think_s]
    name: str = "chat-sessions"

    def __post_init__(self) -> None:
        if not 1 <= self.system_prompts <= len(_SYSTEM_PROMPTS):
            raise ValueError(f"system_prompts must be within [1, {len(_SYSTEM_PROMPTS)}]")
        if self.sessions < 1 or self.turns < 1 or self.max_tokens < 1 or self.observation_words < 0 or self.think_s < 0:
            raise ValueError("sessions, turns and max_tokens must be >= 1, observation_words and think_s >= 0")

    def describe(self) -> str:
        return (f"{self.sessions} sessions x {self.turns} turns, {self.system_prompts} distinct system prompts, "
                f"{self.observation_words}-word tool outputs taking 0-{self.think_s:g}s per turn, "
                f"greedy chat completions of {self.max_tokens} tokens")

    def user_turn(self, session: int, turn: int) -> str:
        words = random.Random(session * 1000 + turn).choices(_WORDS, k=self.observation_words)
        question = _QUESTIONS[(session + turn) % len(_QUESTIONS)]
        return f"[session {session}, step {turn}] Tool output: {' '.join(words)}\n{question}"


@dataclass(frozen=True)
class Turn:
    session: int
    turn: int
    system_prompt: int
    replica: str | None
    prompt_tokens: int
    cached_tokens: int
    seconds: float


def run(base_url: str, workload: ChatSessions, *, timeout_s: float = 120.0,
        progress: Callable[[int, int], None] | None = None) -> list[Turn]:
    """Run the workload against base_url; raises on any non-200 answer."""
    with httpx.Client(base_url=base_url, timeout=timeout_s) as client:
        model = client.get("/v1/models").json()["data"][0]["id"]
    done = [0]
    lock = threading.Lock()
    total = workload.sessions * workload.turns

    def session(index: int) -> list[Turn]:
        prompt = index % workload.system_prompts
        messages = [{"role": "system", "content": _SYSTEM_PROMPTS[prompt]}]
        turns = []
        think = random.Random(index)
        with httpx.Client(base_url=base_url, timeout=timeout_s) as client:
            for turn in range(workload.turns):
                time.sleep(think.uniform(0, workload.think_s))
                messages.append({"role": "user", "content": workload.user_turn(index, turn)})
                body = {"model": model, "messages": messages, "max_tokens": workload.max_tokens,
                        "temperature": 0, "session_id": f"session-{index}"}
                start = time.monotonic()
                answer = client.post("/v1/chat/completions", json=body)
                if answer.status_code != 200:
                    raise RuntimeError(f"session {index} turn {turn}: {answer.status_code} {answer.text}")
                data = answer.json()
                messages.append({"role": "assistant", "content": data["choices"][0]["message"]["content"]})
                usage = data["usage"]
                turns.append(Turn(index, turn, prompt, answer.headers.get(REPLICA_HEADER), usage["prompt_tokens"],
                                  usage["prompt_tokens_details"]["cached_tokens"], time.monotonic() - start))
                with lock:
                    done[0] += 1
                    if progress is not None:
                        progress(done[0], total)
        return turns

    with ThreadPoolExecutor(max_workers=workload.sessions) as pool:
        results = list(pool.map(session, range(workload.sessions)))
    return [t for turns in results for t in turns]


def cached_tokens(turns: list[Turn]) -> int:
    return sum(t.cached_tokens for t in turns)


def prompt_tokens(turns: list[Turn]) -> int:
    return sum(t.prompt_tokens for t in turns)

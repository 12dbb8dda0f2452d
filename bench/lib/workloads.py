"""What the benches send. Every bench's workload is a `Workload`: it has a name and says in
one line what it sends (`describe()`, printed at the top of every report). The kinds:

    TokenSessions  here: token-id sessions of dependent turns, modelled on SGLang's benchmarks
    ChatSessions   lib/chat_sessions.py: chat sessions over HTTP sharing a few system prompts
    AgentSwarm     lib/swarm.py: agents with tool pauses over one engine or server
    ToolLoops      bench_agent_turns.py: agent loops with real tool calls over HTTP

A session is a conversation: turn i's prompt is everything before it (earlier turns' new
tokens and the model's answers to them) followed by turn i's new tokens. Single-shot
workloads are sessions of one turn. Token ids are drawn from the ordinary vocabulary with
a fixed seed, so every system sees exactly the same prompts.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Protocol

LOW_ID, HIGH_ID = 100, 49000  # ordinary tokens of SmolLM2's vocabulary (no special tokens)


@dataclass
class Turn:
    new_tokens: list[int]
    max_tokens: int


@dataclass
class Session:
    turns: list[Turn]


class Workload(Protocol):
    """What a bench sends: its name, and one line saying what (for the report)."""

    name: str

    def describe(self) -> str: ...


@dataclass
class TokenSessions:
    name: str
    description: str
    sessions: list[Session]
    params: dict = field(default_factory=dict)

    @property
    def num_requests(self) -> int:
        return sum(len(s.turns) for s in self.sessions)

    def describe(self) -> str:
        return self.description


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(LOW_ID, HIGH_ID) for _ in range(n)]


def no_sharing(num_prompts=32, min_prompt=64, max_prompt=512, min_output=32, max_output=128, seed=0) -> TokenSessions:
    rng = random.Random(seed)
    sessions = [
        Session([Turn(_tokens(rng, rng.randint(min_prompt, max_prompt)), rng.randint(min_output, max_output))])
        for _ in range(num_prompts)
    ]
    return TokenSessions(
        "no-sharing",
        f"{num_prompts} independent prompts of {min_prompt}-{max_prompt} tokens, "
        f"{min_output}-{max_output} new tokens each",
        sessions,
        dict(num_prompts=num_prompts),
    )


def shared_prefix(groups=4, prompts_per_group=8, system_len=512, question_len=32, output_len=32, seed=1) -> TokenSessions:
    rng = random.Random(seed)
    sessions = []
    systems = [_tokens(rng, system_len) for _ in range(groups)]
    for g in range(groups):
        for _ in range(prompts_per_group):
            sessions.append(Session([Turn(systems[g] + _tokens(rng, question_len), output_len)]))
    return TokenSessions(
        "shared-prefix",
        f"{groups} groups x {prompts_per_group} prompts: {system_len}-token group system prompt + "
        f"{question_len}-token question, {output_len} new tokens",
        sessions,
        dict(groups=groups, prompts_per_group=prompts_per_group, system_len=system_len),
    )


def few_shot(shots=8, shot_len=128, questions=32, question_len=24, min_output=1, max_output=8, seed=2) -> TokenSessions:
    rng = random.Random(seed)
    examples = _tokens(rng, shots * shot_len)
    sessions = [
        Session([Turn(examples + _tokens(rng, question_len), rng.randint(min_output, max_output))])
        for _ in range(questions)
    ]
    return TokenSessions(
        "few-shot",
        f"one {shots}-shot block ({shots * shot_len} tokens), {questions} questions of {question_len} tokens, "
        f"{min_output}-{max_output} new tokens",
        sessions,
    )


def multi_turn(conversations=8, turns=4, system_len=256, user_len=48, answer_len=48, seed=3) -> TokenSessions:
    rng = random.Random(seed)
    sessions = []
    for _ in range(conversations):
        first = Turn(_tokens(rng, system_len) + _tokens(rng, user_len), answer_len)
        sessions.append(Session([first] + [Turn(_tokens(rng, user_len), answer_len) for _ in range(turns - 1)]))
    return TokenSessions(
        "multi-turn",
        f"{conversations} conversations x {turns} turns: {system_len}-token system prompt, "
        f"{user_len}-token user messages, {answer_len}-token answers appended turn by turn",
        sessions,
    )


def agent_loop(agents=8, steps=4, tools_len=768, task_len=64, action_len=24, observation_len=64, seed=4) -> TokenSessions:
    rng = random.Random(seed)
    tools = _tokens(rng, tools_len)  # one system prompt with tool descriptions, shared by every agent
    sessions = []
    for _ in range(agents):
        first = Turn(tools + _tokens(rng, task_len), action_len)
        rest = [Turn(_tokens(rng, observation_len), action_len) for _ in range(steps - 1)]
        sessions.append(Session([first] + rest))
    return TokenSessions(
        "agent-loop",
        f"{agents} agents x {steps} steps: shared {tools_len}-token tool prompt + {task_len}-token task; each "
        f"step generates a {action_len}-token action, then appends a {observation_len}-token observation",
        sessions,
    )


def long_context(num_prompts=8, prompt_len=3000, output_len=64, seed=5) -> TokenSessions:
    rng = random.Random(seed)
    sessions = [Session([Turn(_tokens(rng, prompt_len), output_len)]) for _ in range(num_prompts)]
    return TokenSessions(
        "long-context",
        f"{num_prompts} unrelated prompts of {prompt_len} tokens, {output_len} new tokens each",
        sessions,
        dict(num_prompts=num_prompts, prompt_len=prompt_len),
    )


WORKLOADS = {
    "no-sharing": no_sharing,
    "shared-prefix": shared_prefix,
    "few-shot": few_shot,
    "multi-turn": multi_turn,
    "agent-loop": agent_loop,
    "long-context": long_context,
}

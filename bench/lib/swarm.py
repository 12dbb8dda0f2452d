"""An agent swarm (a `Workload`): agents that share one tool prompt, each with its own
instructions, then turns of a greedy answer and a tool result, with seeded tool pauses
between an answer and the next request. bench_agents runs it on an engine, bench_hybrid_kv
over HTTP against llama.cpp, hybrid_swarm_sim on a virtual clock; the same seeds give the
same prompts and pauses everywhere. Also the ideal reuse the swarm reports against: what an
unbounded cache could serve (the longest block-aligned prefix any earlier request computed)."""

from __future__ import annotations

import random
from dataclasses import dataclass

from radixserve.core.hashing import extend_block_hashes

BLOCK_SIZE = 16


@dataclass
class AgentSwarm:
    agents: int
    turns: int
    tool_prompt: int
    instructions: int
    tool_result: int
    answer: int
    latency: tuple[float, float]
    seed: int = 0
    retry_share: float = 0.0  # chance that an answer's tool call is retried (bench_agents' Agent.answered)
    name: str = "agent-swarm"

    def describe(self) -> str:
        retries = f"; {self.retry_share:.0%} of tool calls retried" if self.retry_share else ""
        return (f"{self.agents} agents x {self.turns} turns; tool prompt {self.tool_prompt} tokens, "
                f"instructions {self.instructions}, tool result {self.tool_result}, answer {self.answer}; "
                f"tool latency {self.latency[0]}-{self.latency[1]} s{retries}")

    def working_set_tokens(self) -> int:
        per_agent = self.instructions + self.turns * (self.answer + self.tool_result)
        return self.tool_prompt + self.agents * per_agent


# short: bench_agents' tool loop; each agent's own history (~640 tokens) is barely over a 512-token window
FULL_SWARM = AgentSwarm(8, 4, 1024, 64, 128, 16, (0.5, 2.0))
QUICK_SWARM = AgentSwarm(4, 2, 256, 32, 64, 8, (0.2, 0.5))
# long: coding agents in a SWE-agent-style loop. A 1,536-token system prompt with the tools'
# definitions (bench_agents' full size), a 256-token task (an issue's text); each turn a 64-token
# answer (a short thought and one tool call) and a 384-token tool result: a mix of file views
# (SWE-agent's viewer shows 100 lines, ~1,000 tokens of code) and short outputs (ls, grep hits, a
# test's tail). A conversation ends at 4,480 tokens, its own history 2,944 (nearly six windows).
LONG_SWARM = AgentSwarm(8, 6, 1536, 256, 384, 64, (0.5, 2.0))
QUICK_LONG_SWARM = AgentSwarm(4, 3, 512, 64, 384, 32, (0.2, 0.5))
SWARMS = {"short": (FULL_SWARM, QUICK_SWARM), "long": (LONG_SWARM, QUICK_LONG_SWARM)}


class SwarmAgent:
    """One agent of the swarm with token ids drawn from [low, high) (a model's plain vocabulary):
    shared tool prompt + own instructions, first arrival staggered within the longest pause."""

    def __init__(self, index: int, workload: AgentSwarm, tool_prompt: list[int], low: int, high: int):
        self.rng = random.Random(workload.seed * 1000 + index)
        self.index, self.workload, self.low, self.high = index, workload, low, high
        self.context = tool_prompt + self.tokens(workload.instructions)
        self.start = self.rng.uniform(0, workload.latency[1])  # staggered first arrivals

    def tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(self.low, self.high) for _ in range(n)]


def ideal_cached(prompt: list[int], seen: set[int], block_size: int = BLOCK_SIZE) -> int:
    """Tokens an unbounded cache could serve: whole blocks of the longest prefix computed
    before (`seen`: their block hashes), never the prompt's last token (its logits are needed)."""
    hashes = extend_block_hashes([], prompt[: len(prompt) - 1], block_size, None)
    n = 0
    while n < len(hashes) and hashes[n] in seen:
        n += 1
    return n * block_size


def remember(tokens: list[int], seen: set[int], block_size: int = BLOCK_SIZE) -> None:
    """Record `tokens` as computed: later prompts may share their whole blocks."""
    seen.update(extend_block_hashes([], tokens, block_size, None))

"""bench/lib/swarm.py: the ideal reuse every swarm reports against (whole blocks of the longest
prefix computed before, never a prompt's last token), and seeded agents that replay exactly."""

from __future__ import annotations

from bench.lib.swarm import QUICK_SWARM, SwarmAgent, ideal_cached, remember


def test_ideal_reuse_is_whole_blocks_of_what_was_computed_and_never_the_last_token():
    seen: set[int] = set()
    first = list(range(100, 133))  # 33 tokens: two whole blocks of 16 and one more
    assert ideal_cached(first, seen) == 0
    remember(first, seen)
    assert ideal_cached(first + [7, 8, 9], seen) == 32
    assert ideal_cached(first, seen) == 32  # its last token aside, 32 tokens remain: two blocks
    assert ideal_cached(first[:32], seen) == 16  # 31 tokens before the last: one whole block
    assert ideal_cached([1] + first, seen) == 0  # a prefix, not any substring
    assert ideal_cached(first[:16] + [5] * 20, seen) == 16


def test_agents_of_one_seed_replay_the_same_prompts_and_pauses():
    def agent(index: int) -> SwarmAgent:
        return SwarmAgent(index, QUICK_SWARM, [3] * QUICK_SWARM.tool_prompt, 200, 40000)

    a, b, other = agent(1), agent(1), agent(2)
    assert a.context == b.context and a.start == b.start
    assert a.tokens(5) == b.tokens(5)
    assert a.context[:QUICK_SWARM.tool_prompt] == other.context[:QUICK_SWARM.tool_prompt]
    assert a.context != other.context
    assert len(a.context) == QUICK_SWARM.tool_prompt + QUICK_SWARM.instructions

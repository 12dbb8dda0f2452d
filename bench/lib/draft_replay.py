"""Drafting replayed offline: a trace's greedy outputs recorded once, then a drafter run over
them without the model, so a change to drafting is judged in seconds and without the noise of
a shared machine's step times.

The replay walks each output as verification would: at every decode step the drafter proposes
(the real PromptLookupDrafter or SuffixDrafter, over a real RadixCache filled as the engine
fills it: the prompt's full blocks at admission, each full block as it is computed, the whole
sequence at the end), the draft is accepted while it equals the recorded output, and the step
appends the accepted tokens and the one after ("suffix-tree": suffix drafting's trees of
TREE_WIDTH candidates a node, a draft accepted along the path whose tokens the output follows;
every node a row). Step times come from a given table of rows ->
ms (the drafter's own cost model reads it too), so `speedup` is the decode time without drafts
over the time with them, on that table.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from radixserve import SamplingParams
from radixserve.config import EngineConfig
from radixserve.core.block_pool import BlockPool
from radixserve.core.draft_length import StepCosts
from radixserve.core.draft_tree import children, is_chain
from radixserve.core.prompt_lookup import PromptLookupDrafter
from radixserve.core.radix_cache import RadixCache
from radixserve.core.request import Request
from radixserve.core.suffix_drafts import SuffixDrafter

# Decode step ms by rows, the default model on the project's AVX2 dev machine (2026-12-07)
AVX2_STEP_MS = {1: 13.3, 2: 20.0, 4: 28.2, 5: 49.8, 8: 78.9, 9: 88.0, 12: 92.0, 16: 121.0}
METHODS = ("prompt-lookup", "suffix", "suffix-tree")
TREE_WIDTH = 2  # "suffix-tree": candidates a node may branch into
_ids = itertools.count()


@dataclass
class Replay:
    steps: int = 0  # decode steps (the first output token comes from the prompt's step)
    tokens: int = 0  # tokens those steps appended
    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    ms: float = 0.0  # the steps' time on the table
    plain_ms: float = 0.0  # the same tokens one step each

    @property
    def tokens_per_step(self) -> float:
        return self.tokens / max(1, self.steps)

    @property
    def accepted_length(self) -> float:
        """Tokens a verification appends on average (as the engine's spec_accepted_length)."""
        return (self.accepted + self.drafts) / max(1, self.drafts)

    @property
    def speedup(self) -> float:
        return self.plain_ms / max(1e-9, self.ms)


def drafter_for(method: str, cache: RadixCache) -> PromptLookupDrafter:
    """The engine's drafter for `method`, with the engine's default knobs."""
    c = EngineConfig()
    args = (c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max)
    if method in ("suffix", "suffix-tree"):
        return SuffixDrafter(*args, default_on=True, cache=cache, tree_width=TREE_WIDTH if method == "suffix-tree" else 1)
    return PromptLookupDrafter(*args, default_on=True)


def replay(recorded: list[tuple[list[int], list[int]]], method: str, step_ms: dict[int, float],
           block_size: int = 16) -> Replay:
    """Replay one trace's (prompt, greedy output) pairs, in order, through a fresh cache and drafter."""
    pool = BlockPool(16 + 2 * sum(len(p) + len(o) for p, o in recorded) // block_size)
    cache = RadixCache(pool, block_size)
    drafter = drafter_for(method, cache)
    for rows, ms in step_ms.items():
        drafter.observe_step(1, rows, ms)
    costs = StepCosts()
    for rows, ms in step_ms.items():
        costs.observe(rows, ms)
    out = Replay()
    for prompt, output in recorded:
        request = Request(f"replay-{next(_ids)}", list(prompt), SamplingParams(max_tokens=len(output), temperature=0.0),
                          len(prompt) + len(output) + 1)
        _insert(cache, pool, request.token_ids, block_size)
        request.token_ids.append(output[0])
        done = 1
        while done < len(output):
            draft = drafter.propose(request, len(output) - done)
            parents = (drafter.parents_of(request) or [])[:len(draft)]
            parents = [] if is_chain(parents) else parents
            path = _followed(draft, parents, output[done:])
            accepted = len(path)
            if draft:
                drafter.record(request, len(draft), accepted, path, parents)
            n = min(accepted + 1, len(output) - done)
            request.token_ids += output[done:done + n]
            done += n
            out.steps += 1
            out.tokens += n
            out.ms += costs.estimate(1 + len(draft))
            _insert(cache, pool, request.token_ids[:-1], block_size)  # the computed tokens' full blocks
        _insert(cache, pool, request.token_ids, block_size)
        drafter.forget(request.request_id)
    out.plain_ms = out.tokens * costs.estimate(1)
    stats = drafter.stats
    out.drafts, out.draft_tokens, out.accepted = stats.drafts, stats.draft_tokens, stats.accepted_tokens
    return out


def _followed(draft: list[int], parents: list[int], output: list[int]) -> list[int]:
    """The draft nodes greedy verification accepts against the output that follows: a chain's
    leading tokens that equal it, a tree's path whose tokens do (core/draft_tree.py)."""
    kids = children(parents) if parents else {i - 1: [i] for i in range(len(draft))}
    path: list[int] = []
    node = -1
    while len(path) < len(output):
        node = next((c for c in kids.get(node, []) if draft[c] == output[len(path)]), None)
        if node is None:
            break
        path.append(node)
    return path


def record(engine, prompts: list[list[int]], max_tokens: int) -> list[tuple[list[int], list[int]]]:
    """Each prompt's greedy output on the engine (no speculation needed: greedy is the same)."""
    outs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0))
    return [(list(p), list(o.token_ids)) for p, o in zip(prompts, outs)]


def _insert(cache: RadixCache, pool: BlockPool, tokens: list[int], block_size: int) -> None:
    n = len(tokens) // block_size
    if n:
        blocks = pool.allocate(n)
        cache.insert(tokens[:n * block_size], blocks)
        pool.free(reversed(blocks))

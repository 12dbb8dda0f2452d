"""Draft trees end to end on tiny models (core/draft_tree.py): greedy output token for token the
same as without speculation where the accepted path is a side branch (its K/V moved to the
depths' slots), with exact counters, under preemption, over float32 and int8 KV, the torch
backend, a hybrid-window model (Gemma 3) and sliding windows on every layer; suffix drafting's
trees from a cache holding two continuations of the same text; the option refused where it
would do nothing, and recurrent models kept to chains."""

from __future__ import annotations

import random

import pytest

from radixserve import Engine, SamplingParams
from radixserve.config import EngineConfig
from radixserve.core.prompt_lookup import PromptLookupDrafter

GREEDY = dict(temperature=0.0, ignore_eos=True)
DEPTH = 3  # tokens of each branch of the scripted trees


def _prompts(lengths, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(97) for _ in range(n)] for n in lengths]


class SideBranchDrafter(PromptLookupDrafter):
    """Proposes a tree of two branches of DEPTH tokens: nodes 0..DEPTH-1 a wrong chain (every
    token one past the reference's), then the reference continuation as the root's second child:
    verification accepts the side branch whole. Only where the whole tree fits."""

    def __init__(self, references):
        super().__init__(8, 1, 3, default_on=True)
        self.references = references

    def propose_step(self, asks, decodes, budget):
        drafts = []
        for request, room in asks:
            state = self._drafting_state(request)
            ref = self.references[tuple(request.prompt_token_ids)]
            done = request.num_output_tokens
            right = ref[done:done + DEPTH]
            if state is None or len(right) < DEPTH or min(room, budget) < 2 * DEPTH:
                drafts.append([])
                continue
            wrong = [(t + 1) % 97 for t in right]
            state.parents = [-1, 0, 1, -1, DEPTH, DEPTH + 1]
            drafts.append(wrong + right)
            budget -= 2 * DEPTH
        return drafts


def _expected_counts(max_tokens: int, prompts: int) -> dict[str, int]:
    """The verifications each request makes: one per decode step while a whole tree fits (room
    for 2 * DEPTH drafts), each appending DEPTH accepted tokens and a bonus."""
    drafts, out = 0, 1
    while out < max_tokens:
        if max_tokens - out - 1 >= 2 * DEPTH and max_tokens - out >= DEPTH:
            drafts += 1
            out += DEPTH + 1
        else:
            out += 1
    drafts *= prompts
    return dict(spec_drafts=drafts, spec_branched_drafts=drafts, spec_branch_hits=drafts,
                spec_draft_tokens=2 * DEPTH * drafts, spec_accepted_tokens=DEPTH * drafts)


@pytest.mark.parametrize("kind,options", [
    ("llama", {}),
    ("llama", {"kv_cache_dtype": "int8"}),
    ("llama", {"attention_backend": "torch"}),
    ("gemma3", {}),
    ("mistral_window", {}),  # every layer's window (6) counts positions: a node sees 6 back from its depth
])
def test_side_branches_are_accepted_greedy_exact(tiny_model_dir, kind, options):
    directory = str(tiny_model_dir(kind))
    prompts = _prompts([21, 34, 13], seed=1)
    max_tokens = 27
    params = SamplingParams(max_tokens=max_tokens, **GREEDY)
    base = dict(block_size=4, num_kv_blocks=256, **options)
    plain = Engine(directory, **base)
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    engine = Engine(directory, speculative="suffix", speculative_max_batch=64, speculative_adaptive=False,
                    speculative_tree_width=2, **base)
    engine.drafter = engine.scheduler.drafter = SideBranchDrafter({tuple(p): e for p, e in zip(prompts, expected)})
    if kind == "gemma3":
        assert engine.runner.pool.hybrid
    assert [o.token_ids for o in engine.generate(prompts, params)] == expected
    stats = engine.stats()
    assert {k: stats[k] for k in _expected_counts(max_tokens, 1)} == _expected_counts(max_tokens, len(prompts))
    assert stats["steps"] < plain.stats()["steps"]
    engine.check_integrity()
    engine.flush_cache()
    plain.flush_cache()
    assert engine.pool.num_free == plain.pool.num_free  # no tree node left a block behind


def test_side_branches_under_preemption(tiny_model_dir):
    directory = str(tiny_model_dir("llama"))
    prompts = _prompts([30, 41, 22, 35, 28, 33], seed=4)
    params = SamplingParams(max_tokens=30, **GREEDY)
    plain = Engine(directory, block_size=4, num_kv_blocks=256)
    expected = [o.token_ids for o in plain.generate(prompts, params)]
    engine = Engine(directory, block_size=4, num_kv_blocks=40, speculative="suffix", speculative_max_batch=64,
                    speculative_adaptive=False, speculative_tree_width=2)
    engine.drafter = engine.scheduler.drafter = SideBranchDrafter({tuple(p): e for p, e in zip(prompts, expected)})
    assert [o.token_ids for o in engine.generate(prompts, params)] == expected
    stats = engine.stats()
    assert stats["preemptions"] > 0 and stats["spec_branch_hits"] > 0
    engine.check_integrity()


def test_suffix_trees_from_two_cached_continuations(tiny_model_dir):
    """The cache holds the prompt's reply and two turns that say its first 6 tokens and then one
    other token (W): after those 6 tokens W weighs more (two places against one), so the chain
    drafts W alone (rejected); the tree drafts W and, as the root's second child, the reply's
    continuation (a third of the weight), which verification accepts, its K/V moved into place."""
    directory = str(tiny_model_dir("llama"))
    prompt = _prompts([25], seed=9)[0]
    params = SamplingParams(max_tokens=24, **GREEDY)
    options = dict(block_size=4, num_kv_blocks=256, speculative="suffix", speculative_max_batch=64,
                   speculative_adaptive=False)
    reply = Engine(directory, block_size=4, num_kv_blocks=256).generate([prompt], params)[0].token_ids
    other = [(reply[6] + 1) % 97, (reply[7] + 1) % 97]
    # 33 tokens each: the cache keeps 32, W (index 31) the last
    turns = [prompt + reply[:6] + other, [(prompt[0] + 1) % 97] + prompt[1:] + reply[:6] + other]

    def run(width):
        engine = Engine(directory, speculative_tree_width=width, **options)
        assert engine.generate([prompt], params)[0].token_ids == reply
        engine.generate(turns, SamplingParams(max_tokens=1, **GREEDY))
        before = engine.stats()
        assert engine.generate([prompt], params)[0].token_ids == reply
        engine.check_integrity()
        after = engine.stats()
        return {k: after[k] - before[k] for k in ("spec_branched_drafts", "spec_branch_hits", "spec_accepted_tokens")}

    chains, trees = run(1), run(2)
    assert chains == {"spec_branched_drafts": 0, "spec_branch_hits": 0, "spec_accepted_tokens": 17}
    assert trees == {"spec_branched_drafts": 1, "spec_branch_hits": 1, "spec_accepted_tokens": 19}


def test_tree_width_is_refused_where_it_would_do_nothing():
    EngineConfig(speculative="suffix", speculative_tree_width=3)
    with pytest.raises(ValueError, match="speculative_tree_width"):
        EngineConfig(speculative="prompt-lookup", speculative_tree_width=2)  # prompt lookup drafts chains
    with pytest.raises(ValueError, match="speculative_tree_width"):
        EngineConfig(speculative_tree_width=2)
    with pytest.raises(ValueError, match="positive"):
        EngineConfig(speculative="suffix", speculative_tree_width=0)


def test_recurrent_models_keep_chains(tiny_model_dir):
    """A recurrent layer's state follows one sequence: the engine drafts chains whatever the width."""
    engine = Engine(str(tiny_model_dir("qwen3_5")), block_size=4, num_kv_blocks=128, speculative="suffix",
                    speculative_tree_width=3)
    assert engine.runner.states is not None and engine.drafter.tree_width == 1

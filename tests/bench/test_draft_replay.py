"""bench/lib/draft_replay.py: drafting replayed on recorded outputs without the model."""

from __future__ import annotations

from bench.lib.draft_replay import replay

CHEAP = {1: 10.0, 2: 10.2, 4: 10.4, 8: 10.8, 9: 11.0, 16: 12.0}  # rows nearly free: drafts as long as they go


def test_a_copied_output_is_drafted_and_free_text_is_not():
    prompt = list(range(100, 164))
    copied = replay([(prompt, prompt[:48])], "prompt-lookup", CHEAP)
    assert copied.tokens == 47  # the first output token comes from the prompt's step
    assert copied.steps <= 47 / 3 and copied.accepted_length > 3 and copied.speedup > 2.5
    assert copied.accepted == copied.draft_tokens  # a copy: every draft token accepted
    free = replay([(prompt, list(range(500, 548)))], "prompt-lookup", CHEAP)
    assert (free.steps, free.tokens, free.drafts, free.speedup) == (47, 47, 0, 1.0)


def test_suffix_drafts_a_reply_said_before_to_another_prompt():
    reply = list(range(500, 548))
    recorded = [(list(range(100, 140)), reply), (list(range(200, 240)) + reply[:3], reply[3:])]
    own = replay(recorded, "prompt-lookup", CHEAP)
    tree = replay(recorded, "suffix", CHEAP)
    assert own.tokens == tree.tokens == 47 + 44
    assert own.steps == own.tokens  # prompt lookup reads only the request's own tokens: nothing to copy
    assert tree.steps < 47 + 44 / 3  # the second request copies the first's reply from the tree


def test_suffix_trees_take_the_branch_the_output_follows():
    """Two earlier replies agree on their first 6 tokens, then part; a third request says those
    6 and follows one of them: a chain draft follows one branch (a tie), the tree holds both
    within the same 4 rows, so the tree accepts at least as much either way and more on the
    branch the chain missed."""
    head, left, right = list(range(500, 506)), list(range(600, 624)), list(range(700, 724))
    told = [(list(range(100, 140)), head + left), (list(range(200, 240)) + head[:3], head[3:] + right)]
    gains = []
    for branch in (left, right):
        recorded = told + [(list(range(300, 340)) + head[:3], head[3:] + branch)]
        chains = replay(recorded, "suffix", CHEAP)
        trees = replay(recorded, "suffix-tree", CHEAP)
        assert chains.tokens == trees.tokens
        gains.append(trees.accepted - chains.accepted)
    assert min(gains) >= 0 and max(gains) > 0, gains

"""Hybrid KV on plain requests (no model): the windows the cache keeps where agents resume, the
end of every prompt and of every reply with a few blocks of slack (core/window_pages.py,
kv_manager.py), with exact block ids, hit counts and pages; page pressure trims the windows
that save the least compute per page first. Integrity (window pages included) after every step."""

from __future__ import annotations

from radixserve.config import EngineConfig
from radixserve.core.block_pool import BlockPool
from radixserve.core.radix_cache import RadixCache
from radixserve.core.request import RequestStatus
from radixserve.core.scheduler import Scheduler
from radixserve.core.window_pages import WindowPages
from scheduler_helpers import add, step

BS, WINDOW = 4, 32  # a window of 8 blocks; slack min(64, 32 / 4) tokens: 2 blocks


def hybrid_scheduler(num_blocks=64, num_pages=64, **options):
    config = EngineConfig(**{"block_size": BS, "chunked_prefill_size": 64, "max_num_batched_tokens": 64, **options})
    pool = BlockPool(num_blocks, WindowPages(num_pages, num_blocks, WINDOW, BS))
    return Scheduler(config, pool, RadixCache(pool, BS))


def run(s, tokens, max_tokens, token=7):
    """Run one request alone to its end; every step checks every invariant."""
    r = add(s, tokens, max_tokens)
    while r.status is not RequestStatus.FINISHED:
        step(s, token)
    return r


def pages(s, blocks):
    return [s.kv.pool.window.has_page(b) for b in blocks]


def path_blocks(s, tokens):
    match = s.kv.cache.match_prefix(tokens)
    node, out = match.node, []
    while not node.is_root:
        out[:0] = node.blocks
        node = node.parent
    return out


def test_slack_and_kept_from():
    w = WindowPages(8, 16, window=WINDOW, block_size=BS)
    assert w.slack == 2
    # an end at 12 blocks keeps the window of every point from 10 blocks on: from (40 - 32) / 4
    assert [w.kept_from(n) for n in (0, 2, 10, 12, 13)] == [0, 0, 0, 2, 3]
    assert WindowPages(8, 16, window=512, block_size=16).slack == 4  # Gemma 3: 64 tokens
    assert WindowPages(8, 16, window=6, block_size=4).slack == 1


def test_a_retry_with_another_continuation_hits_the_whole_prompt_less_a_block():
    s = hybrid_scheduler()
    prompt = list(range(100, 150))  # 50 tokens: 12 full blocks
    first = run(s, prompt, 4)  # 53 computed: the prompt's node (12 blocks) and the reply's (1)
    cached = path_blocks(s, prompt + first.output_token_ids)
    assert cached == list(range(13))
    # the prompt's end (12) and the reply's (13) keep the windows of the points from 2 blocks before them
    assert pages(s, cached) == [False] * 2 + [True] * 11
    retry = run(s, prompt + [1, 2, 3, 4, 5], 3)
    assert retry.cached_tokens == 48  # all 12 of the prompt's full blocks (before: 0, its window was gone)
    again = run(s, prompt, 3)  # the same prompt regenerated: 49 reusable tokens
    assert again.cached_tokens == 48
    assert path_blocks(s, prompt + [1, 2, 3, 4, 5])[:12] == list(range(12))
    assert s.kv.pool.window.num_attached == 11 + 2  # the retry's own two blocks (its prompt's and reply's ends)
    s.check_integrity()


def test_a_re_rendered_turn_hits_to_within_a_block_of_where_it_differs():
    s = hybrid_scheduler()
    prompt = list(range(200, 250))  # 50 tokens
    first = run(s, prompt, 12)  # reply [7] * 12; 61 computed: 15 full blocks cached
    assert first.output_token_ids == [7] * 12
    user = list(range(20, 26))
    # the reply's last three tokens rendered otherwise (an end-of-turn token, a trimmed space): differs at 59
    turn = run(s, prompt + [7] * 9 + [8, 8, 8] + user, 3)
    assert turn.cached_tokens == 56
    # a template that trims the reply's start: differs at 50, the prompt's end
    trimmed = run(s, prompt + [8] + [7] * 11 + user, 3)
    assert trimmed.cached_tokens == 48
    # differs in the middle of the reply (55): the two ends' windows cover every point between them
    middle = run(s, prompt + [7] * 5 + [9] * 7 + user, 3)
    assert middle.cached_tokens == 52
    s.check_integrity()


def test_n_copies_of_one_prompt_share_it():
    s = hybrid_scheduler()
    prompt = list(range(300, 348))  # 48 tokens: block-aligned, so a copy reuses 47 tokens (11 blocks)
    a, b = add(s, prompt, 4), add(s, prompt, 4)
    step(s)  # a computes the prompt; b waits a step to hit it
    assert a.num_computed_tokens == 48 and b.status is RequestStatus.WAITING
    step(s)
    assert b.status is RequestStatus.RUNNING and b.cached_tokens == 44
    assert b.block_table[:11] == a.block_table[:11] == list(range(11))
    while not (a.finished and b.finished):
        step(s)
    c = run(s, prompt, 2)  # a third, after both
    assert c.cached_tokens == 44
    s.check_integrity()


def test_few_shot_questions_on_a_prefix_past_two_windows_hit_it_all():
    s = hybrid_scheduler()
    shots = list(range(400, 472))  # 72 tokens: 18 blocks, past two windows of 8
    outs = [run(s, shots + [q, q + 1, q + 2, q + 3, q + 4, 60], 3) for q in range(0, 40, 10)]
    assert [o.cached_tokens for o in outs] == [0, 72, 72, 72]
    assert all(o.block_table == [] for o in outs)
    assert path_blocks(s, shots + [30]) [:18] == list(range(18))
    s.check_integrity()


def test_a_question_longer_than_the_slack_costs_one_recompute_then_the_branch_keeps_its_window():
    s = hybrid_scheduler()
    shots = list(range(500, 572))  # 72 tokens
    outs = [run(s, shots + list(range(q, q + 20)), 2) for q in (0, 100, 200)]
    # the first question's end is 5 blocks past the prefix's: its slack does not reach back to 72, so the
    # second recomputes (exactly: no earlier point has its window), and the branch it makes keeps one
    assert [o.cached_tokens for o in outs] == [0, 0, 72]
    assert path_blocks(s, shots + [1000])[:18] == list(range(18))  # the tree kept its own blocks, healed
    s.check_integrity()


def test_page_pressure_trims_the_window_that_saves_least_per_page_first():
    """Two cached conversations: X, a 64-token prompt (its window saves 64 tokens of recompute for
    its 10 pages), then Y, a 12-token prompt (12 tokens for 3 pages). A newcomer needs pages: Y's
    window, the more recent, goes first (least compute saved per page); X's stays whole."""
    s = hybrid_scheduler(num_blocks=64, num_pages=24)
    window = s.kv.pool.window
    x_prompt, y_prompt = list(range(600, 664)), list(range(800, 812))
    run(s, x_prompt, 2)  # 65 computed: 16 blocks, the prompt's and the reply's end at 16
    run(s, y_prompt, 2)  # 13 computed: 3 blocks
    x_path, y_path = path_blocks(s, x_prompt), path_blocks(s, y_prompt)
    assert x_path == list(range(16)) and y_path == [17, 18, 19]
    assert pages(s, x_path) == [False] * 6 + [True] * 10 and pages(s, y_path) == [True] * 3
    assert window.num_free == 24 - 13
    z = run(s, list(range(700, 748)), 2)  # 48 tokens: 13 blocks with pages while its prompt runs
    assert z.cached_tokens == 0
    assert pages(s, y_path) == [False] * 3  # Y's window went
    assert pages(s, x_path) == [False] * 6 + [True] * 10  # X's stayed
    assert s.kv.cache.evicted_blocks == 0
    assert run(s, x_prompt + [1, 2, 3], 2).cached_tokens == 64
    assert run(s, y_prompt + [1, 2, 3], 2).cached_tokens == 0  # recomputed: 12 tokens
    s.check_integrity()

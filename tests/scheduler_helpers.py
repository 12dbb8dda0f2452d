"""Plain-request helpers for scheduler tests (no model): a small scheduler, requests, one step."""

from __future__ import annotations

import itertools

from radixserve.config import EngineConfig
from radixserve.core.block_pool import BlockPool
from radixserve.core.radix_cache import RadixCache
from radixserve.core.request import Request
from radixserve.core.scheduler import Scheduler
from radixserve.sampling_params import SamplingParams

_ids = itertools.count()


def make_scheduler(num_blocks=32, cache=True, **options):
    config = EngineConfig(**{"block_size": 4, **options})
    pool = BlockPool(num_blocks)
    radix = RadixCache(pool, config.block_size) if cache else None
    return Scheduler(config, pool, radix)


def add(s, tokens, max_tokens=4):
    r = Request(f"r{next(_ids)}", list(tokens), SamplingParams(max_tokens=max_tokens), len(tokens) + max_tokens)
    s.add(r)
    return r


def step(s, token=7):
    """One scheduler round trip: the 'model' samples `token` for every sampling chunk."""
    plan = s.schedule()
    s.commit(plan)
    for c in plan.chunks:
        if c.samples:
            c.request.token_ids.append(token)
            if c.request.num_tokens >= c.request.max_total_tokens:
                s.finish(c.request, "length")
    s.check_integrity()
    return plan


def chunks(plan):
    return [(c.request.request_id, c.start, c.num_tokens) for c in plan.chunks]


def drafts_one_by_one(drafter, asks, budget):
    """A scripted drafter's step (propose_step): each request's own propose() in turn, within
    the step's budget, whatever the batch (no cost model)."""
    drafts = []
    for request, room in asks:
        drafts.append(drafter.propose(request, min(room, budget)))
        budget -= len(drafts[-1])
    return drafts

"""The prefill role's work on one replica: compute a prompt through the replica's own engine
(its radix cache included), sample the first token, export the blocks the decode side lacks.
No Ray here: PrefillReplica (pd_replica.py) puts the bytes in Ray's object store."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from typing import Any

from radixserve.cluster.pd_jobs import PrefillJob
from radixserve.config import EngineConfig
from radixserve.engine.kv_transfer import KVHandoff
from radixserve.outputs import RequestOutput
from radixserve.sampling_params import SamplingParams
from radixserve.server.async_engine import AsyncEngine
from radixserve.server.request_group import GenerationInput


def prefill_engine_kwargs(engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    """A prefill replica's engine options: the cluster's, with prompt chunks as large as one
    step takes. Chunking protects running decodes from a long prompt's step; a prefill
    replica runs none, so smaller chunks there would only cost matmul efficiency (and TTFT)."""
    budget = engine_kwargs.get("max_num_batched_tokens", EngineConfig().max_num_batched_tokens)
    return {**engine_kwargs, "chunked_prefill_size": budget}  # a chunk never exceeds the budget


async def run_prefill(engine: AsyncEngine, job: PrefillJob, source: str | None = None) -> KVHandoff:
    """The job's handoff; raises APIError if the engine refuses or fails the request.

    The export runs on the engine thread at the request's finish, before the engine steps
    again. Queued as a later engine call it ran after the next step: behind a waiting prompt,
    a prompt's handoff waited for that one's whole prefill, and its blocks could be evicted.
    Cancelled (the decode side stopped waiting), the prompt is aborted: a waiting prompt is not
    computed, one in its last step is not exported (or its hold is released)."""
    params = first_token_params(job.params)
    exported: list[KVHandoff | BaseException] = []
    gone = threading.Lock()  # the hook on the engine thread against a cancel on the event loop
    cancelled = False

    def export(e, out: RequestOutput) -> None:
        if not out.token_ids or out.finish_reason == "abort":
            return
        first_logprob = out.logprobs[0] if out.logprobs else None
        with gone:
            if cancelled:
                return  # finished in the step that was running when the decode side gave up
            try:
                exported.append(e.kv_transfer.export(job.token_ids, job.cache_salt, job.skip_blocks,
                                                     out.token_ids[0], first_logprob))
            except Exception as exc:  # raised below, on the event loop
                exported.append(exc)

    group = await engine.submit([GenerationInput(list(job.token_ids), params, job.cache_salt)], on_finish=export)
    try:
        [out] = await group.results()
    except asyncio.CancelledError:  # the decode side stopped waiting: stop computing it, drop its hold
        group.abort()
        with gone:
            cancelled = True
            held = [h for h in exported if isinstance(h, KVHandoff)]
        for handoff in held:
            engine.run_on_engine(lambda e, h=handoff: e.kv_transfer.release(h.handoff_id))
        raise
    if not exported:
        raise RuntimeError(f"the prefill ended without a token ({out.finish_reason})")
    if isinstance(exported[0], BaseException):
        raise exported[0]
    handoff = exported[0]
    handoff.source = source
    return handoff


async def release(engine: AsyncEngine, handoff_id: str) -> bool:
    return await engine.call(lambda e: e.kv_transfer.release(handoff_id))


async def expire(engine: AsyncEngine) -> int:
    return await engine.call(lambda e: e.kv_transfer.expire())


def first_token_params(params: SamplingParams) -> SamplingParams:
    """The request's params for its first token only (stop checks and the constraint hold; the
    decode side makes the same checks again as it appends the token)."""
    return dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1), speculative=False)

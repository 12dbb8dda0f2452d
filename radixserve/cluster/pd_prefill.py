"""The prefill role's work on one replica: compute a prompt through the replica's own engine
(its radix cache included), sample the first token, export the blocks the decode side lacks.
No Ray here: PrefillReplica (pd_replica.py) puts the bytes in Ray's object store."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
from typing import Any

from radixserve.cluster.pd_jobs import PrefillJob
from radixserve.config import EngineConfig
from radixserve.engine.kv_transfer import KVHandoff
from radixserve.kernels.openmp_pool import release_thread_pool
from radixserve.outputs import RequestOutput
from radixserve.sampling_params import SamplingParams
from radixserve.server.async_engine import AsyncEngine
from radixserve.server.request_group import GenerationInput

_READER = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="radixserve-kv-export")  # one read at a time


def prefill_engine_kwargs(engine_kwargs: dict[str, Any]) -> dict[str, Any]:
    """A prefill replica's engine options: the cluster's, with prompt chunks as large as one
    step takes. Chunking protects running decodes from a long prompt's step; a prefill
    replica runs none, so smaller chunks there would only cost matmul efficiency (and TTFT)."""
    budget = engine_kwargs.get("max_num_batched_tokens", EngineConfig().max_num_batched_tokens)
    return {**engine_kwargs, "chunked_prefill_size": budget}  # a chunk never exceeds the budget


async def run_prefill(engine: AsyncEngine, job: PrefillJob, source: str | None = None) -> KVHandoff:
    """The job's handoff; raises APIError if the engine refuses or fails the request.

    The blocks are held on the engine thread at the request's finish, before the engine steps
    again (held by a call queued behind the next step, a prompt waited for the whole prefill of
    the one behind it, and its blocks could be evicted meanwhile); their bytes are then read on
    a thread of their own while the engine goes on with the next prompt."""
    params = first_token_params(job.params)
    held: list[KVHandoff | BaseException] = []

    def hold(e, out: RequestOutput) -> None:
        if not out.token_ids or out.finish_reason == "abort":
            return
        first_logprob = out.logprobs[0] if out.logprobs else None
        try:
            held.append(e.kv_transfer.hold(job.token_ids, job.cache_salt, job.skip_blocks, out.token_ids[0],
                                           first_logprob))
        except Exception as exc:  # raised below, on the event loop
            held.append(exc)

    group = await engine.submit([GenerationInput(list(job.token_ids), params, job.cache_salt)], on_finish=hold)
    [out] = await group.results()
    if not held:
        raise RuntimeError(f"the prefill ended without a token ({out.finish_reason})")
    if isinstance(held[0], BaseException):
        raise held[0]
    handoff = held[0]
    handoff.source = source
    try:
        await asyncio.get_running_loop().run_in_executor(_READER, _read, engine, handoff)
    except BaseException:
        engine.run_on_engine(lambda e: e.kv_transfer.release(handoff.handoff_id))  # no one will ask for it
        raise
    return handoff


def _read(engine: AsyncEngine, handoff: KVHandoff) -> None:
    """On the reader thread; then its OpenMP workers go (openmp_pool.py: a pool idling beside
    the engine thread's stops that one's workers spinning)."""
    try:
        engine.engine.kv_transfer.read(handoff)
    finally:
        release_thread_pool()


async def release(engine: AsyncEngine, handoff_id: str) -> bool:
    return await engine.call(lambda e: e.kv_transfer.release(handoff_id))


async def expire(engine: AsyncEngine) -> int:
    return await engine.call(lambda e: e.kv_transfer.expire())


def first_token_params(params: SamplingParams) -> SamplingParams:
    """The request's params for its first token only (stop checks and the constraint hold; the
    decode side makes the same checks again as it appends the token)."""
    return dataclasses.replace(params, max_tokens=1, min_tokens=min(params.min_tokens, 1), speculative=False)

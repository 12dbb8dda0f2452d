"""PrefillClient: the decode role's side of disaggregation, installed as the AsyncEngine's
`remote_prefill` on a decode replica.

For each request it first asks its own engine how many leading blocks of the prompt its tree
holds; a prompt with few tokens beyond them is computed here (a round trip would cost more).
So is one that arrives while the prefill role is backed up (conditional disaggregation,
PDOptions.prefill_backlog_tokens): the prompts this client has sent to that prefill replica,
not yet answered, add up to the limit, and this engine's own pending prompt work is less.
Otherwise a prefill replica (the one the ingress chose, PREFILL_TARGET; else prefix affinity
through the handle) computes it and answers with a KVHandoff whose bytes wait in Ray's object
store. The client fetches them, has the engine thread reserve the blocks its tree lacks, copies
the bytes into them on a thread of its own (never the engine thread: the running streams' steps
go on meanwhile), and hands the filled reservation over: Engine.admit_handoff commits it to the
tree and admits the request. Then the prefill replica is told to release its hold. A reservation
that is not committed (the request went away, the transfer timed out) is cancelled once its
copy ends.
A prefill replica that dies before answering: the job goes to another (nothing has streamed).
No answer within transfer_timeout_s, or every attempt failed: TransferFailed, and the decode
engine computes the prompt itself; the prefill call it stopped waiting for is cancelled, so the
prefill replica stops computing it too.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import time
from typing import Any

import numpy as np

from radixserve.cluster.options import PDOptions
from radixserve.cluster.pd_jobs import PREFILL_TARGET, PrefillJob, ReleaseJob
from radixserve.engine.inputs import PreparedRequest
from radixserve.engine.kv_import import ImportResult, PendingImport
from radixserve.engine.kv_transfer import KVHandoff, TransferFailed
from radixserve.kernels.openmp_pool import release_thread_pool

Arrival = PendingImport | TransferFailed | None  # what the engine admits a request with

log = logging.getLogger("radixserve.cluster")


class PrefillClient:
    def __init__(self, handle: Any, options: PDOptions, replica_gone: tuple[type[BaseException], ...] = ()):
        self.handle = handle  # the prefill deployment's handle (or a stand-in with the same calls)
        self.options = options
        self.replica_gone = replica_gone  # exceptions meaning "that prefill replica died": retry
        self._pending: set[asyncio.Future] = set()
        self._copier = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="radixserve-kv-import")
        self._engine: Any = None  # the AsyncEngine this client serves (set by prefill)
        self._backlog: dict[str | None, int] = {}  # prompt tokens sent, not yet answered, by target replica

    def attach(self, engine: Any) -> None:
        """Make the AsyncEngine `engine` a decode side: its prompts go through this client, and
        its kv_* stats and metrics show from the start, not only after its first transfer."""
        engine.remote_prefill = self
        engine.engine.kv_transfer.enabled = True

    async def prefill(self, engine: Any, prepared: list[PreparedRequest]) -> list[Arrival]:
        self._engine = engine
        return list(await asyncio.gather(*(self._one(engine, p) for p in prepared)))

    def release(self, arrivals: list[Any]) -> None:
        """After admission (or instead of it): cancel every reservation the engine did not commit,
        and ack every handoff that left blocks held on its prefill replica (fire and forget)."""
        for h in arrivals:
            if isinstance(h, PendingImport):
                if h.state != "committed":
                    self._cancel(h)
                h = h.handoff
            if isinstance(h, KVHandoff) and h.num_blocks and h.source is not None:
                task = asyncio.ensure_future(self._release(ReleaseJob(h.source, h.handoff_id)))
                self._pending.add(task)
                task.add_done_callback(self._pending.discard)

    # ---- helpers ----------------------------------------------------------------------

    async def _one(self, engine: Any, p: PreparedRequest) -> Arrival:
        if p.params.prompt_logprobs is not None or p.params.prefill_only:
            return None  # prompt logprobs are computed where they are returned
        have, pending_here = await engine.call(
            lambda e: (e.kv_transfer.cached_blocks(p.token_ids, p.cache_salt), e.scheduler.pending_prefill_tokens()))
        missing = len(p.token_ids) - have * engine.engine.config.block_size
        if missing <= self.options.local_prefill_tokens:
            return None
        target = PREFILL_TARGET.get()
        if self._backed_up(target, pending_here):
            engine.engine.kv_transfer.stats.backlog_local_prefills += 1
            return None
        job = PrefillJob.of(p.token_ids, p.params, p.cache_salt, have, target)
        try:
            return await asyncio.wait_for(self._transfer(engine, job, missing), self.options.transfer_timeout_s)
        except asyncio.TimeoutError:
            return TransferFailed("timeout")
        except Exception as exc:  # every attempt failed, or the payload could not be fetched
            log.warning("remote prefill failed, computing here: %s: %s", type(exc).__name__, exc)
            return TransferFailed(f"{type(exc).__name__}: {exc}")

    def _backed_up(self, target: str | None, pending_here: int) -> bool:
        """Whether the prompt should be computed here: the prefill replica it would go to (all of
        them when the ingress named none) has `prefill_backlog_tokens` of this client's prompts
        waiting, and this engine has less prompt work of its own."""
        limit = self.options.prefill_backlog_tokens
        if not limit:
            return False
        waiting = self._backlog.get(target, 0) if target is not None else sum(self._backlog.values())
        return waiting >= limit and pending_here < waiting

    async def _transfer(self, engine: Any, job: PrefillJob, missing: int) -> PendingImport | TransferFailed:
        stats = engine.engine.kv_transfer.stats
        self._backlog[job.target_replica] = self._backlog.get(job.target_replica, 0) + missing
        stats.prefill_backlog_tokens += missing
        try:
            handoff = await self._call_prefill(engine, job)
        finally:
            self._backlog[job.target_replica] -= missing
            stats.prefill_backlog_tokens -= missing
        try:
            t0 = time.perf_counter()
            if not isinstance(handoff.data, np.ndarray):
                handoff.data = await handoff.data  # a Ray ObjectRef: the bytes come to this node
            stats.fetch_ms += (time.perf_counter() - t0) * 1000.0
            return await self._import(engine, handoff)
        except BaseException:  # timed out or failed after the prefill answered: its hold can go now
            self.release([handoff])
            raise

    async def _import(self, engine: Any, handoff: KVHandoff) -> PendingImport | TransferFailed:
        """The handoff's bytes in blocks reserved for them, copied off the engine thread."""
        reserving = engine.run_on_engine(lambda e: e.kv_transfer.reserve(handoff))
        try:
            pending = await asyncio.shield(asyncio.wrap_future(reserving))
        except asyncio.CancelledError:
            reserving.add_done_callback(lambda done: self._cancel_reserved(done))
            raise
        if isinstance(pending, ImportResult):
            self.release([handoff])
            return TransferFailed(pending.failed or "the handoff could not be used")
        copying = asyncio.wrap_future(self._copier.submit(_copy_in, pending))
        try:
            await asyncio.shield(copying)
        except asyncio.CancelledError:
            copying.add_done_callback(lambda _: self._cancel(pending))
            raise
        return pending

    def _cancel(self, pending: PendingImport) -> None:
        """Free a reservation on the engine thread (thread-safe; a no-op once committed)."""
        if self._engine is not None and pending.block_table:
            self._engine.run_on_engine(lambda e: e.kv_transfer.cancel(pending))

    def _cancel_reserved(self, reserving: concurrent.futures.Future) -> None:
        if not reserving.cancelled() and reserving.exception() is None and isinstance(reserving.result(), PendingImport):
            self._cancel(reserving.result())

    async def _call_prefill(self, engine: Any, job: PrefillJob) -> KVHandoff:
        stats = engine.engine.kv_transfer.stats
        for attempt in range(self.options.max_attempts):
            stats.remote_prefills += 1
            response = self.handle.prefill.remote(job)
            try:
                return await response
            except asyncio.CancelledError:  # timed out, or the request went away
                if hasattr(response, "cancel"):
                    response.cancel()  # Ray's: the prefill replica stops computing what no one waits for
                raise
            except self.replica_gone as exc:
                stats.prefill_retries += 1
                job = dataclasses.replace(job, target_replica=None)  # the chosen one is gone: any other
                if attempt + 1 == self.options.max_attempts:
                    raise
                log.warning("prefill replica failed (%s); retrying on another", type(exc).__name__)
                await asyncio.sleep(0.05 * (attempt + 1))  # let the router hear of the death
        raise AssertionError("unreachable")

    async def _release(self, job: ReleaseJob) -> None:
        try:
            await self.handle.release.remote(job)
        except Exception:  # the prefill replica's hold times out on its own
            log.debug("release of %s failed", job.handoff_id, exc_info=True)


def _copy_in(pending: PendingImport) -> None:
    """The copy, on the copier thread; then that thread's OpenMP workers go (a pool idling
    beside the engine thread's would stop its workers spinning: openmp_pool.py)."""
    try:
        pending.copy()
    finally:
        release_thread_pool()

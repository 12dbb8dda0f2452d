"""The two roles of a replica in a disaggregated cluster (the same engine and app as RadixReplica).

PrefillReplica computes prompts for decode replicas (`prefill`), puts each handoff's bytes in
Ray's object store, and holds the blocks until `release` or its hold time passes. DecodeReplica
serves every HTTP request the ingress sends it, with a PrefillClient as its engine's
remote_prefill: prompts run on a prefill replica, decoding here.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import ray

from radixserve.cluster import pd_prefill
from radixserve.cluster.pd_client import PDOptions, PrefillClient
from radixserve.cluster.pd_jobs import PrefillJob, ReleaseJob
from radixserve.cluster.replica import RadixReplica
from radixserve.engine.kv_transfer import KVHandoff
from radixserve.server.options import ServerOptions

REPLICA_GONE = (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)


class PrefillReplica(RadixReplica):
    role = "prefill"

    async def __init__(self, engine_kwargs: dict[str, Any], server_options: ServerOptions, pd: PDOptions):
        await super().__init__(pd_prefill.prefill_engine_kwargs(engine_kwargs), server_options)
        self.engine = self.app.state.server.engine
        self.engine.engine.kv_transfer.hold_s = pd.hold_s
        self.engine.engine.kv_transfer.enabled = True  # its kv_* stats and metrics from the start
        self._expiry = asyncio.ensure_future(self._expire_every(max(0.5, pd.hold_s / 4)))

    async def prefill(self, job: PrefillJob) -> KVHandoff:
        handoff = await pd_prefill.run_prefill(self.engine, job, self.replica)
        handoff.data = ray.put(handoff.data)  # the bytes wait in the object store for the decode side
        return handoff

    async def release(self, job: ReleaseJob) -> bool:
        if job.target_replica != self.replica:
            return False  # routed elsewhere (the target was busy or gone): its hold times out there
        return await pd_prefill.release(self.engine, job.handoff_id)

    async def _expire_every(self, period_s: float) -> None:
        while True:
            await asyncio.sleep(period_s)
            with contextlib.suppress(Exception):
                await pd_prefill.expire(self.engine)


class DecodeReplica(RadixReplica):
    role = "decode"

    async def __init__(self, engine_kwargs: dict[str, Any], server_options: ServerOptions, prefill: Any, pd: PDOptions):
        await super().__init__(engine_kwargs, server_options)
        PrefillClient(prefill, pd, REPLICA_GONE).attach(self.app.state.server.engine)

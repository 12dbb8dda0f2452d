"""Disaggregation through the server, without Ray: a decode server whose engine's remote_prefill
is a PrefillClient over a stand-in handle that runs the prefill role (cluster/pd_prefill.py) on a
second in-process server. Greedy output equals one server's; only the blocks the decode tree
lacks move; a prefill replica that dies is retried; a transfer that times out is computed on
the decode side; both sides' integrity holds after every scenario."""

from __future__ import annotations

import asyncio
import random

import httpx
import numpy as np
import pytest

from radixserve import Engine
from radixserve.cluster.options import PDOptions
from radixserve.cluster.pd_client import PrefillClient
from radixserve.cluster.pd_jobs import PrefillJob, ReleaseJob
from radixserve.cluster.pd_prefill import release, run_prefill
from radixserve.server import ServerOptions, create_app
from radixserve.server.testing import BackgroundServer

pytestmark = [pytest.mark.real_model, pytest.mark.timeout(300)]

ENGINE = dict(num_threads=1, num_kv_blocks=400)
BS = 16


class ReplicaGone(RuntimeError):
    """Stands for Ray's RayActorError."""


class _Ready:
    """An awaitable payload, as a Ray ObjectRef is."""

    def __init__(self, value):
        self.value = value

    def __await__(self):
        yield from asyncio.sleep(0).__await__()
        return self.value


class _Method:
    def __init__(self, fn):
        self.fn = fn

    def remote(self, job):
        return self.fn(job)


class FakePrefillHandle:
    """A stand-in for the PrefillReplica deployment's handle: runs jobs on `app`'s engine."""

    def __init__(self, app):
        self.app = app
        self.die = 0  # the next N jobs fail as if the replica died
        self.hang = False
        self.jobs: list[PrefillJob] = []
        self.releases: list[ReleaseJob] = []
        self.prefill = _Method(self._prefill)
        self.release = _Method(self._release)

    async def _prefill(self, job: PrefillJob):
        self.jobs.append(job)
        if self.die:
            self.die -= 1
            raise ReplicaGone("the replica died")
        if self.hang:
            await asyncio.sleep(3600)
        handoff = await self._on_server(run_prefill(self._engine, job, "prefill-0"))
        handoff.data = _Ready(handoff.data)
        return handoff

    async def _release(self, job: ReleaseJob):
        self.releases.append(job)
        return await self._on_server(release(self._engine, job.handoff_id))

    @property
    def _engine(self):
        return self.app.state.server.engine

    async def _on_server(self, coro):
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._engine._loop))


@pytest.fixture(scope="module")
def servers(real_model_dir):
    options = ServerOptions(enable_debug_endpoints=True)
    prefill_app = create_app(Engine(str(real_model_dir), **ENGINE), options)
    decode_app = create_app(Engine(str(real_model_dir), **ENGINE), options)
    handle = FakePrefillHandle(prefill_app)
    client = PrefillClient(handle, PDOptions(local_prefill_tokens=0, transfer_timeout_s=60.0), (ReplicaGone,))
    decode_app.state.server.engine.remote_prefill = client
    single_app = create_app(Engine(str(real_model_dir), **ENGINE), options)
    with BackgroundServer(prefill_app) as p, BackgroundServer(decode_app) as d, BackgroundServer(single_app) as s:
        yield p.url, d.url, s.url, handle, client


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 40000) for _ in range(n)]


def complete(url: str, prompt: list[int], stream: bool = False, max_tokens: int = 10, **sampling) -> str:
    body = {"model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream,
            **sampling}
    if not stream:
        r = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]
    text = ""
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                import json

                text += "".join(c["text"] for c in json.loads(line[6:])["choices"])
    return text


def stats(url: str) -> dict:
    return httpx.get(url + "/debug/stats", timeout=30).json()


def check_integrity(*urls: str) -> None:
    for url in urls:
        r = httpx.post(url + "/debug/check_integrity", timeout=30)
        assert r.status_code == 200, r.text


def test_greedy_equality_and_only_missing_blocks(servers):
    p, d, s, handle, _ = servers
    system = ids(64, 1)  # 4 blocks
    first = system + ids(40, 2)  # 104 tokens: 6 full blocks
    assert complete(d, first) == complete(s, first)
    after = stats(d)
    assert (after["kv_received_blocks"], after["kv_skipped_blocks"]) == (6, 0)
    assert handle.jobs[-1].skip_blocks == 0
    check_integrity(p, d)

    second = system + ids(50, 3)  # shares the 4 system blocks: 114 tokens, 7 full blocks
    assert complete(d, second, stream=True) == complete(s, second, stream=True)
    now = stats(d)
    assert handle.jobs[-1].skip_blocks == 4
    assert now["kv_received_blocks"] - after["kv_received_blocks"] == 3
    assert stats(p)["kv_sent_blocks"] == 9
    assert now["kv_fallback_recomputes"] == 0
    check_integrity(p, d)


def test_exact_repeat_sends_no_blocks_and_acks_release_the_holds(servers):
    p, d, s, handle, client = servers
    prompt = ids(70, 10)
    assert complete(d, prompt) == complete(s, prompt)
    sent = stats(p)["kv_sent_blocks"]
    assert complete(d, prompt) == complete(s, prompt)  # the decode tree holds every full block now
    assert stats(p)["kv_sent_blocks"] == sent
    assert handle.jobs[-1].skip_blocks == 4
    asyncio.run(asyncio.sleep(0.2))
    assert stats(p)["kv_export_holds"] == 0  # every export was acked
    check_integrity(p, d)


def test_a_prefill_replica_that_dies_is_retried(servers):
    p, d, s, handle, _ = servers
    before = stats(d)
    handle.die = 1
    prompt = ids(80, 20)
    assert complete(d, prompt) == complete(s, prompt)
    now = stats(d)
    assert now["kv_prefill_retries"] - before["kv_prefill_retries"] == 1
    assert now["kv_fallback_recomputes"] == before["kv_fallback_recomputes"]
    assert now["kv_received_blocks"] - before["kv_received_blocks"] == 5
    check_integrity(p, d)


def test_a_transfer_that_times_out_is_computed_on_the_decode_side(servers):
    p, d, s, handle, client = servers
    before = stats(d)
    client.options = PDOptions(local_prefill_tokens=0, transfer_timeout_s=1.0)
    handle.hang = True
    try:
        prompt = ids(90, 30)
        assert complete(d, prompt) == complete(s, prompt)
    finally:
        handle.hang = False
        client.options = PDOptions(local_prefill_tokens=0, transfer_timeout_s=60.0)
    now = stats(d)
    assert now["kv_fallback_recomputes"] - before["kv_fallback_recomputes"] == 1
    assert now["kv_fallback_tokens"] - before["kv_fallback_tokens"] == 90
    assert now["kv_received_blocks"] == before["kv_received_blocks"]
    check_integrity(p, d)


def test_short_uncached_tail_stays_on_the_decode_replica(servers):
    p, d, s, handle, client = servers
    client.options = PDOptions(local_prefill_tokens=32, transfer_timeout_s=60.0)
    try:
        jobs = len(handle.jobs)
        prompt = ids(20, 40)
        assert complete(d, prompt) == complete(s, prompt)
        assert len(handle.jobs) == jobs
    finally:
        client.options = PDOptions(local_prefill_tokens=0, transfer_timeout_s=60.0)
    metrics = httpx.get(d + "/metrics", timeout=30).text
    assert "radixserve_kv_received_blocks_total" in metrics and "radixserve_kv_fallback_recomputes_total" in metrics
    check_integrity(p, d)


def test_seeded_sampling_equals_one_server(servers):
    """The first token is drawn on the prefill replica, the rest here: a seeded request's
    tokens equal one server's, streamed or not (its noise is keyed by seed and position)."""
    p, d, s, handle, _ = servers
    prompt = ids(75, 50)
    sampled = dict(temperature=1.0, seed=7, ignore_eos=True, max_tokens=16)
    want = complete(s, prompt, **sampled)
    assert want != complete(s, prompt, **{**sampled, "seed": 8})  # the seed decides the tokens
    jobs = len(handle.jobs)
    assert complete(d, prompt, **sampled) == want
    assert complete(d, prompt + ids(30, 51), stream=True, **sampled) == complete(s, prompt + ids(30, 51), stream=True,
                                                                                 **sampled)
    assert len(handle.jobs) == jobs + 2 and handle.jobs[-1].params.seed == 7
    check_integrity(p, d)

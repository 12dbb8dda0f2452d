"""Disaggregation through the server, without Ray: a decode server whose engine's remote_prefill
is a PrefillClient over a stand-in handle that runs the prefill role (cluster/pd_prefill.py) on a
second in-process server. Greedy output equals one server's; only the blocks the decode tree
lacks move; a prefill replica that dies is retried; a transfer that times out is computed on
the decode side; both sides' integrity holds after every scenario."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import httpx
import pytest

from radixserve import Engine, SamplingParams
from radixserve.cluster.options import PDOptions
from radixserve.config import EngineConfig
from radixserve.cluster.pd_client import PrefillClient
from radixserve.cluster.pd_jobs import PrefillJob, ReleaseJob
from radixserve.cluster.pd_prefill import prefill_engine_kwargs, release, run_prefill
from radixserve.server import ServerOptions, create_app
from radixserve.server.request_group import GenerationInput
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
    """A stand-in for the PrefillReplica deployment's handle over `apps` (replica name -> app):
    a job goes to its target replica, as the Ray router sends it, else to the first."""

    def __init__(self, apps: dict):
        self.apps = apps
        self.die = 0  # the next N jobs fail as if the replica died
        self.hang = False
        self.gate: threading.Event | None = None  # when set to an Event, jobs wait for it first
        self.jobs: list[PrefillJob] = []
        self.served: list[str] = []  # the replica each job ran on
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
        while self.gate is not None and not self.gate.is_set():
            await asyncio.sleep(0.01)
        name = job.target_replica if job.target_replica in self.apps else next(iter(self.apps))
        self.served.append(name)
        handoff = await self._on_server(name, run_prefill(self._engine(name), job, name))
        handoff.data = _Ready(handoff.data)
        return handoff

    async def _release(self, job: ReleaseJob):
        self.releases.append(job)
        return await self._on_server(job.target_replica, release(self._engine(job.target_replica), job.handoff_id))

    def _engine(self, name: str):
        return self.apps[name].state.server.engine

    async def _on_server(self, name: str, coro):
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._engine(name)._loop))


@pytest.fixture(scope="module")
def apps(real_model_dir):
    """Two prefill apps, a decode app whose PrefillClient sends them jobs, one single server."""
    options = ServerOptions(enable_debug_endpoints=True)
    prefill_apps = {f"prefill-{i}": create_app(Engine(str(real_model_dir), **ENGINE), options) for i in range(2)}
    decode_app = create_app(Engine(str(real_model_dir), **ENGINE), options)
    handle = FakePrefillHandle(prefill_apps)
    client = PrefillClient(handle, PDOptions(local_prefill_tokens=0, transfer_timeout_s=60.0), (ReplicaGone,))
    client.attach(decode_app.state.server.engine)
    single_app = create_app(Engine(str(real_model_dir), **ENGINE), options)
    with BackgroundServer(prefill_apps["prefill-0"]) as p0, BackgroundServer(prefill_apps["prefill-1"]) as p1, \
            BackgroundServer(decode_app) as d, BackgroundServer(single_app) as s:
        yield {"prefill-0": p0.url, "prefill-1": p1.url}, decode_app, d.url, s.url, handle, client


@pytest.fixture
def servers(apps):
    """Straight to the decode server (no ingress: its jobs go to prefill-0)."""
    prefill_urls, _, d, s, handle, client = apps
    return prefill_urls["prefill-0"], d, s, handle, client


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
    fresh = stats(d)  # a decode side reports its kv_* stats before its first transfer
    assert (fresh["kv_prefill_backlog_tokens"], fresh["kv_received_blocks"], fresh["kv_remote_prefills"]) == (0, 0, 0)
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


@pytest.mark.parametrize("n, computed", [(1500, "part"), (480, "all")])
def test_a_prefill_the_decode_side_stopped_waiting_for_is_stopped(servers, n, computed):
    """A transfer that times out while the prefill replica is still computing the prompt: the
    decode side computes it itself, and the prefill call is cancelled, so the prefill replica
    aborts the prompt (it used to compute and export it, and hold the blocks for nobody). A
    prompt of several steps stops between them; one inside its only step (480 tokens, the
    chunk is 512) is computed to its end but not exported."""
    p, d, s, handle, client = servers
    before_p, before_d = stats(p), stats(d)
    client.options = PDOptions(local_prefill_tokens=0, transfer_timeout_s=0.3)
    try:
        prompt = ids(n, 33 + n)  # over a second of prefill on one thread; not a prefix of the other
        assert complete(d, prompt) == complete(s, prompt)
    finally:
        client.options = PDOptions(local_prefill_tokens=0, transfer_timeout_s=60.0)
    assert stats(d)["kv_fallback_recomputes"] - before_d.get("kv_fallback_recomputes", 0) == 1
    deadline = time.monotonic() + 60
    while (now := stats(p))["running"] + now["waiting"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert now["running"] + now["waiting"] == 0
    assert now.get("kv_exports", 0) == before_p.get("kv_exports", 0) and now.get("kv_export_holds", 0) == 0
    done = now["computed_tokens"] - before_p["computed_tokens"]
    assert (done < n) if computed == "part" else (done == n), (done, n)
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
    assert "radixserve_kv_import_engine_ms_total" in metrics and "radixserve_kv_imports_pending" in metrics
    check_integrity(p, d)


def test_a_prompt_arriving_while_the_prefill_replica_is_backed_up_is_computed_on_the_decode_side(servers):
    """Conditional disaggregation: while a 200-token prompt waits at the prefill replica (held
    there by a gate), the next prompt is computed by the decode replica itself, with the limit
    at 160 tokens; once the gate opens the first one's KV arrives as usual. Both answers equal
    one server's, and the limit's gauge and counter say what happened."""
    p, d, s, handle, client = servers
    first, second = ids(200, 60), ids(150, 61)
    want = complete(s, first), complete(s, second)
    before = stats(d)
    jobs = len(handle.jobs)
    client.options = PDOptions(local_prefill_tokens=0, transfer_timeout_s=60.0, prefill_backlog_tokens=160)
    handle.gate = threading.Event()
    answers: dict[str, str] = {}
    waiting = threading.Thread(target=lambda: answers.update(first=complete(d, first)))
    try:
        waiting.start()
        deadline = time.monotonic() + 30
        while stats(d).get("kv_prefill_backlog_tokens", 0) != 200 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert stats(d)["kv_prefill_backlog_tokens"] == 200  # the gauge: the first prompt waits there
        assert complete(d, second) == want[1]
        assert len(handle.jobs) == jobs + 1  # the second never went to the prefill role
        handle.gate.set()
        waiting.join(60)
    finally:
        handle.gate.set()
        handle.gate = None
        client.options = PDOptions(local_prefill_tokens=0, transfer_timeout_s=60.0)
    assert answers["first"] == want[0]
    now = stats(d)
    assert now["kv_backlog_local_prefills"] - before.get("kv_backlog_local_prefills", 0) == 1
    assert now["kv_received_blocks"] - before["kv_received_blocks"] == 12  # the first's full blocks came
    assert now["kv_fallback_recomputes"] == before["kv_fallback_recomputes"]
    assert now["kv_prefill_backlog_tokens"] == 0
    assert "radixserve_kv_backlog_local_prefills_total" in httpx.get(d + "/metrics", timeout=30).text
    check_integrity(p, d)


def test_the_backlog_rule_weighs_the_target_replicas_queue_against_the_decode_sides_own():
    client = PrefillClient(None, PDOptions(prefill_backlog_tokens=100))
    client._backlog = {"prefill-0": 150, "prefill-1": 20}
    assert client._backed_up("prefill-0", pending_here=0)
    assert client._backed_up("prefill-0", pending_here=149)
    assert not client._backed_up("prefill-0", pending_here=150)  # as much work here: send it
    assert not client._backed_up("prefill-1", pending_here=0)  # the target itself is not backed up
    assert client._backed_up(None, pending_here=0)  # no target named: every prefill replica's
    client.options = PDOptions(prefill_backlog_tokens=0)
    assert not client._backed_up("prefill-0", pending_here=0)  # 0: never


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


class _DecodeHandle:
    """A stand-in for the DecodeReplica deployment's handle: forward runs the decode app on its
    server's loop (where its engine lives) and relays the answer's items."""

    def __init__(self, app, name: str = "decode-0"):
        self.app, self.name = app, name
        self.forwarded: list = []

    def options(self, stream: bool) -> "_DecodeHandle":
        return self

    @property
    def forward(self) -> "_DecodeHandle":
        return self

    def remote(self, request):
        from radixserve.cluster.forwarding import serve_forwarded

        self.forwarded.append(request)

        async def run():
            return [item async for item in serve_forwarded(self.app, request, self.name)]

        loop = self.app.state.server.engine._loop
        return _Items(asyncio.wrap_future(asyncio.run_coroutine_threadsafe(run(), loop)))


class _Items:
    def __init__(self, future):
        self.future, self.items = future, None

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.items is None:
            self.items = list(await self.future)
        if not self.items:
            raise StopAsyncIteration
        return self.items.pop(0)

    def cancel(self) -> None:
        pass


def via_ingress(ingress, prompt: list[int], max_tokens: int = 8, **extra) -> httpx.Response:
    from starlette.requests import Request

    async def asgi(scope, receive, send):
        response = await ingress(Request(scope, receive))
        await response(scope, receive, send)

    async def go() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=asgi), base_url="http://cluster") as client:
            body = {"model": "SmolLM2-135M-Instruct", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                    **extra}
            return await client.post("/v1/completions", json=body, timeout=120)

    return asyncio.run(go())


def test_the_ingress_picks_the_prefill_replica_by_prefix(apps):
    """The ingress's PrefillPicker chooses a prefill replica per request; the choice reaches the
    decode replica's PrefillJob: a repeated prefix goes to the replica that computed it, a new
    one to the other, and the answers equal one server's."""
    from radixserve.cluster.affinity import AffinityConfig
    from radixserve.cluster.ingress import ClusterIngress, IngressOptions

    prefill_urls, decode_app, d, s, handle, _ = apps
    ingress = ClusterIngress(_DecodeHandle(decode_app), IngressOptions("pd-test", 3, prefill_affinity=AffinityConfig()),
                             prefill=handle)
    ingress.prefill_picker.set_replicas(prefill_urls)  # what the prefill router in the ingress tells it
    system = ids(80, 60)
    turns = [system + ids(30, 61), ids(90, 62), system + ids(40, 63), system + ids(20, 64) + ids(30, 65)]
    served = []
    for prompt in turns:
        jobs = len(handle.jobs)
        answer = via_ingress(ingress, prompt)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["text"] == complete(s, prompt, max_tokens=8)
        assert len(handle.jobs) == jobs + 1 and handle.jobs[-1].target_replica == handle.served[-1]
        served.append(handle.served[-1])
    assert served[0] != served[1]  # a new prefix: the replica without one
    assert served[2] == served[3] == served[0]  # the system prompt's replica, every time
    assert ingress.prefill_picker.reasons == {"new": 2, "prefix": 2}
    assert all(load == 0 for load in ingress.prefill_picker.policy.in_flight.values())  # each answered
    other = prefill_urls[served[1]]
    assert stats(other)["kv_exports"] == 1
    home = stats(prefill_urls[served[0]])
    assert home["cached_prompt_tokens"] >= 2 * 80 // BS * BS  # turns 3 and 4 hit the system prompt there
    check_integrity(*prefill_urls.values(), d)


def test_a_dead_chosen_prefill_replica_is_retried_on_any(apps):
    from radixserve.cluster.affinity import AffinityConfig
    from radixserve.cluster.ingress import ClusterIngress, IngressOptions

    prefill_urls, decode_app, d, s, handle, _ = apps
    ingress = ClusterIngress(_DecodeHandle(decode_app), IngressOptions("pd-test", 3, prefill_affinity=AffinityConfig()),
                             prefill=handle)
    ingress.prefill_picker.set_replicas(["prefill-1"])
    handle.die = 1
    prompt = ids(70, 70)
    answer = via_ingress(ingress, prompt)
    assert answer.json()["choices"][0]["text"] == complete(s, prompt, max_tokens=8)
    assert [j.target_replica for j in handle.jobs[-2:]] == ["prefill-1", None]  # the retry: wherever it can
    check_integrity(*prefill_urls.values(), d)


def test_a_prefill_replica_takes_prompt_chunks_as_large_as_a_step():
    """Chunking protects decodes; a prefill replica runs none, so its chunk is the step budget."""
    assert prefill_engine_kwargs({"chunked_prefill_size": 128, "num_threads": 1}) == {
        "chunked_prefill_size": 2048, "num_threads": 1}
    options = prefill_engine_kwargs({"chunked_prefill_size": 64, "max_num_batched_tokens": 512})
    assert options == {"chunked_prefill_size": 512, "max_num_batched_tokens": 512}
    EngineConfig(**options)  # a valid engine configuration (a chunk never exceeds the budget)


def test_a_prompt_is_exported_at_its_finish_not_after_the_next_prompts_step(apps):
    """The prefill side exports a prompt's blocks on the engine thread at the prompt's finish. An
    export queued as a later call ran after the engine's next step: behind a prompt waiting
    there, it waited for that prompt's whole prefill (seconds, on a prefill replica)."""
    prefill_urls, handle = apps[0], apps[4]
    async_engine = handle._engine("prefill-0")
    engine = async_engine.engine
    finished_at: dict[tuple[int, ...], int] = {}
    exported_at: list[int] = []
    step, export = engine.step, engine.kv_transfer.export

    def counting_step():
        outputs = step()
        finished_at.update({tuple(o.prompt_token_ids): engine.scheduler.stats.steps for o in outputs if o.finished})
        return outputs

    def recording_export(*args, **kwargs):
        exported_at.append(engine.scheduler.stats.steps)
        return export(*args, **kwargs)

    first, behind = ids(400, 31), ids(500, 32)  # one step each (the chunk is 512)
    greedy = SamplingParams(max_tokens=1, temperature=0)

    async def scenario():
        prefill = asyncio.ensure_future(run_prefill(async_engine, PrefillJob.of(first, greedy, None, 0)))
        await asyncio.sleep(0.2)  # the first prompt's step is running: the second waits for the next
        group = await async_engine.submit([GenerationInput(behind, greedy)])
        handoff = await prefill
        await group.results()
        assert await release(async_engine, handoff.handoff_id)
        return handoff

    engine.step, engine.kv_transfer.export = counting_step, recording_export
    try:
        handoff = asyncio.run(handle._on_server("prefill-0", scenario()))
    finally:
        engine.step, engine.kv_transfer.export = step, export
    assert finished_at[tuple(behind)] > finished_at[tuple(first)], "the second prompt ran in a later step"
    assert exported_at == [finished_at[tuple(first)]], (exported_at, finished_at)
    assert handoff.num_blocks == len(first) // BS and handoff.first_token is not None
    assert handoff.data.shape[0] == handoff.num_blocks and handoff.data.any(), "the bytes were copied"
    check_integrity(prefill_urls["prefill-0"])

"""NVIDIA Dynamo's own frontend (`python -m dynamo.frontend --router-mode kv`, file discovery,
loopback, the router flags radixserve.dynamo.worker recommends) in front of 2 radixserve
workers (`python -m radixserve.dynamo`), through the official openai client: the KV router
places every repeat of a prompt on the worker whose cache holds it (read from the workers' KV
events: with round robin half would miss), and a request sharing a prefix another request is
still prefilling with the worker computing it; a tenant's salt keeps its blocks apart, and
what the engine cannot honour comes back as an error naming it."""

from __future__ import annotations

import concurrent.futures
import os
import socket
import subprocess
import sys
import time
import uuid

import pytest

pytestmark = pytest.mark.slow  # three processes (about 10 s here)
pytest.importorskip("dynamo.llm", reason="scripts/setup.sh installs NVIDIA Dynamo (ai-dynamo 1.6.1)")
openai = pytest.importorskip("openai")
from radixserve.dynamo.worker import ROUTER_ARGS  # noqa: E402 - after the skip: it needs no Dynamo, but is for it

MODEL = "SmolLM2-135M-Instruct"
SYSTEMS = [f"You are agent {k} of a shipping company's support team. Answer in one short sentence, cite the "
           f"policy you rely on, and never invent facts. Policy {k}1: refunds within 30 days. Policy {k}2: "
           f"returns need a receipt. Question: " for k in range(3)]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait(predicate, timeout_s: float, what: str, procs) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for proc, log in procs:
            if proc.poll() is not None:
                pytest.fail(f"{what}: a process exited ({proc.returncode}): {log.read_text()[-3000:]}")
        if predicate():
            return
        time.sleep(0.5)
    pytest.fail(f"{what}: not ready in {timeout_s:.0f} s")


@pytest.fixture(scope="module")
def dynamo(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dynamo")
    namespace = f"rs{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "DYN_FILE_KV": str(tmp / "discovery"), "DYN_LOG": "info"}
    port, procs = _port(), []

    def start(name: str, args: list[str]):
        log = tmp / f"{name}.log"
        proc = subprocess.Popen([sys.executable, *args], env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)
        procs.append((proc, log))

    try:
        for i in range(2):
            start(f"worker{i}", ["-m", "radixserve.dynamo", "--num-kv-blocks", "96",
                                 "--endpoint", f"dyn://{namespace}.backend.generate"])
        start("frontend", ["-m", "dynamo.frontend", "--router-mode", "kv", "--discovery-backend", "file",
                           "--http-host", "127.0.0.1", "--http-port", str(port), "--namespace", namespace,
                           *ROUTER_ARGS])
        _wait(lambda: all("serves" in log.read_text() for _, log in procs[:2]), 120, "workers", procs)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)

        def listed() -> bool:
            try:
                return [m.id for m in client.models.list().data] == [MODEL]
            except openai.APIError:
                return False

        _wait(listed, 60, "frontend", procs)
        frontend_log = procs[2][1]
        # the frontend keeps the first card's workers and rejects a worker whose card differs
        assert "Rejected incompatible workers" not in frontend_log.read_text()
        client.frontend_log = frontend_log
        yield client
    finally:
        for proc, _ in procs:
            proc.terminate()
        for proc, _ in procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()


def _ask(client, prompt: str, **extra):
    reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0.0,
                                      extra_body={"nvext": {"extra_fields": ["worker_id"]}, **extra})
    return reply, reply.nvext["worker_id"]["decode_worker_id"] if getattr(reply, "nvext", None) else None


def test_the_kv_router_places_each_repeat_where_its_prefix_is_cached(dynamo):
    firsts, texts = {}, {}
    for round_ in range(3):
        for k, system in enumerate(SYSTEMS):
            reply, worker = _ask(dynamo, system + "where is my parcel?")
            cached = reply.usage.prompt_tokens_details.cached_tokens
            assert worker is not None, "the frontend names the worker (nvext.extra_fields)"
            if round_ == 0:
                firsts[k], texts[k] = worker, reply.choices[0].text
                assert cached == 0
            else:
                assert worker == firsts[k], f"prompt {k} round {round_}: routed away from its cached prefix"
                assert cached >= 16 * ((reply.usage.prompt_tokens - 1) // 16) - 16, (cached, reply.usage)
                assert reply.choices[0].text == texts[k]
    assert "Rejected incompatible workers" not in dynamo.frontend_log.read_text(), "both workers serve the model"


def test_a_request_sharing_a_prefix_in_prefill_follows_it(dynamo):
    """Two agents with one long system prompt start together: the second is routed while the
    first still prefills it (no KV event names it yet, and its worker has the whole first
    prompt queued), to the same worker, which makes it wait for the prefix and reuse it.
    With Dynamo's default cost the idle worker wins and computes the prefix again."""
    system = "".join(f"Policy {k}: parcels of class {k} ship within {k + 2} days, insured to {k * 50} euros. "
                     for k in range(32))  # about 850 tokens: its prefill outlasts the 0.1 s between the two
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        first = pool.submit(_ask, dynamo, system + "Question: where is my parcel?")
        time.sleep(0.1)
        second = pool.submit(_ask, dynamo, system + "Question: can I insure a bike?")
        (a, worker_a), (b, worker_b) = first.result(timeout=120), second.result(timeout=120)
    assert worker_a == worker_b, "the second went to the other worker, which computed the prefix again"
    shared = 16 * ((a.usage.prompt_tokens - 16) // 16)  # the system prompt's whole blocks (its last one spared)
    assert b.usage.prompt_tokens_details.cached_tokens >= shared, (a.usage, b.usage)


def test_a_tenants_salt_keeps_its_blocks_apart(dynamo):
    prompt = SYSTEMS[0] + "can I return shoes?"
    _ask(dynamo, prompt)
    salted, _ = _ask(dynamo, prompt, nvext={"cache_salt": "tenant-b", "extra_fields": ["worker_id"]})
    assert salted.usage.prompt_tokens_details.cached_tokens == 0, "another tenant's blocks were shared"
    again, _ = _ask(dynamo, prompt, nvext={"cache_salt": "tenant-b", "extra_fields": ["worker_id"]})
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_what_the_engine_cannot_honour_is_an_error_naming_it(dynamo):
    """best_of reaches the worker (the frontend itself refuses what it cannot carry, e.g.
    use_beam_search or prompt_cache_key, with a 400 of its own)."""
    with pytest.raises(openai.BadRequestError, match="sampling_options.best_of"):
        _ask(dynamo, SYSTEMS[1] + "hello", best_of=2)
    with pytest.raises(openai.BadRequestError, match="use_beam_search"):
        _ask(dynamo, SYSTEMS[1] + "hello", use_beam_search=True)
    with pytest.raises(openai.BadRequestError, match="prompt_cache_key"):  # the frontend's own 400
        _ask(dynamo, SYSTEMS[1] + "hello", prompt_cache_key="agent-7")
    reply, _ = _ask(dynamo, SYSTEMS[1] + "hello")  # the workers serve on
    assert reply.usage.completion_tokens == 4

"""radixserve.lang: `program.run(session_id=...)` carries the session to the engine (in
process and over HTTP), so an agent written as a program keeps its context cached."""

from __future__ import annotations

import radixserve.lang as rl
from radixserve import Engine
from radixserve.server import create_app
from radixserve.server.options import ServerOptions
from radixserve.server.testing import BackgroundServer


@rl.function
def agent_turn(s, task):
    s += task
    s += rl.gen("answer", max_tokens=3, temperature=0)


class SmallTokenizer:
    """Characters to token ids of the tiny model's vocabulary (it ships no tokenizer)."""

    bos_token = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % 90 + 3 for c in text]


class TinyRuntime(rl.Runtime):
    @property
    def tokenizer(self):
        return SmallTokenizer()


def _tiny_engine(tiny_model_dir):
    return Engine(str(tiny_model_dir("llama")), num_kv_blocks=32)


def test_run_with_a_session_id_opens_the_session_in_process(tiny_model_dir):
    engine = _tiny_engine(tiny_model_dir)
    backend = TinyRuntime(engine=engine)
    try:
        agent_turn.run("abc " * 20, backend=backend, session_id="prog-1")
        agent_turn.run("xyz " * 20, backend=backend)  # no session
        stats = backend.stats()
        assert stats["sessions_open"] == 1 and stats["generated_tokens"] == 6
    finally:
        backend.shutdown()
    engine.check_integrity()
    assert engine.close_session("prog-1")


def test_run_with_a_session_id_over_http(tiny_model_dir):
    engine = _tiny_engine(tiny_model_dir)
    app = create_app(engine, ServerOptions(enable_debug_endpoints=True))
    with BackgroundServer(app) as server:
        endpoint = rl.Endpoint(server.url, tokenizer=SmallTokenizer())
        agent_turn.run("abc " * 20, backend=endpoint, session_id="prog-2")
        import httpx

        assert httpx.get(server.url + "/debug/stats").json()["sessions_open"] == 1
        assert httpx.post(server.url + "/v1/sessions/prog-2/close").status_code == 200

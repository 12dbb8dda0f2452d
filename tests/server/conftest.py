"""Fixtures the server tests share: the app on the shared real engine, served in a thread."""

from __future__ import annotations

import httpx
import openai
import pytest

from radixserve.server import ServerOptions, create_app
from radixserve.server.testing import BackgroundServer


@pytest.fixture(scope="module")
def server_options() -> ServerOptions:
    """What `server` serves with; a test module overrides it for other options."""
    return ServerOptions(enable_debug_endpoints=True)


@pytest.fixture(scope="module")
def server(served_engine, server_options):
    """The app on the shared real engine (cache flushed first); afterwards the engine must be
    idle and intact, and its cache is flushed again."""
    served_engine.flush_cache()
    with BackgroundServer(create_app(served_engine, server_options)) as running:
        yield running
    served_engine.check_integrity()
    assert not served_engine.has_unfinished_requests()
    served_engine.flush_cache()


@pytest.fixture
def client(server):
    """An OpenAI client of `server`; after each test nothing may still run or wait."""
    yield openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=300)
    stats = httpx.post(server.url + "/debug/check_integrity", timeout=60).json()["stats"]
    assert stats["running"] == 0 and stats["waiting"] == 0


@pytest.fixture(scope="module")
def engine(served_engine):
    """The server tests' shared engine, flushed before and after a module, checked idle and intact after."""
    served_engine.flush_cache()
    yield served_engine
    served_engine.check_integrity()
    assert not served_engine.has_unfinished_requests()
    served_engine.flush_cache()


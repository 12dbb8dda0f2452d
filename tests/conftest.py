"""Shared fixtures (tiny random checkpoints, the real default model) and the `serial` rule under xdist."""

from __future__ import annotations

import os

import pytest

from tiny_models import build_tiny_model
from xdist_rules import pytest_runtest_protocol, pytest_xdist_make_scheduler  # noqa: F401

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


@pytest.fixture(scope="session", autouse=True)
def _one_ssl_context_for_every_client():
    """httpx's module-level calls (httpx.post, get, stream) and every new openai or anthropic
    client build a transport, which parses the CA bundle into a fresh SSL context (~30 ms, a
    tenth of the server tests' CPU time): with default settings they share one here. No test
    connects over TLS; the context is the one httpx would build."""
    import httpx._transports.default as transports

    build = transports.create_ssl_context
    shared = build()

    def create_ssl_context(verify=True, cert=None, trust_env=True):
        if verify is True and cert is None and trust_env:
            return shared
        return build(verify=verify, cert=cert, trust_env=trust_env)

    transports.create_ssl_context = create_ssl_context
    yield
    transports.create_ssl_context = build


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A directory factory: tiny_model_dir('llama') -> path of a saved tiny random model."""
    built: dict[str, object] = {}

    def make(kind: str = "llama"):
        if kind not in built:
            built[kind] = build_tiny_model(kind, tmp_path_factory.mktemp(kind))
        return built[kind]

    return make


@pytest.fixture(scope="session")
def real_model_dir():
    """The default SmolLM2 model, converted by the project's own setup (scripts/setup.sh)."""
    from radixserve.model.default_model import ensure_default_model

    try:
        return ensure_default_model()
    except FileNotFoundError as exc:  # pragma: no cover - setup.sh installs the package
        pytest.fail(f"default model unavailable: {exc}")


@pytest.fixture(scope="session")
def hf_real_model(real_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(real_model_dir, dtype=torch.float32)


@pytest.fixture(scope="session")
def real_engine(real_model_dir):
    """One shared engine on the default model (tests must leave it idle and intact)."""
    from radixserve import Engine

    return Engine(str(real_model_dir))


@pytest.fixture(scope="session")
def served_engine(real_model_dir):
    """One shared engine on the default model as `radixserve serve` runs it: its Q4_1 file's
    weights as stored (the server tests' engine; tests must leave it idle and intact)."""
    from radixserve import Engine

    return Engine()


@pytest.fixture(autouse=True)
def _kv_cache_dtype_from_env(monkeypatch):
    """RADIXSERVE_TEST_KV_CACHE_DTYPE=int8 (or fp8_e4m3: on CPU through the torch backend) runs
    every engine a test builds on quantized KV pages (unless the test names a kv_cache_dtype
    itself): the whole engine suite over quantized pages, on demand, without doubling every run."""
    dtype = os.environ.get("RADIXSERVE_TEST_KV_CACHE_DTYPE")
    if not dtype:
        return
    from radixserve.engine.engine import Engine

    original = Engine.__init__

    def init(self, model=None, **options):
        options.setdefault("kv_cache_dtype", dtype)
        if options["kv_cache_dtype"] == "fp8_e4m3" and options.get("device", "cpu") == "cpu":
            options.setdefault("attention_backend", "torch")  # the one CPU path that reads fp8 pages
        original(self, model, **options)

    monkeypatch.setattr(Engine, "__init__", init)

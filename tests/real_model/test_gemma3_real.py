"""Gemma 3 270M (sliding-window layers) against transformers, token for token (greedy), on
prompts longer than two of its 512-token windows and on follow-ups whose cached prefix is
longer than a window (the hit must be exact, not recomputed)."""

from __future__ import annotations

import inspect
import json.decoder
import textwrap

import pytest
import torch

from greedy_reference import transformers_greedy
from radixserve import Engine, SamplingParams
from real_prompts import RAW

pytestmark = [pytest.mark.real_model, pytest.mark.slow]

MAX_NEW = 12
GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0)
WINDOW = 512


@pytest.fixture(scope="module")
def gemma_dir():
    """The packaged Gemma 3 270M, converted to float32 by scripts/setup.sh (radixserve prepare)."""
    from radixserve.model.loader import resolve_model_path

    try:
        return resolve_model_path("gemma3-270m", float_weights=True)
    except FileNotFoundError as exc:  # pragma: no cover - setup.sh installs the package
        pytest.fail(f"Gemma 3 270M unavailable: {exc}")


@pytest.fixture(scope="module")
def hf_gemma(gemma_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(gemma_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine(gemma_dir):
    return Engine(str(gemma_dir), max_model_len=4096, num_kv_blocks=1024)


def _long_texts() -> list[str]:
    """Real text, three of 1,050-1,300 tokens and one of ~500: standard library source and its docstrings."""
    sources = [inspect.getsource(json.decoder), inspect.getsource(textwrap)]
    return [sources[0][:4400], sources[1][:4600], sources[1][6400:10400], sources[0][5200:7200]]


@pytest.fixture(scope="module")
def prompts(engine):
    return [engine.tokenizer.encode(text) for text in RAW + _long_texts()]


def _idle_and_intact(engine):
    engine.check_integrity()
    assert not engine.has_unfinished_requests()


def test_prompts_span_several_windows(prompts):
    lengths = sorted(len(p) for p in prompts)
    assert len(prompts) == 8 and lengths[0] < 10
    assert sum(n > 2 * WINDOW for n in lengths) >= 3, lengths


def test_greedy_equals_transformers(engine, hf_gemma, prompts):
    outs = engine.generate(prompts, GREEDY)
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == transformers_greedy(hf_gemma, prompt, MAX_NEW, engine.eos_token_ids, out.token_ids), \
            len(prompt)
    _idle_and_intact(engine)


def test_a_follow_up_past_the_window_hits_the_cache_exactly(engine, hf_gemma, prompts):
    """The second turn reuses the whole cached first turn (far longer than a window), and
    continues exactly as transformers does from scratch."""
    first = prompts[5]
    out = engine.generate([first], GREEDY)[0]
    follow = first + out.token_ids + engine.tokenizer.encode("\n# And then:", add_special_tokens=False)
    second = engine.generate([follow], GREEDY)[0]
    block = engine.config.block_size
    assert second.cached_tokens >= (len(first) + len(out.token_ids) - 1) // block * block > 2 * WINDOW
    assert second.token_ids == transformers_greedy(hf_gemma, follow, MAX_NEW, engine.eos_token_ids, second.token_ids)
    _idle_and_intact(engine)


def test_the_gguf_read_as_it_is_equals_transformers_conversion(gemma_dir):
    """Every tensor of the Q4_K_M file as radixserve reads it (gemma3's names; norms as the
    file stores them, 1 + w, which the model holds) equals transformers' float32 conversion bit
    for bit (transformers subtracts the 1 in float32)."""
    from safetensors.torch import load_file

    from radixserve.model.gguf_file import read_weights
    from radixserve.model.packaged_models import packaged_gguf

    converted = load_file(str(gemma_dir / "model.safetensors"))
    read = read_weights(packaged_gguf("gemma3-270m"), quantized=True)
    assert set(read) == set(converted)
    assert {w.kind for w in read.values() if not isinstance(w, torch.Tensor)} == {"Q4_K", "Q5_0", "Q6_K", "Q8_0"}
    for name, want in converted.items():
        got = read[name]
        got = got if isinstance(got, torch.Tensor) else got.dequantize()
        assert torch.equal(got - 1.0 if name.endswith("norm.weight") else got, want), name


def test_the_packaged_name_serves_the_quantized_file(gemma_dir):
    engine = Engine("gemma3-270m")
    assert set(engine.stats()["weight_dtype"].removeprefix("gguf:").split("+")) == {"Q4_K", "Q5_0", "Q6_K", "Q8_0"}
    out = engine.generate([engine.tokenizer.encode("The capital of France is")], GREEDY)[0]
    assert engine.tokenizer.decode(out.token_ids).startswith(" the capital of the country of France")
    _idle_and_intact(engine)

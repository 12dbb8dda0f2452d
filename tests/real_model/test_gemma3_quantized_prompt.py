"""Gemma 3 270M from its Q4_K_M file (Q4_K, Q5_0, Q6_K, Q8_0 weights, in the lanes layout):
prompt chunks past the skinny kernel's rows multiplied by the integer kernel
(quantized_prompt_matmul integer, the default: the activations rounded to ~16 bits, as every
decode row's are) against the same weights dequantized and multiplied in float32: the same
greedy answers, and the same top-1 next token at (nearly) every prompt position, with
log-probabilities within the activations' rounding."""

from __future__ import annotations

import inspect
import json.decoder
import textwrap

import pytest

from radixserve import Engine, SamplingParams
from radixserve.kernels.quant_linear import lanes_preferred

pytestmark = [pytest.mark.real_model, pytest.mark.slow,
              pytest.mark.skipif(not lanes_preferred(), reason="the integer prompt kernel is AVX512-VNNI only")]


def _texts() -> list[str]:
    return [inspect.getsource(json.decoder)[:4400], inspect.getsource(textwrap)[6400:10400]]


@pytest.fixture(scope="module")
def engines():
    integer = Engine("gemma3-270m", max_model_len=4096, num_kv_blocks=512, enable_prefix_cache=False)
    floats = Engine("gemma3-270m", max_model_len=4096, num_kv_blocks=512, enable_prefix_cache=False,
                    quantized_prompt_matmul="float32")
    return integer, floats


def test_integer_prompt_matmuls_keep_the_answers_and_next_token_distributions(engines, monkeypatch):
    from radixserve.model import layers

    integer, floats = engines
    prompts = [integer.tokenizer.encode(t) for t in _texts()]
    assert all(len(p) > 1000 for p in prompts)
    calls = []
    kernel = layers.quant_linear
    monkeypatch.setattr(layers, "quant_linear", lambda *a: calls.append(a[0].shape[0]) or kernel(*a))
    params = SamplingParams(max_tokens=12, temperature=0.0, prompt_logprobs=1)
    got = integer.generate(prompts, params)
    assert calls and max(calls) > layers.max_rows()  # the integer kernel ran on prompt-sized chunks
    calls.clear()
    want = floats.generate(prompts, params)
    assert all(rows <= layers.max_rows() for rows in calls)  # switched off: decode-sized products only
    agree = positions = 0
    worst = 0.0
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        for a, b in zip(g.prompt_logprobs[1:], w.prompt_logprobs[1:]):
            agree += a.top[0][0] == b.top[0][0]
            positions += 1
            worst = max(worst, abs(a.logprob - b.logprob))
    assert agree / positions >= 0.995, f"top-1 agreement {agree / positions:.4f} over {positions} positions"
    assert worst < 0.1, f"largest log-probability difference {worst:.4f}"
    integer.check_integrity()

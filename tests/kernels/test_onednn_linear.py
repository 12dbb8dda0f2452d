"""onednn_linear: float32 matmuls on oneDNN agree with F.linear, give each row the same bits
however many rows share the call, refuse what they do not cover, and the model routes its
large matmuls through them unless told not to."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import radixserve.model.llama as llama
from radixserve import Engine, SamplingParams
from radixserve.kernels.onednn_linear import available, onednn_linear

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@needs_onednn
def test_available_where_torch_has_onednn():
    """A changed op signature or a disagreeing result turns it off quietly in the engine
    (MKL takes over); here it fails."""
    assert available()


@needs_onednn
@torch.inference_mode()
@pytest.mark.parametrize("rows,inputs,outputs", [(1, 64, 48), (129, 576, 960), (300, 1536, 576), (512, 72, 3000)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_agrees_with_f_linear(rows, inputs, outputs, with_bias):
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, inputs, generator=generator)
    weight = torch.randn(outputs, inputs, generator=generator) * inputs**-0.5
    bias = torch.randn(outputs, generator=generator) if with_bias else None
    out = onednn_linear(x, weight, bias)
    assert out.shape == (rows, outputs) and out.dtype == torch.float32
    torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


@needs_onednn
@torch.inference_mode()
def test_a_rows_result_does_not_depend_on_the_other_rows():
    """Among calls that run on oneDNN, a prompt's rows get the same numbers however it is
    chunked; a single row takes another kernel in oneDNN (and the skinny kernel in the model)."""
    generator = torch.Generator().manual_seed(1)
    for inputs, outputs in [(576, 1536), (1536, 576)]:  # gate_up's and down's shapes
        x = torch.randn(400, inputs, generator=generator)
        weight = torch.randn(outputs, inputs, generator=generator)
        whole = onednn_linear(x, weight, None)
        for start, stop in [(0, 2), (0, 37), (37, 200), (200, 400), (398, 400)]:
            assert torch.equal(onednn_linear(x[start:stop], weight, None), whole[start:stop])


@needs_onednn
@torch.inference_mode()
def test_takes_a_strided_input():
    generator = torch.Generator().manual_seed(2)
    x = torch.randn(96, 300, generator=generator).t()  # [300, 96], column-major
    weight = torch.randn(40, 96, generator=generator)
    torch.testing.assert_close(onednn_linear(x, weight, None), F.linear(x, weight), rtol=1e-5, atol=1e-5)


def test_refuses_what_it_does_not_cover():
    x, weight = torch.randn(4, 8), torch.randn(6, 8)
    with torch.inference_mode():
        assert onednn_linear(x.double(), weight.double(), None) is None
        assert onednn_linear(x.reshape(2, 2, 8), weight, None) is None
        assert onednn_linear(x[:0], weight, None) is None
        assert onednn_linear(x, weight.t().contiguous().t(), None) is None  # not a dense [out, in]
        assert onednn_linear(x, torch.randn(6, 16), None) is None  # inner sizes differ
        assert onednn_linear(x, weight.reshape(2, 3, 8), None) is None
        assert onednn_linear(x, weight, torch.randn(5)) is None  # bias of the wrong size
        assert onednn_linear(x, weight, torch.randn(1)) is None  # broadcast bias: F.linear's job
        assert onednn_linear(x, weight, torch.randn(6).double()) is None
    assert onednn_linear(x, weight, None) is None  # autograd on: the op has no backward


@needs_onednn
@pytest.mark.filterwarnings("ignore:TF32 acceleration")  # flags() also sets tf32, for Intel GPUs
@torch.inference_mode()
def test_steps_aside_when_onednn_is_off_or_lowers_float32_precision():
    x, weight = torch.randn(4, 8), torch.randn(6, 8)
    assert onednn_linear(x, weight, None) is not None
    with torch.backends.mkldnn.flags(enabled=False):
        assert onednn_linear(x, weight, None) is None
    matmul = torch.backends.mkldnn.matmul
    before = matmul.fp32_precision
    try:
        matmul.fp32_precision = "bf16"
        assert onednn_linear(x, weight, None) is None
    finally:
        matmul.fp32_precision = before
    assert onednn_linear(x, weight, None) is not None


def _counting(monkeypatch) -> list[int]:
    rows: list[int] = []

    def counted(x, weight, bias):
        out = onednn_linear(x, weight, bias)
        if out is not None:
            rows.append(x.shape[0])
        return out

    monkeypatch.setattr(llama, "onednn_linear", counted)
    return rows


@needs_onednn
def test_the_model_runs_large_steps_on_onednn_unless_told_not_to(tiny_model_dir, monkeypatch):
    path = str(tiny_model_dir("llama"))
    prompt = [3 + i % 90 for i in range(200)]  # one 200-token step: past the skinny kernel
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    results = {}
    for on in (True, False):
        engine = Engine(path, onednn_linear=on)
        rows = _counting(monkeypatch)
        results[on] = engine.generate([prompt], params)[0]
        layers = len(engine.runner.model.layers)
        # qkv, o, gate_up, down per layer on the prompt's rows, and the prompt-logprob head
        assert rows.count(200) == (4 * layers + 1 if on else 0)
        engine.check_integrity()
    assert results[True].token_ids == results[False].token_ids
    ours, theirs = results[True].prompt_logprobs[1:], results[False].prompt_logprobs[1:]
    assert len(ours) == len(prompt) - 1
    for a, b in zip(ours, theirs):
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4

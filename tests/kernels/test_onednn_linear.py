"""onednn_linear: float32 matmuls on oneDNN agree with F.linear, give each row the same bits
however many rows share the call, refuse what they do not cover, and the model routes its
large matmuls through them unless told not to. onednn_linear_bf16: the same on bf16 inputs
(prefill_matmul_dtype="bfloat16"), within bf16's rounding of the exact product."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import radixserve.model.causal_lm as causal_lm
import radixserve.model.layers as model_layers
from radixserve import Engine, SamplingParams
from radixserve.config import EngineConfig
from radixserve.kernels.onednn_linear import available, bf16_available, onednn_linear, onednn_linear_bf16, row_bucket

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")
needs_bf16 = pytest.mark.skipif(not bf16_available(), reason="no native bf16 matmuls in oneDNN on this CPU")


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


def test_row_buckets_are_few_and_waste_little():
    """oneDNN keeps a primitive (~0.5 MiB) per distinct shape, so row counts are bucketed:
    exact up to 32 rows, then at most 31 buckets up to 2,048 rows, < 1/4 extra rows past 128
    and < 1/8 past 256."""
    assert [row_bucket(m) for m in range(1, 33)] == list(range(1, 33))
    buckets = {row_bucket(m) for m in range(33, 2049)}
    assert len(buckets) == 31 and max(buckets) == 2048
    for m in range(33, 2049):
        assert m <= row_bucket(m) and row_bucket(row_bucket(m)) == row_bucket(m)
        assert row_bucket(m) / m < (1.25 if m > 128 else 2.0) and (m <= 256 or row_bucket(m) / m < 1.125)


@needs_onednn
@torch.inference_mode()
@pytest.mark.parametrize("bf16", [False, True])
def test_products_run_at_bucketed_rows_with_every_rows_bits_kept(bf16, monkeypatch):
    """Row counts reach oneDNN only as buckets (tiles of 2,048 past it), and from two rows up
    each row gets exactly the bits of the same rows multiplied unpadded (one row takes another
    kernel in oneDNN)."""
    if bf16 and not bf16_available():
        pytest.skip("no native bf16 matmuls in oneDNN on this CPU")
    op = torch.ops.mkldnn._linear_pointwise
    seen: set[int] = set()
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda x, *rest: (seen.add(x.shape[0]), op(x, *rest))[1])
    generator = torch.Generator().manual_seed(4)
    x = torch.randn(4500, 64, generator=generator)
    weight, bias = torch.randn(48, 64, generator=generator), torch.randn(48, generator=generator)
    product = (lambda rows: onednn_linear_bf16(rows, weight.to(torch.bfloat16), bias)) if bf16 else \
        (lambda rows: onednn_linear(rows, weight, bias))
    whole = op(x.to(torch.bfloat16) if bf16 else x, weight.to(torch.bfloat16) if bf16 else weight,
               None if bf16 else bias, "none", [], "")
    whole = whole.float() + bias if bf16 else whole
    torch.testing.assert_close(product(x[:1]), whole[:1], rtol=1e-5, atol=1e-5)
    for rows in [2, 31, 33, 129, 200, 257, 700, 1500, 2048, 2049, 4500]:
        out = product(x[:rows])
        assert out.shape == (rows, 48) and torch.equal(out, whole[:rows]), rows
    assert seen <= {1, 2, 31, 4500} | {row_bucket(m) for m in range(33, 2049)}
    assert 4500 not in seen and {64, 224, 2048} <= seen


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


def _counting(monkeypatch, name: str = "onednn_linear") -> list[int]:
    """Record the rows of every call of the model's `name` (onednn_linear or _bf16) that ran."""
    rows: list[int] = []
    product = getattr(model_layers, name)

    def counted(x, weight, bias):
        out = product(x, weight, bias)
        if out is not None:
            rows.append(x.shape[0])
        return out

    monkeypatch.setattr(model_layers, name, counted)
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


# ---- bf16 inputs (prefill_matmul_dtype="bfloat16") --------------------------------------------


@needs_bf16
@torch.inference_mode()
@pytest.mark.parametrize("rows,inputs,outputs", [(33, 64, 48), (300, 576, 960), (129, 1536, 576)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_is_the_exact_product_of_the_rounded_inputs_rounded_to_bf16(rows, inputs, outputs, with_bias):
    """Within one bf16 rounding (2^-8 relative) of the float64 product of the bf16-rounded
    rows and weight, the bias added after in float32; and not the float32 product (which
    a silent fallback would return)."""
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, inputs, generator=generator)
    weight = torch.randn(outputs, inputs, generator=generator) * inputs**-0.5
    bias = torch.randn(outputs, generator=generator) if with_bias else None
    weight_bf16 = weight.to(torch.bfloat16)
    out = onednn_linear_bf16(x, weight_bf16, bias)
    assert out.shape == (rows, outputs) and out.dtype == torch.float32
    product = F.linear(x.to(torch.bfloat16).double(), weight_bf16.double())
    error = (out.double() - (product if bias is None else product + bias.double())).abs()
    assert bool((error <= product.abs() * 2**-8 + 1e-4).all()), float(error.max())
    assert not torch.allclose(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


@needs_bf16
@torch.inference_mode()
def test_bf16_takes_a_strided_input_and_each_row_alone():
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(96, 300, generator=generator).t()  # [300, 96], column-major
    weight_bf16 = torch.randn(40, 96, generator=generator).to(torch.bfloat16)
    whole = onednn_linear_bf16(x, weight_bf16, None)
    assert torch.equal(whole, onednn_linear_bf16(x.contiguous(), weight_bf16, None))
    for start, stop in [(0, 2), (2, 150), (150, 300)]:
        assert torch.equal(onednn_linear_bf16(x[start:stop].contiguous(), weight_bf16, None), whole[start:stop])


@pytest.mark.filterwarnings("ignore:TF32 acceleration")  # flags() also sets tf32, for Intel GPUs
def test_bf16_refuses_what_it_does_not_cover():
    x, weight_bf16 = torch.randn(4, 8), torch.randn(6, 8).to(torch.bfloat16)
    with torch.inference_mode():
        assert onednn_linear_bf16(x, weight_bf16.float(), None) is None  # a float32 weight: onednn_linear's
        assert onednn_linear_bf16(x.to(torch.bfloat16), weight_bf16, None) is None
        assert onednn_linear_bf16(x, torch.randn(6, 16).to(torch.bfloat16), None) is None
        assert onednn_linear_bf16(x, weight_bf16, torch.randn(5)) is None
        assert onednn_linear_bf16(x[:0], weight_bf16, None) is None
        with torch.backends.mkldnn.flags(enabled=False):
            assert onednn_linear_bf16(x, weight_bf16, None) is None
    assert onednn_linear_bf16(x, weight_bf16, None) is None  # autograd on


@needs_bf16
def test_the_model_runs_large_steps_on_bf16_weights_when_asked(tiny_model_dir, monkeypatch):
    """The layers' four matmuls of a 200-token prompt step run on bf16 inputs; the decode
    steps (skinny kernel) and the prompt-logprob head stay float32; the tokens, cache hits
    and prompt logprobs stay those of float32 within bf16's rounding; off drops the copies."""
    path = str(tiny_model_dir("llama"))
    prompt = [3 + i % 90 for i in range(200)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, prompt_logprobs=0)
    results = {}
    for dtype in ("float32", "bfloat16"):
        engine = Engine(path, prefill_matmul_dtype=dtype)
        bf16_rows, f32_rows = _counting(monkeypatch, "onednn_linear_bf16"), _counting(monkeypatch)
        extend = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)  # no prompt logprobs: it hits
        results[dtype] = engine.generate([prompt], params)[0], engine.generate([prompt[:80] + [7] * 150], extend)[0]
        layers = len(engine.runner.model.layers)
        bf16 = dtype == "bfloat16"
        assert bf16_rows.count(200) == (4 * layers if bf16 else 0)
        assert f32_rows.count(200) == (1 if bf16 else 4 * layers + 1)  # the prompt-logprob head stays float32
        assert bf16_rows.count(150) == (4 * layers if bf16 else 0)  # the extend past the 80 cached tokens
        engine.check_integrity()
        linears = [m for m in engine.runner.model.layers.modules() if isinstance(m, model_layers.Linear)]
        assert engine.runner.model.lm_head.weight_bf16 is None  # the logits stay float32
        assert len(linears) == 4 * layers and all((m.weight_bf16 is not None) == bf16 for m in linears)
        engine.runner.model.use_bf16_matmuls(False)
        assert all(m.weight_bf16 is None for m in linears)
    for ours, theirs in zip(results["bfloat16"], results["float32"]):
        assert ours.token_ids == theirs.token_ids and ours.cached_tokens == theirs.cached_tokens
    ours, theirs = results["bfloat16"][0].prompt_logprobs[1:], results["float32"][0].prompt_logprobs[1:]
    differences = [abs(a.logprob - b.logprob) for a, b in zip(ours, theirs)]
    # bf16's rounding moves this random model's prompt logprobs by 0.116 nats on average (max
    # ~0.8 on the least likely tokens); weights 10% off move them by 0.38. The products' own
    # precision is tested above, against the exact product of the rounded inputs.
    assert sum(differences) / len(differences) < 0.25 and all(a.token_id == b.token_id for a, b in zip(ours, theirs))
    assert [o.cached_tokens for o in results["bfloat16"]] == [0, 80]  # the shared 80 tokens: 5 whole blocks


def test_bf16_matmuls_are_refused_where_they_would_not_run(tiny_model_dir, monkeypatch):
    with pytest.raises(ValueError, match="prefill_matmul_dtype must be one of float32, bfloat16"):
        EngineConfig(prefill_matmul_dtype="float16")
    for options in ({"onednn_linear": False}, {"dtype": "bfloat16"}, {"device": "cuda"}):
        with pytest.raises(ValueError, match="oneDNN's matmuls of a float32 model on CPU"):
            EngineConfig(prefill_matmul_dtype="bfloat16", **options)
    monkeypatch.setattr(causal_lm, "bf16_available", lambda: False)  # a CPU without native bf16
    with pytest.raises(ValueError, match="AVX512_BF16 or AMX"):
        Engine(str(tiny_model_dir("llama")), prefill_matmul_dtype="bfloat16", num_kv_blocks=64)


@needs_bf16
def test_decode_rows_sharing_a_step_with_a_prompt_stay_float32(tiny_model_dir, monkeypatch):
    """A request decodes while a 200-token prompt arrives: in their shared steps the decode's
    row is multiplied again in float32 over the bf16 product, so its logprobs are float32's
    (to float32's own rounding: its row goes to the skinny kernel instead of oneDNN), not bf16's."""
    path = str(tiny_model_dir("llama"))
    decoding = [5 + i % 80 for i in range(20)]
    arriving = [3 + i % 90 for i in range(200)]
    logprobs = {}
    for dtype in ("float32", "bfloat16"):
        engine = Engine(path, prefill_matmul_dtype=dtype)
        bf16_rows = _counting(monkeypatch, "onednn_linear_bf16")
        first = engine.add_request(decoding, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                            logprobs=0))
        outputs = engine.step() + engine.step()  # its prompt, then a decode of its own
        engine.add_request(arriving, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        while engine.has_unfinished_requests():
            outputs += engine.step()
        final = [o for o in outputs if o.request_id == first and o.finished][0]
        logprobs[dtype] = [entry.logprob for entry in final.logprobs]
        assert set(bf16_rows) == ({201} if dtype == "bfloat16" else set())  # the prompt with the decode
        engine.check_integrity()
    assert len(logprobs["bfloat16"]) == 12
    assert max(abs(a - b) for a, b in zip(logprobs["bfloat16"], logprobs["float32"])) < 1e-4

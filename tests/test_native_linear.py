"""The C skinny matmul (decode-sized x @ weight.T on CPU) against a float64 reference,
on every tile edge, and the cases it must hand back to torch."""

from __future__ import annotations

import pytest
import torch

from radixserve.model import native_linear
from radixserve.model.llama import linear
from radixserve.model.native_linear import MAX_ROWS, skinny_linear

needs_kernel = pytest.mark.skipif(native_linear._kernel() is None, reason="no C compiler here")


def _reference(x, weight, bias):
    out = x.double() @ weight.double().t()
    return (out if bias is None else out + bias.double()).float()


@needs_kernel
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 31, MAX_ROWS])
@pytest.mark.parametrize("features, k", [(1, 8), (2, 64), (3, 16), (7, 576), (48, 136)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_skinny_linear_matches_float64(rows, features, k, with_bias):
    gen = torch.Generator().manual_seed(rows * 1000 + features * 10 + k)
    x = torch.randn(rows, k, generator=gen)
    weight = torch.randn(features, k, generator=gen)
    bias = torch.randn(features, generator=gen) if with_bias else None
    got = skinny_linear(x, weight, bias)
    assert got is not None and got.shape == (rows, features)
    torch.testing.assert_close(got, _reference(x, weight, bias), atol=1e-4, rtol=1e-5)


@needs_kernel
def test_skinny_linear_reads_strided_rows():
    gen = torch.Generator().manual_seed(7)
    wide = torch.randn(9, 96, generator=gen)
    x = wide[:, 16:80]  # rows 96 floats apart
    weight = torch.randn(10, 64, generator=gen)
    torch.testing.assert_close(skinny_linear(x, weight, None), _reference(x, weight, None), atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize(
    "x, weight",
    [
        (torch.randn(MAX_ROWS + 1, 64), torch.randn(5, 64)),  # too many rows: the BLAS wins
        (torch.randn(4, 60), torch.randn(5, 60)),  # K not a multiple of 8
        (torch.randn(4, 64, dtype=torch.float64), torch.randn(5, 64, dtype=torch.float64)),
        (torch.randn(4, 64), torch.randn(64, 5).t()),  # weight not contiguous
        (torch.randn(64, 4).t(), torch.randn(5, 64)),  # x columns strided
        (torch.randn(2, 4, 64), torch.randn(5, 64)),  # not a matrix
    ],
)
def test_skinny_linear_declines_what_it_cannot_do(x, weight):
    assert skinny_linear(x, weight, None) is None
    torch.testing.assert_close(linear(x, weight), torch.nn.functional.linear(x, weight), atol=1e-4, rtol=1e-5)


@needs_kernel
def test_model_linear_uses_the_kernel_for_decode_batches(monkeypatch):
    calls = []
    real = native_linear.skinny_linear

    def spy(x, weight, bias):
        out = real(x, weight, bias)
        calls.append(out is not None)
        return out

    monkeypatch.setattr("radixserve.model.llama.skinny_linear", spy)
    x, weight, bias = torch.randn(4, 64), torch.randn(12, 64), torch.randn(12)
    torch.testing.assert_close(linear(x, weight, bias), _reference(x, weight, bias), atol=1e-4, rtol=1e-5)
    assert calls == [True]

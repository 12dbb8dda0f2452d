"""The key basis of quantized pages (kernels/key_basis.py): the C butterflies and the torch
matrix are the same rotation on every head dim, it is orthogonal (scores unchanged) and its
own inverse, and it is what makes per-token int8 keys with an outlier channel accurate."""

from __future__ import annotations

import pytest
import torch

from radixserve.kernels.quantized_pages import dequantize, quantize
from radixserve.kernels.key_basis import hadamard_matrix, rotate_heads
from radixserve.kernels.native_ops import hadamard_heads_


def rotated(x: torch.Tensor) -> torch.Tensor:
    """The float64 reference: x @ H."""
    return (x.double() @ hadamard_matrix(x.shape[-1], torch.float64, torch.device("cpu"))).to(x.dtype)


@pytest.mark.parametrize("head_dim", [1, 2, 7, 64, 80, 96, 128])
def test_the_c_butterflies_rotate_in_place_as_the_matrix_does(head_dim):
    x = torch.randn(5, 3, head_dim, generator=torch.Generator().manual_seed(head_dim))
    inplace = x.clone()
    assert hadamard_heads_(inplace)
    torch.testing.assert_close(inplace, rotated(x), rtol=1e-6, atol=1e-6)
    assert not torch.allclose(inplace, x) or head_dim == 1


def test_the_torch_path_is_the_same_rotation():
    x = torch.randn(4, 2, 96, dtype=torch.float64)  # float64: the C kernel does not take it
    torch.testing.assert_close(rotate_heads(x), rotated(x), rtol=1e-12, atol=1e-12)


def test_strided_heads_rotate_in_place_and_the_row_around_them_stays():
    qkv = torch.randn(4, 3 * 64 + 5)
    before = qkv.clone()
    out = rotate_heads(qkv[:, :192].reshape(4, 3, 64))
    assert out.data_ptr() == qkv.data_ptr()
    torch.testing.assert_close(qkv[:, :192].reshape(4, 3, 64), rotated(before[:, :192].reshape(4, 3, 64)))
    assert torch.equal(qkv[:, 192:], before[:, 192:])


@pytest.mark.parametrize("head_dim", [64, 96])
def test_the_rotation_is_orthogonal_and_its_own_inverse(head_dim):
    h = hadamard_matrix(head_dim, torch.float64, torch.device("cpu"))
    torch.testing.assert_close(h @ h.T, torch.eye(head_dim, dtype=torch.float64), rtol=0, atol=1e-12)
    torch.testing.assert_close(h, h.T, rtol=0, atol=0)
    x = torch.randn(3, 2, head_dim)
    once = rotate_heads(x.clone())
    torch.testing.assert_close(rotate_heads(once), x, rtol=1e-5, atol=1e-5)


def test_int8_scores_of_keys_with_an_outlier_channel_are_closer_in_the_rotated_basis():
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(256, 1, 64, generator=g)
    keys[..., 5] *= 30.0  # one channel many times the rest, as in Llama keys
    queries = torch.randn(256, 1, 64, generator=g)
    exact = queries[:, 0] @ keys[:, 0].T

    def scores(q, k):
        return q[:, 0] @ dequantize(*quantize(k))[:, 0].T

    raw = (scores(queries, keys) - exact).abs().mean()
    in_basis = (scores(rotated(queries), rotated(keys)) - exact).abs().mean()
    assert in_basis < raw / 3

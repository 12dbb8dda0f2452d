"""The key basis of quantized pages (kernels/key_basis.py): the C kernel and the torch path
agree bit for bit on every head dim, the rotation is orthogonal (scores unchanged), and it is
what makes per-token int8 keys with an outlier channel accurate."""

from __future__ import annotations

import pytest
import torch

from radixserve.kernels.int8_pages import dequantize, quantize
from radixserve.kernels.key_basis import hadamard_heads, rotate_heads
from radixserve.kernels.native_ops import hadamard_heads_


@pytest.mark.parametrize("head_dim", [1, 2, 7, 64, 80, 96, 128])
def test_c_and_torch_rotate_bit_for_bit_in_place(head_dim):
    x = torch.randn(5, 3, head_dim, generator=torch.Generator().manual_seed(head_dim))
    expected = hadamard_heads(x.clone())
    inplace = x.clone()
    assert hadamard_heads_(inplace)
    assert torch.equal(inplace, expected)
    assert rotate_heads(x.clone()).equal(expected)


def test_strided_heads_rotate_in_place_and_rows_around_them_stay():
    qkv = torch.randn(4, 3 * 64 + 5)
    q = qkv[:, :192].reshape(4, 3, 64)
    before = qkv.clone()
    out = rotate_heads(q)
    assert out.data_ptr() == qkv.data_ptr()
    assert torch.equal(qkv[:, :192].reshape(4, 3, 64), hadamard_heads(before[:, :192].reshape(4, 3, 64)))
    assert torch.equal(qkv[:, 192:], before[:, 192:])


@pytest.mark.parametrize("head_dim", [64, 96])
def test_the_rotation_is_orthogonal_and_its_own_inverse(head_dim):
    x = torch.randn(6, 2, head_dim, dtype=torch.float64)
    y = torch.randn(6, 2, head_dim, dtype=torch.float64)
    hx, hy = hadamard_heads(x), hadamard_heads(y)
    torch.testing.assert_close((hx * hy).sum(-1), (x * y).sum(-1), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(hadamard_heads(hx), x, rtol=1e-12, atol=1e-12)


def test_int8_scores_of_keys_with_an_outlier_channel_are_closer_in_the_rotated_basis():
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(256, 1, 64, generator=g)
    keys[..., 5] *= 30.0  # one channel many times the rest, as in Llama keys
    queries = torch.randn(256, 1, 64, generator=g)
    exact = queries[:, 0] @ keys[:, 0].T

    def scores(q, k):
        return q[:, 0] @ dequantize(*quantize(k))[:, 0].T

    raw = (scores(queries, keys) - exact).abs().mean()
    rotated = (scores(hadamard_heads(queries), hadamard_heads(keys)) - exact).abs().mean()
    assert rotated < raw / 3

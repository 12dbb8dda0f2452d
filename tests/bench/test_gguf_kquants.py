"""bench/lib/gguf_kquants.py's Q4_K/Q5_K/Q6_K encoders, read back by the `gguf` package's own
dequantizer: every value lands where the decoder reads it, the error is that of a real K-quant,
and zero and constant rows survive."""

from __future__ import annotations

import numpy as np
import pytest

from bench.lib.gguf_kquants import quantize_k

gguf = pytest.importorskip("gguf")
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants  # noqa: E402

KINDS = ("Q4_K", "Q5_K", "Q6_K")

# Bounds on RMS(error) / RMS(weights) for normal weights. Rounding to a grid of step s leaves
# s/sqrt(12); a plain min/max fit of 32 normal samples spans about 4.1 sigma (Q4_K: s = 4.1/15,
# 0.079; Q5_K: s = 4.1/31, 0.038), and Q6_K's 16 samples peak near 2.0 sigma with s = 2.0/32
# (0.018). The encoder's scale search does better (measured 0.072, 0.036, 0.017); the bounds
# sit about 15% above the plain fit, so a lost bit or a mis-packed scale fails them.
RELATIVE_RMS_BOUND = {"Q4_K": 0.09, "Q5_K": 0.045, "Q6_K": 0.022}


def _roundtrip(w: np.ndarray, kind: str) -> np.ndarray:
    return quants.dequantize(quantize_k(w, kind), GGMLQuantizationType[kind])


@pytest.mark.parametrize("kind", KINDS)
def test_byte_size_is_the_ggml_type_size(kind):
    w = np.random.default_rng(0).standard_normal((8, 512)).astype(np.float32)
    raw = quantize_k(w, kind)
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
    assert block == 256
    assert raw.dtype == np.uint8 and raw.shape == (8, 512 // 256 * size)


@pytest.mark.parametrize("std", [1.0, 0.02])  # 0.02: the default model's weights (f16 d stays normal)
@pytest.mark.parametrize("kind", KINDS)
def test_normal_weights_reconstruct_within_the_k_quant_error(kind, std):
    w = (np.random.default_rng(1).standard_normal((8, 512)) * std).astype(np.float32)
    rel = np.sqrt(np.mean((_roundtrip(w, kind) - w) ** 2)) / np.sqrt(np.mean(w**2))
    assert rel < RELATIVE_RMS_BOUND[kind]


@pytest.mark.parametrize("sign", [1.0, -1.0])  # +: the scale codes' slots, -: the mins' (Q4_K/Q5_K)
@pytest.mark.parametrize("kind", KINDS)
def test_every_position_lands_where_the_decoder_reads_it(kind, sign):
    # row p holds one non-zero value, at p: alone in its sub-block it is exact up to f16, and every
    # other position decodes to 0 (a negative value in Q4_K/Q5_K is the sub-block's min: the
    # others are then d*sc*q - dmin*m, two f16-rounded terms), so a misplaced nibble, high bit
    # or scale code shows as an O(1) error
    values = sign * np.random.default_rng(2).uniform(0.5, 2.0, 256).astype(np.float32)
    back = _roundtrip(np.diag(values), kind)
    np.testing.assert_allclose(np.diag(back), values, rtol=2e-3)
    off = np.abs(back - np.diag(np.diag(back)))
    assert (off <= 2e-3 * np.abs(values)[:, None]).all()
    if sign > 0:
        assert not off.any()


@pytest.mark.parametrize("kind", KINDS)
def test_all_zero_input_gives_all_zero_bytes(kind):
    raw = quantize_k(np.zeros((3, 512), np.float32), kind)
    assert not raw.any()
    assert not _roundtrip(np.zeros((3, 512), np.float32), kind).any()


@pytest.mark.parametrize("kind", KINDS)
def test_constant_rows_reconstruct_closely(kind):
    # a constant is one grid step times a top code (or, negative, the min alone): exact up to the
    # f16 super-scale; when that is subnormal (3e-3, 0.02) the 6-bit code rounds it, 1/126 at most
    constants = np.array([0.37, -1.25, 3e-3, -3e-3, 0.02, -42.0], np.float32)
    w = np.repeat(constants[:, None], 512, axis=1)
    np.testing.assert_allclose(_roundtrip(w, kind), w, rtol=1 / 126)


@pytest.mark.parametrize("kind", KINDS)
def test_sub_blocks_of_very_different_magnitudes_keep_their_own_precision(kind):
    # sub-blocks of 32 scaled over a decade: their 6-bit (Q6_K: int8) scale codes take many values,
    # and each sub-block, small ones too, is measured against its own RMS
    rng = np.random.default_rng(3)
    w = rng.standard_normal((16, 512)).astype(np.float32)
    w *= np.repeat(10 ** rng.uniform(-1, 0, (16, 16)), 32, axis=1).astype(np.float32)
    err = (_roundtrip(w, kind) - w).reshape(-1, 32)
    rel = np.sqrt(np.mean(err**2, axis=1) / np.mean(w.reshape(-1, 32) ** 2, axis=1))
    assert rel.mean() < RELATIVE_RMS_BOUND[kind]
    assert rel.max() < 4 * RELATIVE_RMS_BOUND[kind]  # a small code's rounding costs its sub-block more


@pytest.mark.parametrize("shape", [(4, 576), (512,), (2, 2, 256)])
def test_shapes_that_are_not_rows_of_whole_super_blocks_are_refused(shape):
    with pytest.raises(ValueError):
        quantize_k(np.ones(shape, np.float32), "Q4_K")


def test_unknown_kind_is_refused():
    with pytest.raises(ValueError, match="Q8_K"):
        quantize_k(np.ones((1, 256), np.float32), "Q8_K")

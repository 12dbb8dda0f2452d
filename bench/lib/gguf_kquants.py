"""Numpy encoders for the GGUF K-quant block formats Q4_K, Q5_K and Q6_K.

The `gguf` package can read these types (`gguf.quants.dequantize`) but not write them; the bench
uses `quantize_k` to turn the default model's float32 weights into GGUF tensors of each type and
measure a quantized-weight kernel's accuracy on it. The encoder is the exact inverse of gguf's
`dequantize_blocks`, with no importance matrix: a super-block is 256 values along a row.

  Q4_K (144 bytes)  d f16 | dmin f16 | 12 bytes of 6-bit scales and mins | 128 bytes qs
  Q5_K (176 bytes)  d f16 | dmin f16 | 12 bytes of 6-bit scales and mins | 32 bytes qh | 128 bytes qs
      eight sub-blocks of 32, value = d*sc[j]*q - dmin*m[j], q in 0..15 (Q5_K: 0..31);
      sub-block j's low nibbles sit in qs[32*(j//2) : 32*(j//2)+32] at bit 4*(j%2), and
      Q5_K's fifth bit of element l of sub-block j is bit j of qh[l]
  Q6_K (210 bytes)  128 bytes ql | 64 bytes qh | 16 int8 scales | d f16
      sixteen sub-blocks of 16, value = d*scale[j]*(q-32), q in 0..63; in each half h of
      128 values, element r has its low nibble in ql[64*h + r%64] at bit 4*(r//64) and
      its top two bits in qh[32*h + r%32] at bit 2*(r//32)

Each sub-block's scale (and min) is the best least-squares fit over a few candidate grids;
the sub-block scales are then themselves quantized against the super-block's f16 d (and dmin),
and the values re-quantized with the scales as they will be decoded.
"""

from __future__ import annotations

import numpy as np

QK = 256
TYPE_SIZES = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
_STEPS = np.linspace(-1.0, 1.0, 11, dtype=np.float32)  # grid stretches tried per sub-block


def quantize_k(values: np.ndarray, kind: str) -> np.ndarray:
    """float32 [rows, K] (K a multiple of 256) -> uint8 [rows, K // 256 * type size] of `kind`."""
    if kind not in TYPE_SIZES:
        raise ValueError(f"kind must be one of {sorted(TYPE_SIZES)}, got {kind!r}")
    x = np.asarray(values, dtype=np.float32)
    if x.ndim != 2 or x.shape[1] % QK:
        raise ValueError(f"expected [rows, K] with K a multiple of {QK}, got shape {x.shape}")
    if not np.isfinite(x).all():
        raise ValueError("values must be finite")
    rows = x.shape[0]
    blocks = x.reshape(-1, QK)
    if kind == "Q6_K":
        out = _encode_q6_k(blocks)
    else:
        out = _encode_q45_k(blocks, bits=4 if kind == "Q4_K" else 5)
    return out.reshape(rows, -1)


def _f16_outward(a: np.ndarray) -> np.ndarray:
    """a rounded to f16 away from zero (so no code overflows its range), back in float32; near
    zero f16 is subnormal and coarse, and rounding down would clip the largest sub-scale."""
    h = a.astype(np.float16)
    short = np.abs(h.astype(np.float32)) < np.abs(a)
    h = np.where(short, np.nextafter(h, np.copysign(np.float16(np.inf), h)), h)
    return (h.astype(np.float32) + 0.0).astype(np.float32)  # + 0.0: no -0.0 (a set sign bit)


def _f16_bytes(a: np.ndarray) -> np.ndarray:
    return a.astype(np.float16).view(np.uint8).reshape(len(a), 2)


def _safe_inverse(a: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore"):
        return np.where(a > 0, 1.0 / np.where(a > 0, a, 1.0), 0.0).astype(np.float32)


# ---- Q4_K / Q5_K -------------------------------------------------------------------------


def _fit_scale_min(sub: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """Per sub-block [n, 32]: (scale >= 0, offset <= 0) with sub ~ scale*q + offset, q in 0..nmax."""
    lo = np.minimum(sub.min(axis=1), 0.0)
    span = sub.max(axis=1) - lo
    inv = (nmax + _STEPS[None, :]) * _safe_inverse(span)[:, None]  # [n, steps]
    q = np.clip(np.rint((sub - lo[:, None])[:, None, :] * inv[:, :, None]), 0, nmax)  # [n, steps, 32]
    scale, offset = _least_squares_affine(q, sub[:, None, :])
    err = np.square(scale[..., None] * q + offset[..., None] - sub[:, None, :]).sum(axis=-1)
    best = err.argmin(axis=1)[:, None]
    return np.take_along_axis(scale, best, 1)[:, 0], np.take_along_axis(offset, best, 1)[:, 0]


def _least_squares_affine(q: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """min ||scale*q + offset - x|| over the last axis, with offset clamped to <= 0."""
    n = q.shape[-1]
    sq, sx = q.sum(-1), x.sum(-1)
    sqq, sqx = (q * q).sum(-1), (q * x).sum(-1)
    det = n * sqq - sq * sq
    ok = det > 0
    det = np.where(ok, det, 1.0)
    scale = np.where(ok, (n * sqx - sq * sx) / det, 0.0)
    offset = np.where(ok, (sqq * sx - sq * sqx) / det, sx / n)
    # a positive offset is not representable (mins are >= 0): refit the scale through zero
    pos = offset > 0
    scale = np.where(pos, sqx * _safe_inverse(sqq), scale)
    offset = np.where(pos, 0.0, offset)
    return np.maximum(scale, 0.0).astype(np.float32), offset.astype(np.float32)


def _six_bit(per_sub: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[n, 8] non-negative -> (f16-exact super-scale [n], 6-bit codes [n, 8])."""
    d = _f16_outward(per_sub.max(axis=1) / 63.0)
    codes = np.clip(np.rint(per_sub * _safe_inverse(d)[:, None]), 0, 63)
    return d, codes.astype(np.uint8)


def _pack_scales(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """Inverse of gguf's Q4_K.get_scale_min: codes 0-3 in bytes 0-7, codes 4-7 split (see there)."""
    lo = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)  # bytes 0-3: sc[j] | top two bits of sc[j+4]
    mid = m[:, :4] | ((m[:, 4:] >> 4) << 6)  # bytes 4-7: m[j] | top two bits of m[j+4]
    hi = (sc[:, 4:] & 0x0F) | ((m[:, 4:] & 0x0F) << 4)  # bytes 8-11: low nibbles of sc/m[j+4]
    return np.concatenate([lo, mid, hi], axis=1).astype(np.uint8)


def _encode_q45_k(blocks: np.ndarray, bits: int) -> np.ndarray:
    n, nmax = len(blocks), (1 << bits) - 1
    sub = blocks.reshape(n * 8, 32)
    scale, offset = _fit_scale_min(sub, nmax)
    d, sc = _six_bit(scale.reshape(n, 8))
    dmin, m = _six_bit(-offset.reshape(n, 8))
    step = (d[:, None] * sc).reshape(-1, 1)
    base = (dmin[:, None] * m).reshape(-1, 1)
    q = np.clip(np.rint((sub + base) * _safe_inverse(step)), 0, nmax).astype(np.uint8).reshape(n, 8, 32)
    parts = [_f16_bytes(d), _f16_bytes(dmin), _pack_scales(sc, m)]
    if bits == 5:
        parts.append(_pack_bit_planes(q >> 4))
    parts.append(_pack_nibble_pairs(q & 0x0F))
    return np.concatenate(parts, axis=1)


def _pack_nibble_pairs(q: np.ndarray) -> np.ndarray:
    """[n, 8, 32] nibbles -> [n, 128]: sub-blocks 2c and 2c+1 share bytes 32c..32c+31, low then high."""
    return (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(len(q), 128)


def _pack_bit_planes(h: np.ndarray) -> np.ndarray:
    """[n, 8, 32] single bits -> [n, 32]: bit j of byte l is element l of sub-block j."""
    weights = (1 << np.arange(8, dtype=np.uint8))[None, :, None]
    return (h * weights).sum(axis=1, dtype=np.uint8)


# ---- Q6_K --------------------------------------------------------------------------------


def _fit_symmetric(sub: np.ndarray) -> np.ndarray:
    """Per sub-block [n, 16]: scale with sub ~ scale*q, q in -32..31 (signed: the largest
    magnitude can take the -32 end, one step more than the +31 end)."""
    amax_at = np.abs(sub).argmax(axis=1)[:, None]
    peak = np.take_along_axis(sub, amax_at, 1)[:, 0]  # signed value of largest magnitude
    inv = np.zeros_like(peak)
    np.divide(-1.0, peak, out=inv, where=peak != 0)
    inv = inv[:, None] * (32.0 + _STEPS[None, :])  # [n, steps]
    q = np.clip(np.rint(sub[:, None, :] * inv[:, :, None]), -32, 31)
    scale = (q * sub[:, None, :]).sum(-1) * _safe_inverse((q * q).sum(-1))
    err = np.square(scale[..., None] * q - sub[:, None, :]).sum(axis=-1)
    return np.take_along_axis(scale, err.argmin(axis=1)[:, None], 1)[:, 0].astype(np.float32)


def _int8_scales(per_sub: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """[n, 16] signed -> (f16-exact d [n], int8 codes [n, 16]); the largest magnitude maps to -128."""
    peak = np.take_along_axis(per_sub, np.abs(per_sub).argmax(axis=1)[:, None], 1)[:, 0]
    d = _f16_outward(-peak / 128.0)
    inv = np.zeros_like(d)
    np.divide(1.0, d, out=inv, where=d != 0)
    return d, np.clip(np.rint(per_sub * inv[:, None]), -128, 127).astype(np.int8)


def _encode_q6_k(blocks: np.ndarray) -> np.ndarray:
    n = len(blocks)
    sub = blocks.reshape(n * 16, 16)
    d, sc = _int8_scales(_fit_symmetric(sub).reshape(n, 16))
    step = (d[:, None] * sc).reshape(-1, 1)
    inv = np.zeros_like(step)
    np.divide(1.0, step, out=inv, where=step != 0)
    # a zero step decodes to 0 whatever q is: store q=-32 there (byte 0), as ggml zeroes the block
    q = np.where(step != 0, np.clip(np.rint(sub * inv), -32, 31), -32.0)
    q = (q + 32).astype(np.uint8).reshape(n, 2, 128)  # two halves of 128
    ql = (q[:, :, :64] & 0x0F) | ((q[:, :, 64:] & 0x0F) << 4)  # [n, 2, 64]
    top = (q >> 4).reshape(n, 2, 4, 32)
    qh = top[:, :, 0] | (top[:, :, 1] << 2) | (top[:, :, 2] << 4) | (top[:, :, 3] << 6)  # [n, 2, 32]
    return np.concatenate([ql.reshape(n, 128), qh.reshape(n, 64), sc.view(np.uint8), _f16_bytes(d)], axis=1)

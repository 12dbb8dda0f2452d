"""GGUF block types repacked into QuantWeight's one layout (kernels/quant_linear.py), each
value exactly what the type's own dequantization gives (tests check against the `gguf`
package's dequantizer):

    type   codes          group  scale          offset / zero point
    Q4_0   4-bit q        32     d              zero 8
    Q4_1   4-bit q        32     d              m
    Q5_0   8-bit q        32     d              zero 16
    Q5_1   8-bit q        32     d              m
    Q8_0   8-bit q + 128  32     d              zero 128
    Q4_K   4-bit q        32     d * sc[j]      -dmin * m[j]
    Q5_K   8-bit q        32     d * sc[j]      -dmin * m[j]
    Q6_K   8-bit q        16     d * sc[j]      zero 32
    MXFP4  8-bit 2v + 128 32     2^(e - 128)    zero 128

MXFP4 (gpt-oss's experts) is not affine in its 4-bit codes: an E2M1 value v is one of 0, 0.5, 1,
1.5, 2, 3, 4, 6 (and their negatives) times 2^(e - 127) for the block's E8M0 byte e; 2v is an
integer in [-12, 12], so 2v + 128 as an 8-bit code with the float32 scale 2^(e - 128) is exact
(for e <= 248: the kernels multiply a code, up to 140, by the scale; a real weight's e is near 127).
It costs 8 bits a weight and a float32 scale per 32 (9 bits a weight) where the file holds 4.25.

A GGUF tensor's rows are its output features and its blocks run along K, so a row of the
GGUF is a row here; only the order of codes inside a 64-element chunk changes. The legacy
types' d and m are float16 in the file and stay so (exactly); the K types' d * sc[j] and
dmin * m[j] are float32 (float16 cannot hold a float16 times a 6-bit integer in general).
"""

from __future__ import annotations

import numpy as np
import torch

from radixserve.kernels.quant_linear import QuantWeight, pack_nibbles

QK_K = 256
REPACKED = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "MXFP4")
HALF_SCALED = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")  # scales and offsets kept float16; the rest float32


def repack(kind: str, raw: np.ndarray, n: int, k: int) -> QuantWeight:
    """The QuantWeight of a GGUF tensor of type `kind` whose bytes are `raw` ([n, row bytes]
    uint8, e.g. GGUFReader's tensor.data) and whose logical shape is [n, k]."""
    if kind not in REPACKED:
        raise ValueError(f"GGUF type {kind} cannot be served quantized (types: {', '.join(REPACKED)})")
    if k % 64:
        raise ValueError(f"a {kind} weight of {k} columns: quantized weights need a multiple of 64")
    per_block = QK_K if kind.endswith("_K") else 32
    blocks = np.ascontiguousarray(raw).reshape(n * (k // per_block), -1)
    u, scale, offset, zero, group = _UNPACK[kind](blocks)
    bits = 4 if kind in ("Q4_0", "Q4_1", "Q4_K") else 8
    codes = torch.from_numpy(np.ascontiguousarray(u.reshape(n, k)))
    codes = pack_nibbles(codes) if bits == 4 else codes
    return QuantWeight(
        codes.contiguous(), _rows(scale, n), None if offset is None else _rows(offset, n), bits, group, zero, kind,
    )


def _rows(a: np.ndarray, n: int) -> torch.Tensor:
    """Per-group values [n, groups] in their dtype: float16 as read, float32 as computed."""
    return torch.from_numpy(np.ascontiguousarray(a).reshape(n, -1))


def _half(a: np.ndarray) -> np.ndarray:
    """A block's float16 field (2 bytes a block), as float16."""
    return np.ascontiguousarray(a).view(np.float16)


def _f32(a: np.ndarray) -> np.ndarray:
    """A block's float16 field widened to float32 (the K types multiply it by sub-scales)."""
    return _half(a).astype(np.float32)


def _nibbles32(qs: np.ndarray) -> np.ndarray:
    """A legacy block's 16 bytes -> 32 codes (low nibbles first, then high)."""
    return np.concatenate((qs & 15, qs >> 4), axis=-1)


def _high_bits(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's 32 fifth bits (4 bytes, little-endian) as 0/1 per element."""
    bits = qh.copy().view(np.uint32).reshape(-1, 1) >> np.arange(32, dtype=np.uint32)
    return (bits & 1).astype(np.uint8)


def _q4_0(b):
    d, qs = _half(b[:, :2]), b[:, 2:]
    return _nibbles32(qs), d, None, 8, 32


def _q4_1(b):
    d, m, qs = _half(b[:, :2]), _half(b[:, 2:4]), b[:, 4:]
    return _nibbles32(qs), d, m, 0, 32


def _q5_0(b):
    d, qh, qs = _half(b[:, :2]), b[:, 2:6], b[:, 6:]
    return _nibbles32(qs) | (_high_bits(qh) << 4), d, None, 16, 32


def _q5_1(b):
    d, m, qh, qs = _half(b[:, :2]), _half(b[:, 2:4]), b[:, 4:8], b[:, 8:]
    return _nibbles32(qs) | (_high_bits(qh) << 4), d, m, 0, 32


def _q8_0(b):
    d, qs = _half(b[:, :2]), b[:, 2:].view(np.int8)
    return (qs.astype(np.int16) + 128).astype(np.uint8), d, None, 128, 32


def _k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes -> 8 six-bit scales and 8 six-bit mins per super-block."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate((d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)), axis=-1)
    mn = np.concatenate((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _k_low_nibbles(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K's 128 bytes -> 256 low codes: per 32-byte run, low nibbles then high."""
    q = qs.reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (q & 15).reshape(-1, QK_K)


def _q4_k(b):
    d, dmin, sc, mn = _f32(b[:, :2]), _f32(b[:, 2:4]), *_k_scales(b[:, 4:16])
    return _k_low_nibbles(b[:, 16:]), d * sc, -(dmin * mn), 0, 32


def _q5_k(b):
    d, dmin, sc, mn = _f32(b[:, :2]), _f32(b[:, 2:4]), *_k_scales(b[:, 4:16])
    qh, qs = b[:, 16:48], b[:, 48:]
    high = (qh.reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    return _k_low_nibbles(qs) | (high.reshape(-1, QK_K) << 4), d * sc, -(dmin * mn), 0, 32


def _q6_k(b):
    ql, qh, scales, d = b[:, :128], b[:, 128:192], b[:, 192:208].view(np.int8), _f32(b[:, 208:210])
    low = (ql.reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 15
    high = (qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
    u = low.reshape(-1, QK_K) | (high.reshape(-1, QK_K) << 4)
    return u, d * scales.astype(np.float32), None, 32, 16


# E2M1's 16 codes (sign bit high) as twice their value
_E2M1_DOUBLED = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.int16)


def _mxfp4(b):
    e, qs = b[:, 0].astype(np.int32), b[:, 1:]
    scale = np.ldexp(np.float32(1.0), e - 128).astype(np.float32)  # exact: 2^-128 is a float32 (subnormal)
    return (_E2M1_DOUBLED[_nibbles32(qs)] + 128).astype(np.uint8), scale.reshape(-1, 1), None, 128, 32


_UNPACK = {"Q4_0": _q4_0, "Q4_1": _q4_1, "Q5_0": _q5_0, "Q5_1": _q5_1, "Q8_0": _q8_0,
           "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k, "MXFP4": _mxfp4}

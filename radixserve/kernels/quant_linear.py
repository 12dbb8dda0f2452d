"""QuantWeight and its two kernels (csrc/quant_linear.c): a Linear's weight kept as small
codes in groups, multiplied without ever widening the whole weight to float32.

One layout holds every quantized type radixserve serves (the GGUF block types, repacked once
by model/gguf_repack.py, and int8/int4 quantized at load by `quantize`):

    w[n, k] = scale[n, k // group] * u[n, k] + offset[n, k // group]
    (offset None: offset = -zero * scale, a symmetric type's zero point)

Scales and offsets are float16 where that holds them exactly (the GGUF types that store them
so, and int8/int4 quantized at load, against their float16 scales), else float32 (the K types'
d * sub-scale); both the same dtype, widened to float32 where they are read.

`u` are 4-bit codes (two per byte: per 64-element chunk, byte j holds code j low and code
32 + j high) or 8-bit ones (a byte each). The decode-sized product quantizes the rows of x per
32-element block into two int8 codes an element (a high code and its residual: about 16 bits;
one code measured 98.2% top-1 agreement on the default model) and multiplies with integer dot
products (AVX512-VNNI; AVX2 and scalar paths too), so against the float product of the same
weights only the activations' rounding differs. Past the native decoder's rows the model
dequantizes the weight into a reused float32 buffer and takes the float path (oneDNN:
model/llama.py's quantized_linear), whose rate the integer kernel does not reach there.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from radixserve.kernels.native_build import load_kernel
from radixserve.kernels.native_ops import model_ops_enabled

PATHS = {"best": 0, "avx2": 1, "scalar": 2}
SCALE_DTYPES = (torch.float16, torch.float32)
_GROUPS_SMALL = (16, 32)


@dataclass
class QuantWeight:
    """A [N, K] weight as codes, per-group scales and offsets (module docstring)."""

    codes: torch.Tensor  # uint8 [N, K * bits // 8]
    scale: torch.Tensor  # float16 or float32 [N, K // group]
    offset: torch.Tensor | None  # as scale [N, K // group]; None: -zero * scale
    bits: int
    group: int
    zero: int = 0
    kind: str = ""  # where it came from: a GGUF type name (Q4_1, ...), int8 or int4

    def __post_init__(self) -> None:
        n, k = self.shape
        if self.bits not in (4, 8) or k % 64 or not _group_ok(self.group, k):
            raise ValueError(f"a quantized weight needs 4 or 8 bits, K % 64 == 0 and a group of 16, 32 or "
                             f"a multiple of 64 dividing K; got bits={self.bits} K={k} group={self.group}")
        groups = (n, k // self.group)
        for name, t in (("scale", self.scale), ("offset", self.offset)):
            if t is not None and (t.dtype not in SCALE_DTYPES or tuple(t.shape) != groups or not t.is_contiguous()):
                raise ValueError(f"{name} must be contiguous float16 or float32 {groups}, "
                                 f"got {t.dtype} {tuple(t.shape)}")
        if self.offset is not None and self.offset.dtype != self.scale.dtype:
            raise ValueError(f"offset must be {self.scale.dtype} as scale is, got {self.offset.dtype}")
        if self.codes.dtype != torch.uint8 or not self.codes.is_contiguous():
            raise ValueError("codes must be contiguous uint8")

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape[0], self.codes.shape[1] * 8 // self.bits

    @property
    def half_scales(self) -> bool:
        return self.scale.dtype == torch.float16

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.offset) if t is not None)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The stored tensors by name, for saving (meta() holds the rest)."""
        out = {"codes": self.codes, "scale": self.scale}
        if self.offset is not None:
            out["offset"] = self.offset
        return out

    def meta(self) -> dict[str, str]:
        return {"bits": str(self.bits), "group": str(self.group), "zero": str(self.zero), "kind": self.kind}

    @classmethod
    def from_saved(cls, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> QuantWeight:
        return cls(tensors["codes"], tensors["scale"], tensors.get("offset"), int(meta["bits"]),
                   int(meta["group"]), int(meta["zero"]), meta["kind"])

    def dequantize(self, rows: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """The float32 weight (or its rows `rows`, an int64 index tensor), exactly as stored;
        into `out` (contiguous float32 of that shape) where given."""
        n, k = self.shape
        fn = _kernel("quant_dequantize_f32")
        index = None if rows is None else rows.to(torch.int64).contiguous()
        count = n if index is None else index.numel()
        if out is None:
            out = torch.empty(count, k, dtype=torch.float32)
        elif out.shape != (count, k) or out.dtype != torch.float32 or not out.is_contiguous():
            raise ValueError(f"out must be contiguous float32 {(count, k)}")
        if fn is None:
            return out.copy_(self._dequantize_torch(index).reshape(count, k))
        status = fn(self.codes.data_ptr(), self.scale.data_ptr(), _ptr(self.offset), n, k, self.bits, self.group,
                    self.zero, int(self.half_scales), None if index is None else index.data_ptr(), count,
                    out.data_ptr())
        if status == -2:
            raise IndexError(f"a row index is outside the weight's {n} rows")
        if status:
            raise ValueError(f"the dequantize kernel refused a {self.kind} weight {n}x{k}")
        return out

    def _dequantize_torch(self, index: torch.Tensor | None) -> torch.Tensor:
        codes, scale, offset = self.codes, self.scale, self.offset
        if index is not None:
            codes, scale = codes[index], scale[index]
            offset = None if offset is None else offset[index]
        u = unpack_codes(codes, self.bits).float()
        s = scale.float().repeat_interleave(self.group, dim=1)
        if offset is None:
            return s * (u - self.zero)
        return s * u + offset.float().repeat_interleave(self.group, dim=1)


def quant_linear(x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None = None,
                 path: str = "best") -> torch.Tensor | None:
    """x [M, K] @ weight.T (+ bias) by the integer kernel, or None where it does not apply
    (not float32 CPU rows, kernels off or not buildable)."""
    result = _run("quant_linear_f32", x, weight, bias, PATHS[path])
    if result is None:
        return None
    status, out = result
    if status == -3:
        raise ValueError(f"this build of the kernel has no {path} path")
    return out


def quant_gemm(x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """x [M, K] @ weight.T (+ bias) by the prompt-sized integer kernel (features across the
    vector lanes, the weight repacked a block of features at a time inside the call), or None
    where it does not apply (as quant_linear; also a build without AVX512-VNNI). The activations
    are quantized as quant_linear quantizes them, so the two agree up to float summation order."""
    result = _run("quant_gemm_f32", x, weight, bias)
    return None if result is None or result[0] == -3 else result[1]


def _run(name: str, x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None,
         *extra: int) -> tuple[int, torch.Tensor] | None:
    """Kernel `name` on (x, weight, bias, *extra): (0 or -3, out); None where the inputs or the
    build do not fit; any other status raises."""
    n, k = weight.shape
    if not (x.dim() == 2 and x.shape[1] == k and x.shape[0] > 0 and x.dtype == torch.float32
            and x.device.type == "cpu" and x.stride(1) == 1):
        return None
    if bias is not None and not (bias.dtype == torch.float32 and bias.is_contiguous() and bias.shape == (n,)):
        return None
    fn = _kernel(name)
    if fn is None:
        return None
    out = torch.empty(x.shape[0], n, dtype=torch.float32)
    status = fn(x.data_ptr(), x.shape[0], x.stride(0), weight.codes.data_ptr(), weight.scale.data_ptr(),
                _ptr(weight.offset), n, k, weight.bits, weight.group, weight.zero, int(weight.half_scales),
                _ptr(bias), out.data_ptr(), out.stride(0), *extra)
    if status not in (0, -3):
        raise RuntimeError(f"{name} failed ({status}) on a {weight.kind} weight {n}x{k}")
    return status, out


def best_path() -> str | None:
    """The kernel's path on this CPU (vnni, avx2, scalar), or None without the kernel."""
    fn = _kernel("quant_linear_best_path")
    return None if fn is None else ("vnni", "avx2", "scalar")[fn()]


def quantize(weight: torch.Tensor, bits: int, group: int | None = None) -> QuantWeight:
    """A float weight [N, K] quantized at load: int8 symmetric per output channel (group K,
    zero point 128), or int4 asymmetric per `group` (default 32) elements. Scales and offsets
    are float16 (float32 where a value is past float16's range), the codes made against them:
    each scale rounded up and each int4 minimum down, so every value stays within half a step."""
    w = weight.detach().float()
    n, k = w.shape
    if bits == 8:
        group = k if group is None else group
        g = w.reshape(n, k // group, group)
        scale = _stored(g.abs().amax(dim=2) / 127.0, up=True)
        q = torch.round(g / _nonzero(scale)[..., None]).clamp(-127, 127) + 128
        return QuantWeight(q.reshape(n, k).to(torch.uint8), scale.contiguous(), None, 8, group, 128, "int8")
    if bits == 4:
        group = 32 if group is None else group
        g = w.reshape(n, k // group, group)
        lo, hi = g.amin(dim=2), g.amax(dim=2)
        lo_half = _stored(lo, up=False)
        scale = _stored((hi - lo_half.float()) / 15.0, up=True)
        if scale.dtype == lo_half.dtype:
            lo = lo_half
        else:  # past float16's range: float32, as stored before float16 scales
            scale = (hi - lo) / 15.0
        q = torch.round((g - lo.float()[..., None]) / _nonzero(scale)[..., None]).clamp(0, 15)
        return QuantWeight(pack_nibbles(q.reshape(n, k).to(torch.uint8)), scale.contiguous(), lo.contiguous(), 4,
                           group, 0, "int4")
    raise ValueError(f"quantize takes 8 or 4 bits, got {bits}")


def _stored(t: torch.Tensor, up: bool) -> torch.Tensor:
    """t as float16, each value rounded up (or down) to one that float16 holds; t itself
    (float32) where any value falls outside float16's range."""
    half = t.half()
    toward = torch.full_like(half, float("inf") if up else float("-inf"))
    off = half.float() < t if up else half.float() > t
    half = torch.where(off, torch.nextafter(half, toward), half)
    return half if torch.isfinite(half).all() else t


def _nonzero(scale: torch.Tensor) -> torch.Tensor:
    s = scale.float()
    return torch.where(s > 0, s, torch.ones_like(s))


def concat_rows(parts: list[QuantWeight]) -> QuantWeight:
    """The parts' rows in one weight (fused q/k/v, gate/up), their storage made common where
    it differs: codes widened to 8 bits, groups split to the smallest, zero points turned into
    offsets (-zero * scale: exact, the zero points being powers of two), scales and offsets
    float16 only where every part's are and hold the offsets made. Values are unchanged."""
    if len(parts) == 1:
        return parts[0]
    bits = max(p.bits for p in parts)
    group = min(p.group for p in parts)
    same_zero = len({(p.zero, p.offset is None) for p in parts}) == 1
    codes, scales, offsets = [], [], []
    for p in parts:
        if p.group % group:
            raise ValueError(f"cannot fuse weights grouped by {p.group} and {group}")
        codes.append(p.codes if p.bits == bits else unpack_codes(p.codes, p.bits))
        scales.append(p.scale.float().repeat_interleave(p.group // group, dim=1))
        if not same_zero:
            offset = -p.zero * p.scale.float() if p.offset is None else p.offset.float()
            offsets.append(offset.repeat_interleave(p.group // group, dim=1))
        elif p.offset is not None:
            offsets.append(p.offset.float().repeat_interleave(p.group // group, dim=1))
    scale, offset = torch.cat(scales), torch.cat(offsets) if offsets else None
    if all(p.half_scales for p in parts) and (offset is None or _holds_exactly(offset)):
        scale, offset = scale.half(), None if offset is None else offset.half()
    kinds = "+".join(dict.fromkeys(p.kind for p in parts))
    return QuantWeight(torch.cat(codes).contiguous(), scale.contiguous(),
                       None if offset is None else offset.contiguous(), bits, group,
                       parts[0].zero if same_zero else 0, kinds)


def _holds_exactly(t: torch.Tensor) -> bool:
    """Whether float16 holds every value of the float32 t."""
    return bool(torch.equal(t.half().float(), t))


def pack_nibbles(u: torch.Tensor) -> torch.Tensor:
    """4-bit codes [N, K] (values 0..15) into the layout's bytes [N, K // 2]."""
    n, k = u.shape
    chunks = u.reshape(n, k // 64, 2, 32).to(torch.uint8)
    return (chunks[:, :, 0] | (chunks[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def unpack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """The codes [N, K] as uint8 values (the inverse of pack_nibbles for 4 bits)."""
    if bits == 8:
        return codes
    n = codes.shape[0]
    chunks = codes.reshape(n, -1, 1, 32)
    both = torch.cat((chunks & 15, chunks >> 4), dim=2)
    return both.reshape(n, -1)


def _group_ok(group: int, k: int) -> bool:
    return group in _GROUPS_SMALL or (group > 0 and group % 64 == 0 and k % group == 0)


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


@functools.cache
def _kernel(name: str):
    return load_kernel(name) if model_ops_enabled() else None

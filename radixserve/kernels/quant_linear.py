"""QuantWeight and its kernels (csrc/quant_linear.c): a Linear's weight kept as small codes in
groups, multiplied without ever widening the whole weight to float32.

One layout holds every quantized type radixserve serves (the GGUF block types, repacked once
by model/gguf_repack.py, and int8/int4 quantized at load by `quantize`):

    w[n, k] = scale[n, k // group] * u[n, k] + offset[n, k // group]
    (offset None: offset = -zero * scale, a symmetric type's zero point)

Scales and offsets are float16 where that holds them exactly (the GGUF types that store them
so, and int8/int4 quantized at load, against their float16 scales), else float32 (the K types'
d * sub-scale); both the same dtype, widened to float32 where they are read.

`u` are 4-bit codes (two per byte: per 64-element chunk, byte j holds code j low and code
32 + j high) or 8-bit ones (a byte each), one feature a row: the layout repacking makes, saving
keeps and fusing (concat_rows) works on. On a CPU with AVX512-VNNI the model moves each weight
once at load into the lanes layout (`to_lanes`: features across the vector lanes, 32 a block,
csrc/quant_linear.c), which the integer kernel multiplies at every row count, decode and prompt
alike; elsewhere the rows layout's AVX2 and scalar paths take decode-sized products and the
model dequantizes past them (model/layers.py's quantized_linear). The kernel quantizes the rows
of x per 32-element block into two int8 codes an element (a high code and its residual: about
16 bits; one code measured 98.2% top-1 agreement on the default model), so against the float
product of the same weights only the activations' rounding differs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from radixserve.kernels.native_build import load_kernel
from radixserve.kernels.native_ops import model_ops_enabled

PATHS = {"best": 0, "avx2": 1, "scalar": 2}
SCALE_DTYPES = (torch.float16, torch.float32)
LANES = 32  # features a block of the lanes layout
_GROUPS_SMALL = (16, 32)


@dataclass
class QuantWeight:
    """A [N, K] weight as codes, per-group scales and offsets (module docstring). With `lanes`,
    the same values in the lanes layout: codes [ceil(N / 32) * 32, K * bits // 8] (as bytes:
    per block of 32 features, [K / 4][32][4] codes, or for 4 bits [K / 8][32][4] bytes whose low
    nibbles are codes 8j..8j+3 and high ones 8j+4..8j+7), scale and offset [blocks, K // group,
    32], the padding features zero; `features` is N."""

    codes: torch.Tensor  # uint8 [N, K * bits // 8]
    scale: torch.Tensor  # float16 or float32 [N, K // group]
    offset: torch.Tensor | None  # as scale [N, K // group]; None: -zero * scale
    bits: int
    group: int
    zero: int = 0
    kind: str = ""  # where it came from: a GGUF type name (Q4_1, ...), int8 or int4
    lanes: bool = False
    features: int = 0  # N, where lanes

    def __post_init__(self) -> None:
        n, k = self.shape
        if self.bits not in (4, 8) or k % 64 or not _group_ok(self.group, k):
            raise ValueError(f"a quantized weight needs 4 or 8 bits, K % 64 == 0 and a group of 16, 32 or "
                             f"a multiple of 64 dividing K; got bits={self.bits} K={k} group={self.group}")
        blocks = -(-n // LANES)
        if self.lanes and self.codes.shape[0] != blocks * LANES:
            raise ValueError(f"lanes codes need {blocks * LANES} rows for {n} features, got {self.codes.shape[0]}")
        groups = (blocks, k // self.group, LANES) if self.lanes else (n, k // self.group)
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
        n = self.features if self.lanes else self.codes.shape[0]
        return n, self.codes.shape[1] * 8 // self.bits

    @property
    def half_scales(self) -> bool:
        return self.scale.dtype == torch.float16

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scale, self.offset) if t is not None)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The stored tensors by name, for saving (meta() holds the rest); rows layout only."""
        if self.lanes:
            raise ValueError("a lanes-layout weight is saved as rows: to_rows() first")
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

    def to_lanes(self) -> QuantWeight:
        """The same weight in the lanes layout (itself where it is already)."""
        if self.lanes:
            return self
        n, k = self.shape
        blocks = -(-n // LANES)
        u = _pad_rows(unpack_codes(self.codes, self.bits), blocks * LANES)
        steps = u.reshape(blocks, LANES, k // 4, 4).transpose(1, 2)  # [blocks, k / 4, 32, 4]
        if self.bits == 4:
            pairs = steps.reshape(blocks, k // 8, 2, LANES, 4)
            steps = pairs[:, :, 0] | (pairs[:, :, 1] << 4)
        codes = steps.contiguous().reshape(blocks * LANES, k * self.bits // 8)
        return QuantWeight(codes, _values_to_lanes(self.scale, blocks), _values_to_lanes(self.offset, blocks),
                           self.bits, self.group, self.zero, self.kind, True, n)

    def to_rows(self) -> QuantWeight:
        """The same weight one feature a row (itself where it is already)."""
        if not self.lanes:
            return self
        n, k = self.shape
        blocks = self.codes.shape[0] // LANES
        steps = self.codes.reshape(blocks, k * self.bits // 32, LANES, 4)
        if self.bits == 4:
            steps = torch.stack((steps & 15, steps >> 4), dim=2).reshape(blocks, k // 4, LANES, 4)
        u = steps.transpose(1, 2).reshape(blocks * LANES, k)[:n]
        codes = u.contiguous() if self.bits == 8 else pack_nibbles(u)
        return QuantWeight(codes, _values_to_rows(self.scale, n), _values_to_rows(self.offset, n), self.bits,
                           self.group, self.zero, self.kind)

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
            return out.copy_(self.to_rows()._dequantize_torch(index).reshape(count, k))
        status = fn(self.codes.data_ptr(), self.scale.data_ptr(), _ptr(self.offset), n, k, self.bits, self.group,
                    self.zero, int(self.half_scales), int(self.lanes), None if index is None else index.data_ptr(),
                    count, out.data_ptr())
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


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """t [n, ...] with zero rows appended up to `rows`."""
    if t.shape[0] == rows:
        return t
    return torch.cat((t, t.new_zeros(rows - t.shape[0], *t.shape[1:])))


def _values_to_lanes(t: torch.Tensor | None, blocks: int) -> torch.Tensor | None:
    """Scales or offsets [n, groups] as [blocks, groups, 32], padding features zero."""
    if t is None:
        return None
    return _pad_rows(t, blocks * LANES).reshape(blocks, LANES, -1).transpose(1, 2).contiguous()


def _values_to_rows(t: torch.Tensor | None, n: int) -> torch.Tensor | None:
    return None if t is None else t.transpose(1, 2).reshape(-1, t.shape[1])[:n].contiguous()


def lanes_preferred() -> bool:
    """Whether weights should be moved into the lanes layout at load: the kernel is built and
    this CPU has AVX512-VNNI (the only path that reads it)."""
    return best_path() == "vnni"


def quant_linear(x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None = None,
                 path: str = "best") -> torch.Tensor | None:
    """x [M, K] @ weight.T (+ bias) by the integer kernel, or None where it does not apply
    (not float32 CPU rows, kernels off or not buildable). A lanes-layout weight takes the
    best path only (AVX512-VNNI)."""
    n, k = weight.shape
    if weight.lanes and path != "best":
        raise ValueError(f"the {path} path reads one feature a row: weight.to_rows() first")
    if not (x.dim() == 2 and x.shape[1] == k and x.shape[0] > 0 and x.dtype == torch.float32
            and x.device.type == "cpu" and x.stride(1) == 1):
        return None
    if bias is not None and not (bias.dtype == torch.float32 and bias.is_contiguous() and bias.shape == (n,)):
        return None
    fn = _kernel("quant_linear_f32")
    if fn is None:
        return None
    out = torch.empty(x.shape[0], n, dtype=torch.float32)
    status = fn(x.data_ptr(), x.shape[0], x.stride(0), weight.codes.data_ptr(), weight.scale.data_ptr(),
                _ptr(weight.offset), n, k, weight.bits, weight.group, weight.zero, int(weight.half_scales),
                int(weight.lanes), _ptr(bias), out.data_ptr(), out.stride(0), PATHS[path])
    if status == -3:
        raise ValueError(f"this build of the kernel has no {path} path for this layout")
    if status:
        raise RuntimeError(f"quant_linear_f32 failed ({status}) on a {weight.kind} weight {n}x{k}")
    return out


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
    if any(p.lanes for p in parts):
        raise ValueError("concat_rows takes weights one feature a row: fuse before to_lanes()")
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

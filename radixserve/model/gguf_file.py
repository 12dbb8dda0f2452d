"""A GGUF file read as it is: its header checked before any work, its tensors named as in
transformers' checkpoints, quantized ones repacked (gguf_repack.py) and the rest float32.

Model files are input: a truncated file, a tensor whose shape, type or size disagrees with
the header, an unknown type or an absurd dimension is refused with an error naming the
tensor, before anything is converted or cached. The file is memory-mapped, never read whole.
"""

from __future__ import annotations

import functools
import math
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from radixserve.kernels.quant_linear import QuantWeight
from radixserve.model.gguf_repack import REPACKED, repack
from radixserve.model.causal_lm import GGUF_LAYER_NAMES
from radixserve.model.registry import ModelFamily, family_for_gguf, model_class

_MAX_DIM = 1 << 24  # no real weight has a side this long; a corrupt header often does

_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head",
              "token_embd_norm": "model.embedding_norm"}  # LFM2's final norm (transformers' embedding_norm)


class GGUFFile:
    """A GGUF file whose header is read once, on first use (`header`): scanned field by field,
    its architecture's family looked up, every tensor's entry checked against the file; its
    data memory-mapped only when tensors are read. A load opens one and hands it on (the
    conversion's check, the weights' read)."""

    def __init__(self, path: Path):
        self.path = Path(path)

    @functools.cached_property
    def header(self) -> GGUFHeader:
        """ValueError for a file that cannot be served (in well under a second)."""
        header = scan_header(self.path)
        try:
            header.family = family_for_gguf(header.architecture)
        except ValueError as exc:
            raise ValueError(f"{self.path.name}: {exc}") from None
        size = self.path.stat().st_size
        for info in header.tensors:
            _check_tensor(info, size, self.path.name)
        return header

    @property
    def opened(self) -> bool:
        """Whether the header was read (this object's `header` computed)."""
        return "header" in self.__dict__

    @property
    def family(self) -> ModelFamily:
        return self.header.family

    def raw(self, info: TensorInfo) -> np.ndarray:
        """A tensor's bytes as stored, [rows, row bytes] uint8, a view of the file's mapping."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(info.type)]
        row_bytes = info.dims[0] // block * type_size
        rows = math.prod(info.dims[1:])
        return self._mapping[info.data_offset:info.data_offset + rows * row_bytes].reshape(rows, row_bytes)

    @functools.cached_property
    def _mapping(self) -> np.ndarray:
        return np.memmap(self.path, dtype=np.uint8, mode="r")


def open_gguf(path: Path | GGUFFile) -> GGUFFile:
    """The file with its header read and checked; ValueError otherwise."""
    gguf = path if isinstance(path, GGUFFile) else GGUFFile(path)
    gguf.header  # noqa: B018 - read and checked here
    return gguf


@dataclass
class TensorInfo:
    """One tensor's entry in a GGUF header (dims innermost first; offset from the data start)."""

    name: str
    dims: list[int]
    type: int
    data_offset: int  # absolute, in the file


@dataclass
class GGUFHeader:
    architecture: str  # general.architecture ('' when the file names none)
    tensors: list[TensorInfo]
    metadata: dict[str, int | float | str | bool] = field(default_factory=dict)  # scalar fields (arrays left out)
    family: ModelFamily | None = None  # set by GGUFFile once the architecture is found served


def scan_header(path: Path) -> GGUFHeader:
    """The architecture and tensor entries of a GGUF header, read field by field (never the
    data) so that a corrupt or truncated header is refused with where it broke."""
    with open(path, "rb") as f:
        header = _Header(f, path.stat().st_size, path.name)
        if header.raw(4) != b"GGUF":
            raise ValueError(f"{path.name} is not a GGUF file (no GGUF magic)")
        version = header.u32()
        if version not in (2, 3):
            raise ValueError(f"{path.name} is GGUF version {version}; versions 2 and 3 are read")
        count, kv_count = header.u64(), header.u64()
        metadata: dict[str, int | float | str | bool] = {}
        for _ in range(kv_count):
            key = header.string()
            kind = header.u32()
            value = header.value(kind)
            if value is not None:
                metadata[key] = value
        alignment = metadata.get("general.alignment", 32)
        alignment = alignment if isinstance(alignment, int) and not isinstance(alignment, bool) and alignment > 0 else 32
        arch = metadata.get("general.architecture", "")
        arch = arch if isinstance(arch, str) else ""
        entries = []
        for _ in range(count):
            name = header.string()
            n_dims = header.u32()
            if not 0 < n_dims <= 4:
                raise ValueError(f"tensor {name!r} of {path.name} has {n_dims} dimensions")
            dims = [header.u64() for _ in range(n_dims)]
            entries.append((name, dims, header.u32(), header.u64()))
        start = -(-header.position // alignment) * alignment
    return GGUFHeader(arch, [TensorInfo(name, dims, kind, start + offset) for name, dims, kind, offset in entries],
                      metadata)


class _Header:
    """Little-endian reads from a GGUF header that refuse to run past the end of the file."""

    _SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}

    def __init__(self, f, size: int, name: str):
        self.f, self.size, self.name, self.position = f, size, name, 0

    def raw(self, n: int) -> bytes:
        if n < 0 or self.position + n > self.size:
            raise ValueError(f"{self.name} is truncated or corrupt: its header runs past the end of the file "
                             f"(byte {self.position + n} of {self.size})")
        self.position += n
        return self.f.read(n)

    def u32(self) -> int:
        return struct.unpack("<I", self.raw(4))[0]

    def u64(self) -> int:
        return struct.unpack("<Q", self.raw(8))[0]

    def string(self) -> str:
        return self.raw(self.u64()).decode("utf-8", errors="replace")

    def value(self, kind: int):
        if kind in self._SCALARS:
            fmt = self._SCALARS[kind]
            return struct.unpack(fmt, self.raw(struct.calcsize(fmt)))[0]
        if kind == 8:
            return self.string()
        if kind == 9:
            item, count = self.u32(), self.u64()
            if item in self._SCALARS:  # skipped whole: a vocabulary's scores are 100k+ values
                self.f.seek(self.position)
                self.raw(count * struct.calcsize(self._SCALARS[item]))
                return None
            for _ in range(count):
                self.value(item)
            return None
        raise ValueError(f"{self.name} has a metadata value of unknown type {kind} at byte {self.position}")


def read_weights(source: Path | GGUFFile, quantized: bool) -> dict[str, torch.Tensor | QuantWeight]:
    """Every tensor of the file named as transformers names it, its values as the family's
    model holds them (as stored, but for the row order of Llama's q/k): the repackable
    quantized types as QuantWeight when `quantized` (2-D weights, and stacked experts as [E * out,
    in]; never a bias), everything else float32."""
    from gguf import GGMLQuantizationType, quants

    gguf = open_gguf(source)
    arch, meta = gguf.header.architecture, gguf.header.metadata
    names = model_class(gguf.family)
    heads = _int(meta.get(f"{arch}.attention.head_count"))
    kv_heads = _int(meta.get(f"{arch}.attention.head_count_kv")) or heads
    interleaved = arch in names.gguf_interleaved_qk and heads is not None
    mtp = _mtp_blocks(meta, arch)
    out: dict[str, torch.Tensor | QuantWeight] = {}
    for info in gguf.header.tensors:
        if _block(info.name) in mtp:
            continue  # a multi-token-prediction block (llama.cpp's nextn layers), not run
        name = hf_name(info.name, arch, names.gguf_layer_names)
        kind = GGMLQuantizationType(info.type)
        shape = [int(d) for d in reversed(info.dims)]  # GGUF lists the innermost dimension first
        raw = gguf.raw(info)
        permute = _permutation(name, heads, kv_heads, shape[0]) if interleaved else None
        if quantized and kind.name in REPACKED and len(shape) in (2, 3) and shape[-1] % 64 == 0 \
                and not name.endswith(".bias"):  # a bias (gpt-oss's experts' [E, out]) is added, not multiplied
            # stacked experts [E, out, in] as one [E * out, in] weight (model/moe.py splits it)
            weight = repack(kind.name, raw, math.prod(shape[:-1]), shape[-1])
            out[name] = weight if permute is None else _permute_quant(weight, permute)
            continue
        values = raw.view(np.float32) if kind == GGMLQuantizationType.F32 else quants.dequantize(raw, kind)
        t = torch.from_numpy(np.array(values, dtype=np.float32)).reshape(shape)
        out[name] = t if permute is None else t[permute].contiguous()
    return out


def header_field(meta: dict, arch: str, name: str, default=None):
    """The header's `{arch}.{name}` (or `default`); refused, naming it, when the file lacks it."""
    value = meta.get(f"{arch}.{name}", default)
    if value is None:
        raise ValueError(f"the {arch} GGUF's header lacks {arch}.{name}")
    return value


def refuse_rope_scaling(meta: dict, arch: str) -> None:
    """For a config read from a header that knows only plain RoPE: a file whose RoPE is
    scaled (YaRN, linear, ...) is refused rather than served with unscaled positions."""
    kind = meta.get(f"{arch}.rope.scaling.type")
    factor = float(meta.get(f"{arch}.rope.scaling.factor", 1.0) or 1.0)
    if kind not in (None, "none", "") and factor != 1.0:
        raise ValueError(f"this {arch} GGUF scales RoPE ({arch}.rope.scaling.type {kind!r}, factor {factor:g}), "
                         f"which radixserve does not read from a {arch} header; serve its Hugging Face directory")


def _mtp_blocks(meta: dict, arch: str) -> range:
    """The blocks llama.cpp's converter appends for multi-token prediction (the last
    `nextn_predict_layers` of `block_count`)."""
    blocks, nextn = _int(meta.get(f"{arch}.block_count")), _int(meta.get(f"{arch}.nextn_predict_layers"))
    return range(blocks - nextn, blocks) if blocks and nextn else range(0)


def _block(gguf_name: str) -> int | None:
    parts = gguf_name.split(".", 2)
    return int(parts[1]) if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() else None


def hf_name(gguf_name: str, arch: str = "llama", layer_names: dict[str, str] | None = None) -> str:
    """transformers' name of a GGUF tensor (blk.3.attn_q.weight -> model.layers.3.self_attn.q_proj.weight),
    a block's tensors by the family's `layer_names` (CausalLM.gguf_layer_names)."""
    stem, _, suffix = gguf_name.rpartition(".")
    if stem in _TOP_NAMES:
        return f"{_TOP_NAMES[stem]}.{suffix}"
    parts = gguf_name.split(".", 2)  # blk.N.<stem>.<suffix>, the stem itself dotted in some (LFM2's shortconv.conv)
    names = GGUF_LAYER_NAMES if layer_names is None else layer_names
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit():
        if parts[2] in names:  # a whole name (Qwen3.5's ssm_a, ssm_dt.bias)
            return f"model.layers.{parts[1]}.{names[parts[2]]}"
        stem, _, suffix = parts[2].rpartition(".")
        if stem in names:
            return f"model.layers.{parts[1]}.{names[stem]}.{suffix}"
    raise ValueError(f"GGUF tensor {gguf_name!r} has no place in a {arch} model")


def _check_tensor(info: TensorInfo, file_size: int, file_name: str) -> None:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    name, dims = info.name, info.dims
    try:
        kind = GGMLQuantizationType(info.type)
    except ValueError:
        raise ValueError(f"tensor {name!r} of {file_name} has an unknown type {info.type}") from None
    if kind not in GGML_QUANT_SIZES:
        raise ValueError(f"tensor {name!r} of {file_name} has a type ({kind.name}) with no known block size")
    if any(d <= 0 or d > _MAX_DIM for d in dims):
        raise ValueError(f"tensor {name!r} of {file_name} has an impossible shape {dims}")
    block, type_size = GGML_QUANT_SIZES[kind]
    if dims[0] % block:
        raise ValueError(f"tensor {name!r} ({kind.name}) has rows of {dims[0]} values, not whole {block}-value blocks")
    end = info.data_offset + math.prod(dims) // block * type_size
    if end > file_size:
        raise ValueError(f"{file_name} is truncated: tensor {name!r} ends at byte {end} of a {file_size}-byte file")


def _int(value) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _permutation(name: str, heads: int, kv_heads: int, rows: int) -> torch.Tensor | None:
    """llama.cpp stores Llama's q and k rows interleaved for its RoPE; the row order that
    undoes it (as transformers' GGUF loader does), or None for other tensors."""
    if name.endswith("self_attn.q_proj.weight"):
        n = heads
    elif name.endswith("self_attn.k_proj.weight"):
        n = kv_heads
    else:
        return None
    index = torch.arange(rows).reshape(n, rows // n // 2, 2)
    return index.transpose(1, 2).reshape(rows)


def _permute_quant(weight: QuantWeight, rows: torch.Tensor) -> QuantWeight:
    return QuantWeight(weight.codes[rows].contiguous(), weight.scale[rows].contiguous(),
                       None if weight.offset is None else weight.offset[rows].contiguous(),
                       weight.bits, weight.group, weight.zero, weight.kind)


"""A GGUF file read as it is: its header checked before any work, its tensors named as in
transformers' checkpoints, quantized ones repacked (gguf_repack.py) and the rest float32.

Model files are input: a truncated file, a tensor whose shape, type or size disagrees with
the header, an unknown type or an absurd dimension is refused with an error naming the
tensor, before anything is converted or cached. The file is memory-mapped, never read whole.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from radixserve.kernels.quant_linear import QuantWeight
from radixserve.model.gguf_repack import REPACKED, repack
from radixserve.model.registry import family_for_gguf

_FLOAT_TYPES = ("F32", "F16", "BF16")
_MAX_DIM = 1 << 24  # no real weight has a side this long; a corrupt header often does

_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
# Gemma 3 names its four norms differently (its ffn_norm comes before the MLP, not after attention).
_GEMMA3_LAYER_NAMES = {
    **_LAYER_NAMES, "post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_LAYER_NAMES_BY_ARCH = {"gemma3": _GEMMA3_LAYER_NAMES}
# llama.cpp stores these architectures' RMSNorm weights as 1 + w; transformers' (and ours) hold w.
_NORM_PLUS_ONE = ("gemma3",)
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def open_gguf(path: Path):
    """The file's GGUFReader after its architecture and every tensor's header were checked;
    ValueError otherwise (in well under a second: the header is all that is read)."""
    from gguf import GGUFReader

    header = scan_header(path)
    try:
        family_for_gguf(header.architecture)
    except ValueError as exc:
        raise ValueError(f"{path.name}: {exc}") from None
    for info in header.tensors:
        _check_tensor(info, path.stat().st_size, path.name)
    try:
        return GGUFReader(path)
    except (ValueError, IndexError, KeyError, OSError, EOFError) as exc:
        raise ValueError(f"{path.name} is not a readable GGUF file: {exc}") from None


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
        alignment, arch = 32, ""
        for _ in range(kv_count):
            key = header.string()
            kind = header.u32()
            value = header.value(kind)
            if key == "general.alignment" and isinstance(value, int) and value > 0:
                alignment = value
            elif key == "general.architecture" and isinstance(value, str):
                arch = value
        entries = []
        for _ in range(count):
            name = header.string()
            n_dims = header.u32()
            if not 0 < n_dims <= 4:
                raise ValueError(f"tensor {name!r} of {path.name} has {n_dims} dimensions")
            dims = [header.u64() for _ in range(n_dims)]
            entries.append((name, dims, header.u32(), header.u64()))
        start = -(-header.position // alignment) * alignment
    return GGUFHeader(arch, [TensorInfo(name, dims, kind, start + offset) for name, dims, kind, offset in entries])


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


def architecture(reader) -> str:
    field = reader.fields.get("general.architecture")
    if field is None:
        raise ValueError("the GGUF file names no general.architecture")
    return bytes(field.parts[field.data[0]]).decode(errors="replace")


def read_weights(path: Path, quantized: bool) -> dict[str, torch.Tensor | QuantWeight]:
    """Every tensor of the file named as transformers names it: the repackable quantized
    types as QuantWeight when `quantized` (2-D weights only), everything else float32."""
    from gguf import quants

    reader = open_gguf(path)
    arch = architecture(reader)
    heads = _field_int(reader, f"{arch}.attention.head_count")
    kv_heads = _field_int(reader, f"{arch}.attention.head_count_kv") or heads
    out: dict[str, torch.Tensor | QuantWeight] = {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name, arch)
        kind = tensor.tensor_type.name
        shape = [int(d) for d in reversed(tensor.shape)]  # GGUF lists the innermost dimension first
        permute = _permutation(arch, name, heads, kv_heads, shape[0])
        if quantized and kind in REPACKED and len(shape) == 2 and shape[1] % 64 == 0:
            weight = repack(kind, np.asarray(tensor.data), shape[0], shape[1])
            out[name] = weight if permute is None else _permute_quant(weight, permute)
            continue
        values = np.asarray(tensor.data) if kind in _FLOAT_TYPES else quants.dequantize(tensor.data, tensor.tensor_type)
        t = torch.from_numpy(np.array(values, dtype=np.float32)).reshape(shape)
        if arch in _NORM_PLUS_ONE and name.endswith("norm.weight"):
            t = t - 1.0
        out[name] = t if permute is None else t[permute].contiguous()
    return out


def hf_name(gguf_name: str, arch: str = "llama") -> str:
    """transformers' name of a GGUF tensor (blk.3.attn_q.weight -> model.layers.3.self_attn.q_proj.weight)."""
    stem, _, suffix = gguf_name.rpartition(".")
    if stem in _TOP_NAMES:
        return f"{_TOP_NAMES[stem]}.{suffix}"
    parts = stem.split(".")
    names = _LAYER_NAMES_BY_ARCH.get(arch, _LAYER_NAMES)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}.{suffix}"
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


def _field_int(reader, key: str) -> int | None:
    field = reader.fields.get(key)
    return None if field is None else int(field.parts[field.data[0]][0])


def _permutation(arch: str, name: str, heads: int | None, kv_heads: int, rows: int) -> torch.Tensor | None:
    """llama.cpp stores Llama's q and k rows interleaved for its RoPE; the row order that
    undoes it (as transformers' GGUF loader does), or None for other tensors."""
    if arch not in ("llama", "mistral") or heads is None:
        return None
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

